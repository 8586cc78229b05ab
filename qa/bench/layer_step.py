"""One MoE layer and the tied embedding + lm_head, a training step each, bf16 and every FP8 recipe.

    python qa/bench/layer_step.py                 # GPU: the MoE shapes and embeddings below
    python qa/bench/layer_step.py --no-record     # the same, nothing appended
    python qa/bench/layer_step.py --tiny          # CPU smoke: tiny shapes (FP8 emulated)

Legend: E experts, T expert rows (token-to-expert assignments), K ``d_model``, N ``d_ff``; V vocabulary,
D ``d_model``.

The layers are the training job's own: a one-block ``MoEGPT(sharded=True, param_dtype=bf16)`` on one
rank (fp32 masters, bf16 compute copies, fp32 ``main_grad``), of which the benchmark takes
``blocks[0].moe`` (router ``Linear``, then ``GroupedLinear`` fc1/fc2 with deferred wgrads) and the tied
``embedding`` / ``lm_head`` pair. A MoE step routes T/top_k tokens top-2 (so the grouped GEMMs see T
rows, the shapes of docs/benchmarks' grouped GEMM table), runs forward and backward from a fixed
output gradient, drains the deferred wgrads and ends with ``finalize_model_grads``. An embedding step
looks up T ids, applies RMSNorm and the tied lm_head, and backpropagates the fp32 cross-entropy.
Under ``fp8_autocast`` (``fp8_per_tensor``: ``PerTensorScaling()``, ``fp8_blockwise``:
``BlockwiseScaling()``) the GEMMs run in FP8. Times: median of ``triton.testing.do_bench`` on CUDA,
of ``--reps`` steps on CPU. ``tflops``: the step's GEMM FLOPs (3 x forward) over its time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402

import distwgrad  # noqa: E402
from distwgrad.fp8 import BlockwiseScaling, PerTensorScaling, fp8_autocast  # noqa: E402
from distwgrad.models import MoEGPT, MoEGPTConfig  # noqa: E402
from distwgrad.models.moe_gpt import rms_norm  # noqa: E402

MOE_SHAPES = [(8, 32768, 4096, 14336), (64, 65536, 7168, 2048)]  # E, T, K, N
EMBED_SHAPES = [(32768, 2048, 16384), (128256, 4096, 8192)]  # V, D, T (the large preset's V and D first)
TINY_MOE, TINY_EMBED = [(4, 256, 64, 128)], [(256, 64, 256)]
TOP_K = 2
RECIPES = {"bf16": None, "fp8_per_tensor": PerTensorScaling, "fp8_blockwise": BlockwiseScaling}


def _model(device: torch.device, **sizes) -> MoEGPT:
    cfg = MoEGPTConfig(n_layers=1, n_heads=4, seq_len=8, **sizes)
    return MoEGPT(cfg, device=device, sharded=True, param_dtype=torch.bfloat16)


def moe_problem(E: int, T: int, K: int, N: int, device: torch.device):
    """(module, step inputs, GEMM FLOPs): the job's MoE layer and T/top_k bf16 tokens (seed 0)."""
    moe = _model(device, vocab_size=8, d_model=K, n_experts=E, top_k=TOP_K, d_ff=N).blocks[0].moe
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T // TOP_K, K, generator=gen).to(device, torch.bfloat16).requires_grad_()
    dy = torch.randn(T // TOP_K, K, generator=gen).to(device, torch.bfloat16)
    flops = 3 * (2 * (T // TOP_K) * K * E + 2 * 2 * T * K * N)  # router, fc1 and fc2; forward x 3
    return moe, (lambda: moe(x).backward(dy)), flops


def embed_problem(V: int, D: int, T: int, device: torch.device):
    """(module, step, GEMM FLOPs): the tied embedding and lm_head on T random ids (seed 0)."""
    model = _model(device, vocab_size=V, d_model=D, n_experts=1, top_k=1, d_ff=8)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(V, (1, T), generator=gen).to(device)
    targets = torch.randint(V, (T,), generator=gen).to(device)

    def step():
        logits = model.lm_head(rms_norm(model.embedding(ids)))
        F.cross_entropy(logits.flatten(0, 1).float(), targets).backward()
    return torch.nn.ModuleList([model.embedding, model.lm_head]), step, 3 * 2 * T * D * V


def _timed(module: torch.nn.Module, fwd_bwd, recipe, device: torch.device, reps: int) -> float:
    def step():
        with fp8_autocast(recipe()) if recipe is not None else torch.enable_grad():
            fwd_bwd()
        distwgrad.drain_deferred_wgrads(module)
        distwgrad.finalize_model_grads([module])
        for p in module.parameters():
            p.grad = None
    step()
    if device.type == "cuda":
        import triton

        return triton.testing.do_bench(step, rep=reps * 10)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench(args, device: torch.device) -> list[dict]:
    rows, prov = [], results.provenance(device)
    cases = [(f"moe E={E} T={T} K={K} N={N} top_k={TOP_K}", moe_problem, (E, T, K, N)) for E, T, K, N in args.moe]
    cases += [(f"tied_embedding V={V} D={D} T={T}", embed_problem, (V, D, T)) for V, D, T in args.embed]
    for case, problem, shape in cases:
        module, fwd_bwd, flops = problem(*shape, device)
        base_ms = None
        for precision in args.precisions:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            ms = _timed(module, fwd_bwd, RECIPES[precision], device, args.reps)
            base_ms = ms if precision == "bf16" else base_ms
            metrics = {"step_ms": (ms, "ms"), "tflops": (flops / ms / 1e9, "TFLOP/s")}
            if device.type == "cuda":
                metrics["peak_gib"] = (torch.cuda.max_memory_allocated(device) / 2 ** 30, "GiB")
            extra = {"vs_bf16": round(base_ms / ms, 3) if base_ms else None, "param_dtype": "bfloat16",
                     "master_dtype": "float32", "shape": list(shape)}
            for metric, (value, unit) in metrics.items():
                rows.append(results.row(bench="layer_step", case=case, impl="distwgrad", precision=precision,
                                        world=1, metric=metric, value=value, unit=unit, device=device,
                                        command=prov["command"], **extra))
            print(f"  {case:45s} {precision:15s} {ms:9.3f} ms  {flops / ms / 1e9:9.3g} TFLOP/s"
                  + (f"  ({extra['vs_bf16']:.2f}x bf16)" if extra["vs_bf16"] else ""), flush=True)
        del module, fwd_bwd
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(v) for v in s.split(","))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--moe", type=_ints, nargs="*", default=None, help="E,T,K,N MoE shapes")
    p.add_argument("--embed", type=_ints, nargs="*", default=None, help="V,D,T embedding shapes")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke)")
    p.add_argument("--precisions", default=",".join(RECIPES), help="comma-separated subset of " + ",".join(RECIPES))
    p.add_argument("--reps", type=int, default=20, help="CPU: timed steps; CUDA: do_bench rep = 10 x reps ms")
    results.add_arguments(p)
    args = p.parse_args(argv)
    args.precisions = tuple(v for v in args.precisions.split(",") if v)
    if not args.precisions or any(v not in RECIPES for v in args.precisions):
        p.error(f"--precisions: choose from {','.join(RECIPES)}")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if args.moe is None:
        args.moe = TINY_MOE if args.tiny or device.type == "cpu" else MOE_SHAPES
    if args.embed is None:
        args.embed = TINY_EMBED if args.tiny or device.type == "cpu" else EMBED_SHAPES
    results.record(bench(args, device), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
