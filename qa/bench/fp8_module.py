"""GroupedLinear forward + backward under the per-tensor FP8 recipe, with and without the aligned wgrad
layout ([Note: aligned token groups] in kernels/token_layout.py), beside the bf16 module, in one process.

    python qa/bench/fp8_module.py --json out.json       # GPU; the three MoE shapes by default

Each row times one training step of one GroupedLinear (E experts, T tokens routed uniformly at random,
seed 0, K in-features, N out-features, bf16 parameters): forward, then backward with the input gradient
and the weight gradients, either fresh (``.grad`` in bf16) or added into fp32 ``main_grad``
(``fuse_wgrad_accumulation``). Everything the step runs is timed: quantization, transposes, GEMMs.
``impl``: "bf16" (no recipe), "fp8" (per-tensor, the default dispatch: aligned where groups average
``ALIGN_MIN_TOKENS`` tokens), "fp8_plain" (per-tensor, never aligned). Rows: ``op`` ("step_fresh",
"step_main_grad"), ``shape`` [E, T, K, N], ``impl``, ``ms`` (median of ``triton.testing.do_bench``),
``tflops`` (the step's 6*T*K*N GEMM FLOPs over its time) and ``vs_bf16``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the repository root on the path, for ``qa.bench``
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from qa.bench import results  # noqa: E402

SHAPES = [(8, 32768, 4096, 14336), (64, 65536, 7168, 2048), (128, 16384, 2048, 768)]


def _step(mod, x, splits, recipe):
    """One forward + backward (``main_grad`` keeps growing across calls where the module fuses into it)."""
    from distwgrad.fp8 import fp8_autocast
    params = list(mod.parameters())
    dy = torch.randn(x.shape[0], mod.out_features, generator=torch.Generator().manual_seed(1)).to(x)

    def run():
        for p in params:
            p.grad = None
        if recipe is None:
            y = mod(x, splits)
        else:
            with fp8_autocast(recipe):
                y = mod(x, splits)
        y.backward(dy)
    return run


def _problem(E: int, T: int, K: int) -> tuple[torch.Tensor, list[int]]:
    """(x, m_splits): bf16 tokens that want their gradient, routed at random to E experts (seed 0)."""
    gen = torch.Generator().manual_seed(0)
    splits = torch.bincount(torch.multinomial(torch.ones(E), T, replacement=True, generator=gen),
                            minlength=E).tolist()
    return torch.randn(T, K, generator=gen).to("cuda", torch.bfloat16).requires_grad_(), splits


def _module(E: int, K: int, N: int, fuse: bool):
    """A bf16 GroupedLinear on the GPU, each expert with an fp32 ``main_grad`` where it ``fuse``s into one."""
    from distwgrad.nn import GroupedLinear
    mod = GroupedLinear(E, K, N, bias=False, params_dtype=torch.bfloat16, device="cuda", fuse_wgrad_accumulation=fuse)
    for p in mod.parameters() if fuse else ():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device="cuda")
    return mod


def bench(args) -> list[dict]:
    import triton

    from distwgrad.fp8 import PerTensorScaling
    from distwgrad.ops import grouped_gemm_fp8 as gg8
    rows = []
    for E, T, K, N in args.shapes:
        x, splits = _problem(E, T, K)
        for fuse in (False, True):
            mod = _module(E, K, N, fuse)
            op = "step_main_grad" if fuse else "step_fresh"
            times = {}
            for impl, recipe, min_tokens in (("bf16", None, None), ("fp8", PerTensorScaling(), gg8.ALIGN_MIN_TOKENS),
                                             ("fp8_plain", PerTensorScaling(), 10 ** 12)):
                saved = gg8.ALIGN_MIN_TOKENS
                gg8.ALIGN_MIN_TOKENS = min_tokens if min_tokens is not None else saved
                try:
                    times[impl] = triton.testing.do_bench(_step(mod, x, splits, recipe), rep=args.rep)
                finally:
                    gg8.ALIGN_MIN_TOKENS = saved
            for impl, ms in times.items():
                rows.append({"op": op, "shape": [E, T, K, N], "impl": impl, "ms": round(ms, 4),
                             "tflops": round(6 * T * K * N / ms / 1e9, 1), "vs_bf16": round(times["bf16"] / ms, 3),
                             "device": torch.cuda.get_device_name()})
                print(f"  {op:15s} {E},{T},{K},{N}  {impl:10s} {ms:8.3f} ms  {rows[-1]['tflops']:7.1f} TFLOP/s "
                      f"({rows[-1]['vs_bf16']:.2f}x bf16)", flush=True)
            del mod
        del x
        torch.cuda.empty_cache()
    return rows


def profile(args) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from distwgrad.fp8 import PerTensorScaling
    for E, T, K, N in args.shapes:
        x, splits = _problem(E, T, K)
        step = _step(_module(E, K, N, fuse=False), x, splits, PerTensorScaling())
        step()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        print(f"== E={E} T={T} K={K} N={N}: three fresh FP8 steps", flush=True)
        for key in ("cuda_time_total", "cpu_time_total"):
            print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60), flush=True)
        del step, x
        torch.cuda.empty_cache()


def host(args) -> list[dict]:
    """Host time of the experts' FP8 materialization per step (forward's and backward's, the latter from
    forward's amaxes, as GroupedLinear runs them: medians of seven passes of 50 steps each), then of whole
    steps (bf16 and FP8, fresh and ``main_grad``), each timed before the device catches up: what a
    host-bound step pays ([Note: a group of weights in two launches])."""
    import statistics
    import time

    from distwgrad.fp8 import PerTensorScaling
    from distwgrad.fp8.weights import materialize_quantized_group
    recipe, rows = PerTensorScaling(), []
    for E, _, K, N in args.shapes:
        mod = _module(E, K, N, fuse=False)
        ws = [getattr(mod, f"weight{e}") for e in range(E)]
        passes = []
        for _ in range(7):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                q = materialize_quantized_group(ws, recipe, backward=False, stacked=True)
                materialize_quantized_group(ws, recipe, backward=True, stacked=True, amax=q.amax)
            passes.append((time.perf_counter() - t0) / 50 * 1e6)
            torch.cuda.synchronize()
        us = statistics.median(passes)
        rows.append({"op": "materialize_host", "shape": [E, K, N], "impl": "fp8", "us": round(us, 1),
                     "device": torch.cuda.get_device_name()})
        print(f"  materialize_host  E={E} K={K} N={N}  {us:7.1f} us per step (host)", flush=True)
        del mod, ws
    for E, T, K, N in args.shapes:  # whole steps: 20 after 5 of warm-up, timed before the device catches up
        x, splits = _problem(E, T, K)
        for fuse in (False, True):
            mod = _module(E, K, N, fuse)
            for impl, rec in (("bf16", None), ("fp8", recipe)):
                run = _step(mod, x, splits, rec)
                for _ in range(5):
                    run()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(20):
                    run()
                ms = (time.perf_counter() - t0) / 20 * 1e3
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t0) / 20 * 1e3
                op = "step_main_grad_host" if fuse else "step_fresh_host"
                rows.append({"op": op, "shape": [E, T, K, N], "impl": impl, "ms": round(ms, 3),
                             "wall_ms": round(wall, 3), "device": torch.cuda.get_device_name()})
                print(f"  {op:20s} {E},{T},{K},{N}  {impl:5s} host {ms:7.3f} ms, wall {wall:7.3f} ms per step",
                      flush=True)
            del mod
        del x
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=lambda s: tuple(int(v) for v in s.split(",")), nargs="+", default=SHAPES,
                   help="E,T,K,N")
    p.add_argument("--rep", type=int, default=200, help="do_bench repetition time, ms")
    p.add_argument("--json", default=None)
    results.add_arguments(p)
    p.add_argument("--profile", action="store_true",
                   help="instead: torch.profiler over three fresh FP8 steps per shape, the top operators by "
                        "device time and by host time")
    p.add_argument("--host", action="store_true",
                   help="instead: the host time per step of the experts' FP8 materialization and of whole steps")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_module bench needs a CUDA device", file=sys.stderr)
        return 2
    if args.profile:
        profile(args)
        return 0
    rows = host(args) if args.host else bench(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    results.record(result_rows(rows, host=args.host), args)
    return 0


def result_rows(rows: list[dict], *, host: bool) -> list[dict]:
    """This run's rows for docs/benchmarks/results.jsonl (benches ``fp8_module``, ``fp8_module_host``)."""
    out = []
    for r in rows:
        prec = "bf16" if r["impl"] == "bf16" else "fp8_per_tensor"
        impl = "distwgrad_never_aligned" if r["impl"] == "fp8_plain" else "distwgrad"
        op = r["op"].removesuffix("_host").removeprefix("step_")
        rec = {**r, "op": op, "impl": impl, "precision": prec}
        if len(r["shape"]) == 3:  # the experts' weights alone
            rec["shape"] = " ".join(f"{n}={v}" for n, v in zip("EKN", r["shape"], strict=True))
        if host:
            metrics = {"us": "us"} if "us" in r else {"ms": "ms"}
            rows_ = results.from_records([rec], bench="fp8_module_host", device="cuda", metrics=metrics)
            out += [{**x, "metric": "host_" + x["metric"]} for x in rows_]
        else:
            rows_ = results.from_records([rec], bench="fp8_module", device="cuda", metrics={"ms": "ms"})
            out += [{**x, "metric": "step_ms"} for x in rows_]
    return out


if __name__ == "__main__":
    sys.exit(main())
