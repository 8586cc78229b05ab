"""One MoE layer and the tied embedding + lm_head, a training step each, bf16 and every FP8 recipe.

    python qa/bench/layer_step.py                 # GPU: the MoE shapes and embeddings below
    python qa/bench/layer_step.py --no-record     # the same, nothing appended
    python qa/bench/layer_step.py --tiny          # CPU smoke: tiny shapes (FP8 emulated)
    # GPU: the MoE layers beside the plain-torch layer, bf16 and converted to torchao's FP8
    python qa/bench/layer_step.py --impls distwgrad,torch --precisions bf16,fp8_per_tensor --no-record
    # GPU: the E=128 MoE layer eager and CUDA-graphed, bf16 and both FP8 recipes, no embedding case
    python qa/bench/layer_step.py --moe 128,16384,2048,768 --embed --cuda-graph
    # GPU: also where each case's device time goes (torch.profiler over three steps, the top kernels and the
    # kernel time by kind: GEMMs, quantization, the rest)
    python qa/bench/layer_step.py --embed --profile --no-record
    # GPU: the blockwise E=8 layer under two launch choices of its wgrad, in one process (rotated rounds)
    python qa/bench/layer_step.py --moe 8,32768,4096,14336 --embed --precisions fp8_blockwise \
        --tunings "" grouped_gemm_fp8.wgrad_gluon_stages_blockwise=3

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

``--impls distwgrad,torch`` adds the peer: the plain-torch layer of ``MoEGPT(sharded=False,
experts="grouped_mm")`` (fp32 masters cast to bf16 at each use; fc1 and fc2 one ``torch._grouped_mm`` each),
timed in the same process after the distwgrad layer of each case. Under ``fp8_per_tensor`` it is converted to
torchao's FP8 as ``train_step.py``'s peers are (``_torchao_fp8.py``: FP8 rowwise grouped experts, the router
bf16); its rows carry ``recipe`` "torchao" and ``vs_bf16`` against the plain layer's bf16. Where that peer
cannot run (no torchao, no SM90 GPU, the blockwise recipe, the tied embedding, which torchtitan keeps bf16)
the case prints "not run" with the reason.

``--cuda-graph`` (CUDA only) also times each MoE case with a second copy of the layer (same weights, same
inputs) graphed by ``distwgrad.make_graphed_callables``: forward, backward and each deferred expert wgrad
replay from CUDA graphs captured under the case's recipe (the weights reduce synchronously, as the job's
``--cuda-graph`` builds them: ``launch/cuda_graph.py``); the drain replays the wgrad graphs into the fp32
``main_grad``, and ``finalize_model_grads`` runs eagerly. Those rows' case ends in ``cuda_graph``; they
carry ``vs_eager`` (eager time / graphed time), and their ``peak_gib`` is the graphed copy's own (everything
allocated from its build on: weights, ``main_grad``, the graph pool and graph-owned buffers, the steps).
The weights do not change between steps here, so every FP8 recipe may be graphed (the job refuses the
per-tensor ones, whose cached amax would go stale after an update).

``--tunings A B ...`` (comma-separated ``family.knob=value`` assignments of ``distwgrad.kernels.tuning``; ""
is the defaults) times each case and precision under each tuning, in ``--rounds`` rounds whose order rotates
(each tuning first in one round), and prints each tuning's median against the first's and whether one step's
``main_grad`` from zeros is the same bits as under the first. Its rows' impl is ``distwgrad@<tuning>``
(kept off benchmarks.md's layer table).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torchao_fp8  # noqa: E402
import _trace  # noqa: E402
import _tunings  # noqa: E402
import distwgrad.kernels  # noqa: E402
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
IMPLS = ("distwgrad", "torch")


def _model(device: torch.device, sharded: bool = True, **sizes) -> MoEGPT:
    cfg = MoEGPTConfig(n_layers=1, n_heads=4, seq_len=8, **sizes)
    return MoEGPT(cfg, device=device, sharded=sharded, param_dtype=torch.bfloat16,
                  experts="loop" if sharded else "grouped_mm")


def _moe(E: int, T: int, K: int, N: int, device: torch.device, model: MoEGPT | None = None):
    """The job's MoE layer (of ``model`` if given) and T/top_k bf16 tokens with an output gradient (seed 0)."""
    model = _model(device, vocab_size=8, d_model=K, n_experts=E, top_k=TOP_K, d_ff=N) if model is None else model
    moe = model.blocks[0].moe
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T // TOP_K, K, generator=gen).to(device, torch.bfloat16).requires_grad_()
    dy = torch.randn(T // TOP_K, K, generator=gen).to(device, torch.bfloat16)
    return moe, x, dy


def moe_problem(E: int, T: int, K: int, N: int, device: torch.device):
    """(module, step, GEMM FLOPs): the job's MoE layer on T/top_k tokens."""
    moe, x, dy = _moe(E, T, K, N, device)
    flops = 3 * (2 * (T // TOP_K) * K * E + 2 * 2 * T * K * N)  # router, fc1 and fc2; forward x 3
    return moe, (lambda: moe(x).backward(dy)), flops


def peer_moe_problem(E: int, T: int, K: int, N: int, device: torch.device, precision: str):
    """(module, step, facts): the plain-torch MoE layer on :func:`moe_problem`'s tokens, under
    ``fp8_per_tensor`` converted to torchao's FP8; ``facts`` are its rows' extra fields."""
    model = _model(device, sharded=False, vocab_size=8, d_model=K, n_experts=E, top_k=TOP_K, d_ff=N)
    facts = {}
    if precision == "fp8_per_tensor":
        facts = _torchao_fp8.convert(model, tokens=T // TOP_K, experts=True)
    moe, x, dy = _moe(E, T, K, N, device, model)
    return moe, (lambda: moe(x).backward(dy)), facts


def peer_why(case_kind: str, precision: str, device: torch.device) -> str | None:
    """Why the plain-torch peer of a ``case_kind`` ("moe" or "embed") case is not run at ``precision``."""
    if precision == "bf16":
        return None
    if case_kind == "embed":
        return "torchtitan's float8 keeps the tied embedding and lm_head bf16: there is no FP8 peer of this case"
    why = _torchao_fp8.peer_why(precision, device)
    if why is None and device.type != "cuda":
        why = _torchao_fp8.experts_why(device)
    return why


def graphed_moe_problem(E: int, T: int, K: int, N: int, device: torch.device, recipe):
    """(module, step): :func:`moe_problem`'s layer and inputs, CUDA-graphed under ``recipe`` (a class or None)."""
    moe, x, dy = _moe(E, T, K, N, device)
    _job_cuda_graph().synchronous_reductions((moe,))
    distwgrad.make_graphed_callables(moe, (x,), fp8_enabled=recipe is not None,
                                     fp8_recipe=None if recipe is None else recipe())
    return moe, (lambda: moe(x).backward(dy))


def _job_cuda_graph():
    try:
        from distwgrad.launch import cuda_graph
    except ImportError:  # a bare checkout: the job's package is launch/ at the repository root
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from launch import cuda_graph
    return cuda_graph


def embed_problem(V: int, D: int, T: int, device: torch.device, sharded: bool = True):
    """(module, step, GEMM FLOPs): the tied embedding and lm_head on T random ids (seed 0); ``sharded``
    False: the plain-torch pair."""
    model = _model(device, sharded=sharded, vocab_size=V, d_model=D, n_experts=1, top_k=1, d_ff=8)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(V, (1, T), generator=gen).to(device)
    targets = torch.randint(V, (T,), generator=gen).to(device)

    def step():
        logits = model.lm_head(rms_norm(model.embedding(ids)))
        F.cross_entropy(logits.flatten(0, 1).float(), targets).backward()
    return torch.nn.ModuleList([model.embedding, model.lm_head]), step, 3 * 2 * T * D * V


def _timed(module: torch.nn.Module, fwd_bwd, recipe, device: torch.device, reps: int) -> float:
    def step():
        _step(module, fwd_bwd, recipe)
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


def _profile(module: torch.nn.Module, fwd_bwd, recipe, case: str, precision: str, steps: int = 3) -> None:
    """Print where ``steps`` warm steps spend device time: the top kernels and the total per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            _step(module, fwd_bwd, recipe)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if str(getattr(e, "device_type", "")) == "DeviceType.CUDA"]
    busy_ms = sum(e.time_range.end - e.time_range.start for e in kernels) / 1e3 / steps
    kinds = _trace.kernel_kinds(((e.name, e.time_range.end - e.time_range.start) for e in kernels), steps)
    print(f"== {case} {precision}: {steps} steps, kernels {busy_ms:.3f} ms a step\n"
          f"{_trace.op_table(prof, rows=18)}\n{_trace.kinds_table(kinds)}", flush=True)


def _step(module: torch.nn.Module, fwd_bwd, recipe) -> None:
    with fp8_autocast(recipe()) if recipe is not None else torch.enable_grad():
        fwd_bwd()
    distwgrad.drain_deferred_wgrads(module)
    distwgrad.finalize_model_grads([module])
    for p in module.parameters():
        p.grad = None


def bench(args, device: torch.device) -> list[dict]:
    rows, prov = [], results.provenance(device)
    cases = [(f"moe E={E} T={T} K={K} N={N} top_k={TOP_K}", moe_problem, (E, T, K, N)) for E, T, K, N in args.moe]
    cases += [(f"tied_embedding V={V} D={D} T={T}", embed_problem, (V, D, T)) for V, D, T in args.embed]
    for case, problem, shape in cases:
        module, fwd_bwd, flops = problem(*shape, device)
        base_ms = None
        for precision in args.precisions:
            if args.tunings:
                rows += _tuning_rows(case, module, fwd_bwd, precision, flops, device, args, prov)
                continue
            ms, timed_rows = _timed_rows(case, "distwgrad", precision, module, fwd_bwd, RECIPES[precision], base_ms,
                                         shape, flops, device, args, prov)
            rows += timed_rows
            base_ms = ms if precision == "bf16" else base_ms
            if args.profile:
                _profile(module, fwd_bwd, RECIPES[precision], case, precision)
            if args.cuda_graph and problem is moe_problem:
                rows += _graphed_rows(case, shape, precision, ms, flops, device, args, prov)
        del module, fwd_bwd
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if "torch" in args.impls:  # never with --tunings (main refuses both)
            rows += _peer_rows(case, problem, shape, flops, device, args, prov)
    return rows


def _timed_rows(case: str, impl: str, precision: str, module: torch.nn.Module, fwd_bwd, recipe, base_ms: float | None,
                shape, flops: int, device: torch.device, args, prov: dict, facts: dict | None = None
                ) -> tuple[float, list[dict]]:
    """Times one build of ``case`` at ``precision`` (``recipe``: the fp8_autocast one, None for bf16 and the peer,
    which quantizes itself); ``(ms, rows)``, printing the line. ``base_ms``: the same build's bf16 time, if run."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ms = _timed(module, fwd_bwd, recipe, device, args.reps)
    metrics = {"step_ms": (ms, "ms"), "tflops": (flops / ms / 1e9, "TFLOP/s")}
    if device.type == "cuda":
        metrics["peak_gib"] = (torch.cuda.max_memory_allocated(device) / 2 ** 30, "GiB")
    vs_bf16 = 1.0 if precision == "bf16" else round(base_ms / ms, 3) if base_ms else None
    extra = {"vs_bf16": vs_bf16, "param_dtype": "bfloat16", "master_dtype": "float32", "shape": list(shape),
             **(facts or {})}
    rows = [results.row(bench="layer_step", case=case, impl=impl, precision=precision, world=1, metric=metric,
                        value=value, unit=unit, device=device, command=prov["command"], **extra)
            for metric, (value, unit) in metrics.items()]
    name = "" if impl == "distwgrad" else f"{impl}{' (torchao)' if facts else ''}: "
    print(f"  {case:45s} {precision:15s} {name}{ms:9.3f} ms  {flops / ms / 1e9:9.3g} TFLOP/s"
          + (f"  ({vs_bf16:.2f}x bf16)" if vs_bf16 else ""), flush=True)
    return ms, rows


def _peer_rows(case: str, problem, shape, flops: int, device: torch.device, args, prov: dict) -> list[dict]:
    """The plain-torch peer of ``case`` at each precision it runs (module docstring), each in a fresh layer."""
    rows, base_ms = [], None
    for precision in args.precisions:
        why = peer_why("moe" if problem is moe_problem else "embed", precision, device)
        if why is not None:
            print(f"  {case:45s} {precision:15s} torch: not run ({why})", flush=True)
            continue
        if problem is moe_problem:
            module, fwd_bwd, facts = peer_moe_problem(*shape, device, precision)
        else:
            module, fwd_bwd, _ = embed_problem(*shape, device, sharded=False)
            facts = {}
        ms, timed_rows = _timed_rows(case, "torch", precision, module, fwd_bwd, None, base_ms, shape, flops, device,
                                     args, prov, facts)
        rows += timed_rows
        base_ms = ms if precision == "bf16" else base_ms
        del module, fwd_bwd
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _main_grads(module: torch.nn.Module, fwd_bwd, recipe) -> list[torch.Tensor]:
    """Copies of the ``main_grad`` of ``module``'s weights after one step from zeros."""
    weights = [p for p in module.parameters() if getattr(p, "main_grad", None) is not None]
    for p in weights:
        p.main_grad.zero_()
    _step(module, fwd_bwd, recipe)
    return [p.main_grad.clone() for p in weights]


def _tuning_rows(case: str, module: torch.nn.Module, fwd_bwd, precision: str, flops: int, device: torch.device,
                 args, prov: dict) -> list[dict]:
    """``case`` at ``precision`` under each of ``--tunings`` in rotated rounds: the medians, each against the
    first tuning's, and whether its ``main_grad`` bits are the first's."""
    recipe, names = RECIPES[precision], list(args.tunings)
    grads, times = {}, {n: [] for n in names}
    for n in names:
        with distwgrad.kernels.tuning(**args.tunings[n]):
            _step(module, fwd_bwd, recipe)  # builds this tuning's kernels; main_grad exists from here on
            grads[n] = _main_grads(module, fwd_bwd, recipe)
    for r in range(args.rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            with distwgrad.kernels.tuning(**args.tunings[n]):
                times[n].append(_timed(module, fwd_bwd, recipe, device, args.reps))
    base = statistics.median(times[names[0]])
    rows = []
    for n in names:
        ms = statistics.median(times[n])
        same = all(torch.equal(a, b) for a, b in zip(grads[n], grads[names[0]], strict=True))
        extra = {"vs_first": round(base / ms, 4), "tuning": n, "tunings": list(names), "rounds_ms": times[n],
                 "main_grad_same_bits": same, "param_dtype": "bfloat16", "master_dtype": "float32",
                 "timing": "order rotated"}
        for metric, (value, unit) in {"step_ms": (ms, "ms"), "tflops": (flops / ms / 1e9, "TFLOP/s")}.items():
            rows.append(results.row(bench="layer_step", case=case, impl=f"distwgrad@{n}", precision=precision,
                                    world=1, metric=metric, value=value, unit=unit, device=device,
                                    command=prov["command"], **extra))
        print(f"  {case:45s} {precision:15s} {n:40s} {ms:9.3f} ms  {flops / ms / 1e9:9.3g} TFLOP/s  "
              f"{extra['vs_first']:.3f}x the first  main_grad {'same bits' if same else 'DIFFERENT bits'}",
              flush=True)
    return rows


def _graphed_rows(case: str, shape, precision: str, eager_ms: float, flops: int, device: torch.device, args,
                  prov: dict) -> list[dict]:
    """The graphed copy of a MoE case: its rows, ``vs_eager`` against the eager time of the same case."""
    base = torch.cuda.memory_allocated(device)  # the eager copy and its inputs: not this copy's
    torch.cuda.reset_peak_memory_stats(device)
    module, fwd_bwd = graphed_moe_problem(*shape, device, RECIPES[precision])
    ms = _timed(module, fwd_bwd, RECIPES[precision], device, args.reps)
    metrics = {"step_ms": (ms, "ms"), "tflops": (flops / ms / 1e9, "TFLOP/s"),
               "peak_gib": ((torch.cuda.max_memory_allocated(device) - base) / 2 ** 30, "GiB")}
    extra = {"vs_eager": round(eager_ms / ms, 3), "param_dtype": "bfloat16", "master_dtype": "float32",
             "shape": list(shape), "graphed_by": "distwgrad.make_graphed_callables (forward, backward, deferred "
             "wgrads; finalize_model_grads eager)"}
    print(f"  {case + ' cuda_graph':45s} {precision:15s} {ms:9.3f} ms  {flops / ms / 1e9:9.3g} TFLOP/s"
          f"  ({extra['vs_eager']:.2f}x eager)", flush=True)
    module.reset()
    del module, fwd_bwd
    gc.collect()  # the graphed forward refers to its module: a cycle
    torch.cuda.empty_cache()
    return [results.row(bench="layer_step", case=f"{case} cuda_graph", impl="distwgrad", precision=precision, world=1,
                        metric=metric, value=value, unit=unit, device=device, command=prov["command"], **extra)
            for metric, (value, unit) in metrics.items()]


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(v) for v in s.split(","))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--moe", type=_ints, nargs="*", default=None, help="E,T,K,N MoE shapes")
    p.add_argument("--embed", type=_ints, nargs="*", default=None, help="V,D,T embedding shapes")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke)")
    p.add_argument("--precisions", default=",".join(RECIPES), help="comma-separated subset of " + ",".join(RECIPES))
    p.add_argument("--impls", default="distwgrad", help="comma-separated subset of " + ",".join(IMPLS)
                   + "; torch: the plain-torch layer, its FP8 torchao's (module docstring)")
    p.add_argument("--reps", type=int, default=20, help="CPU: timed steps; CUDA: do_bench rep = 10 x reps ms")
    p.add_argument("--cuda-graph", action="store_true", help="also time each MoE case CUDA-graphed (forward, "
                   "backward, deferred wgrads replayed by distwgrad.make_graphed_callables; CUDA only)")
    p.add_argument("--profile", action="store_true", help="also print each case's top kernels over three steps "
                   "(torch.profiler; CUDA only)")
    p.add_argument("--tunings", nargs="+", default=None, metavar="TUNING",
                   help="time each case under each kernel tuning (family.knob=value,...; \"\" for the defaults), "
                        "in rotated rounds; the first is the baseline")
    p.add_argument("--rounds", type=int, default=4, help="--tunings: rounds (each tuning timed once a round)")
    results.add_arguments(p)
    args = p.parse_args(argv)
    if args.tunings is not None:
        labels = [_tunings.label(t) for t in args.tunings]
        twice = sorted({n for n in labels if labels.count(n) > 1})
        if twice and len(set(labels)) > 1:
            p.error(f"--tunings: {', '.join(twice)} given twice")
        try:
            args.tunings = {_tunings.label(t): _tunings.parse_assignments(t, "--tunings") for t in args.tunings}
        except (ValueError, TypeError) as exc:
            p.error(str(exc))
        if len(args.tunings) < 2:
            p.error("--tunings: give at least two different tunings (\"\" is the defaults)")
        if args.cuda_graph or args.profile:
            p.error("--tunings times the eager step only; run --cuda-graph and --profile without it")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    args.impls = tuple(v for v in args.impls.split(",") if v)
    if "distwgrad" not in args.impls or any(v not in IMPLS for v in args.impls):
        p.error(f"--impls: distwgrad and optionally torch (of {','.join(IMPLS)}), got {','.join(args.impls)!r}")
    if "torch" in args.impls and args.tunings is not None:
        p.error("--tunings times distwgrad's kernels; run --impls torch without it")
    args.precisions = tuple(v for v in args.precisions.split(",") if v)
    if not args.precisions or any(v not in RECIPES for v in args.precisions):
        p.error(f"--precisions: choose from {','.join(RECIPES)}")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if args.cuda_graph and device.type != "cuda":
        p.error("--cuda-graph needs a CUDA device: CUDA graphs capture CUDA kernels, and CUDA is not available on "
                "this machine")
    if args.profile and device.type != "cuda":
        p.error("--profile needs a CUDA device: it reports kernel times, and CUDA is not available on this machine")
    if args.moe is None:
        args.moe = TINY_MOE if args.tiny or device.type == "cpu" else MOE_SHAPES
    if args.embed is None:
        args.embed = TINY_EMBED if args.tiny or device.type == "cpu" else EMBED_SHAPES
    results.record(bench(args, device), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
