"""Where the grouped GEMM kernels' time goes on a GPU: the bf16 fprop/dgrad Triton kernel timed side by
side with torch._grouped_mm and a dense mm of the same FLOPs, the FP8 Gluon kernels against other builds
of them (``--fp8-ab``, ``--wgrad-ab``), and a handful of launches for Nsight Compute to read the hardware
counters of (``--ncu``; ``ncu_hotspots.py`` summarises the report).

    python qa/bench/gemm_profile.py --json out.json                    # timings, ratios, bit checks
    python qa/bench/gemm_profile.py --fp8-ab MODULE ...                # A/B of FP8 kernel builds
    python qa/bench/gemm_profile.py --wgrad-ab [MODULE ...] --wgrad-stages 5 6  # the FP8 wgrad's
    ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --csv \\
        python qa/bench/gemm_profile.py --ncu                            # one launch of each target

Every FP8 Gluon build's output is compared with today's bit for bit before it is timed (the same wgmma
products in the same K order)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distwgrad.kernels import grouped_gemm as G  # noqa: E402
from distwgrad.kernels import tuning  # noqa: E402
from gemm_kernels import impls_for, make_problem  # noqa: E402  (the bench's problems and peers)

if __package__ in (None, ""):  # run as a script: the repository root on the path, for ``qa.bench``
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from qa.bench import results  # noqa: E402

SHAPES = [(8, 32768, 4096, 14336), (64, 65536, 7168, 2048)]


def _bf16_impls(op: str, p) -> dict:
    a = p.x if op == "fprop" else p.dy
    out_cols = p.N if op == "fprop" else p.K
    w_trans = op == "fprop"

    out = torch.empty(p.T, out_cols, device=a.device, dtype=a.dtype)

    def ours():
        return G._launch_ragged(a, p.w, p.offs, None, out, w_trans=w_trans, config=None, use_tma=None)
    peers = impls_for(op, p)
    return {"triton": ours, "torch_grouped_mm": peers["torch_grouped_mm"], "dense": peers["dense"]}


def _fp8_targets(shape) -> dict:
    """FP8 fprop (blockwise), dgrad and fresh and accumulating wgrad (per-tensor), and the blockwise
    accumulating wgrad, through the default kernels, pre-quantized."""
    import fp8 as B

    from distwgrad.fp8.recipe import BlockwiseScaling, PerTensorScaling
    p = B._gemm_problem(*shape, "cuda")
    main = torch.zeros(shape[0], shape[3], shape[2], device="cuda")
    out = {}
    for name, recipe, op in (("fp8_blockwise_fprop", BlockwiseScaling(), "fprop"),
                             ("fp8_per_tensor_dgrad", PerTensorScaling(), "dgrad"),
                             ("fp8_per_tensor_wgrad", PerTensorScaling(), "wgrad"),
                             ("fp8_per_tensor_wgrad_acc", PerTensorScaling(), "wgrad_accumulate"),
                             ("fp8_blockwise_wgrad_acc", BlockwiseScaling(), "wgrad_accumulate")):
        q = B._fp8_operands(p, recipe)
        calls = B._fp8_calls(op, p, q, main, variants=False)
        out[name] = next(iter(calls.values()))
    return out


def time_all(args) -> list[dict]:
    from triton.testing import do_bench
    rows = []
    for shape in SHAPES:
        p = make_problem(*shape, "cuda")
        for op in ("fprop", "dgrad"):
            impls = _bf16_impls(op, p)
            for rep in range(args.repeats):
                for name, fn in impls.items():
                    ms = do_bench(fn, warmup=25, rep=args.rep)
                    rows.append({"op": op, "shape": list(shape), "impl": name, "repeat": rep,
                                 "tflops": 2.0 * p.T * p.N * p.K / ms / 1e9})
        del p
        torch.cuda.empty_cache()
    by = {}
    for r in rows:
        by.setdefault((r["op"], tuple(r["shape"])), {}).setdefault(r["impl"], []).append(r["tflops"])
    for (op, shape), d in by.items():
        gm = max(d["torch_grouped_mm"])
        cells = "  ".join(f"{k} {max(v):6.1f} ({max(v) / gm:.2f}x)" for k, v in d.items())
        print(f"{op:6} {','.join(map(str, shape)):24} {cells}")
    return rows


def ncu_targets(only: list[str] | None) -> None:
    """Warm every target up (compile, tune), then one launch of each between cudaProfilerStart/Stop,
    each in an NVTX range named after it; ``only``: the targets whose names contain one of these."""
    targets = {}
    if not only or any(o.startswith("bf16") and not o.startswith("bf16_wgrad") for o in only):
        p = make_problem(*SHAPES[0], "cuda")
        for op in ("fprop", "dgrad"):
            impls = _bf16_impls(op, p)
            for name in ("triton", "torch_grouped_mm", "dense"):
                targets[f"bf16_{op}_e8_{name}"] = impls[name]
    if only and any("_e128" in o for o in only):  # the shape bound by reading every expert's weights
        p128 = make_problem(128, 16384, 2048, 768, "cuda")
        for op in ("fprop", "dgrad"):
            impls = _bf16_impls(op, p128)
            for name in ("triton", "torch_grouped_mm"):
                targets[f"bf16_{op}_e128_{name}"] = impls[name]
    if only and any(o.startswith("bf16_wgrad_acc") for o in only):
        p64 = make_problem(*SHAPES[1], "cuda")
        main = torch.zeros(p64.E, p64.N, p64.K, device="cuda")
        targets["bf16_wgrad_acc_e64"] = lambda: G.grouped_wgrad(p64.dy, p64.x, p64.offs, out=main)
    if not only or any(o.startswith("fp8") for o in only):
        fp8_e8 = _fp8_targets(SHAPES[0])
        targets["fp8_blockwise_fprop_e8"] = fp8_e8["fp8_blockwise_fprop"]
        targets["fp8_blockwise_wgrad_acc_e8"] = fp8_e8["fp8_blockwise_wgrad_acc"]
        targets["fp8_per_tensor_wgrad_acc_e8"] = fp8_e8["fp8_per_tensor_wgrad_acc"]
        fp8_e64 = _fp8_targets(SHAPES[1])
        targets["fp8_per_tensor_dgrad_e64"] = fp8_e64["fp8_per_tensor_dgrad"]
        targets["fp8_per_tensor_wgrad_acc_e64"] = fp8_e64["fp8_per_tensor_wgrad_acc"]
        targets["fp8_per_tensor_wgrad_fresh_e64"] = fp8_e64["fp8_per_tensor_wgrad"]
    targets = {k: v for k, v in targets.items() if not only or any(o in k for o in only)}
    for fn in targets.values():
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn in targets.items():
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled:", ", ".join(targets), flush=True)


def fp8_ab(args) -> list[dict]:
    """The FP8 fprop/dgrad through today's Gluon kernel and through each ``--fp8-ab`` module's (other
    builds of the same kernel, modules of ``distwgrad.kernels``), interleaved in one process (the best of
    ``--repeats`` timings each); bit-identical outputs required."""
    import importlib

    import fp8 as B
    from distwgrad.kernels.gluon import grouped_gemm_fp8 as kg
    from triton.testing import do_bench

    from distwgrad.fp8.recipe import BlockwiseScaling, PerTensorScaling
    kernels = {"new": kg.ragged_kernel}
    kernels.update({m: importlib.import_module(f"distwgrad.kernels.{m}").ragged_kernel for m in args.fp8_ab})
    rows = []
    for shape in SHAPES:
        p = B._gemm_problem(*shape, "cuda")
        for rname, recipe in (("per_tensor", PerTensorScaling()), ("blockwise", BlockwiseScaling())):
            q = B._fp8_operands(p, recipe)
            for op in ("fprop", "dgrad"):
                fn = next(iter(B._fp8_calls(op, p, q, None, variants=False).values()))
                outs = {}
                for name, k in kernels.items():
                    kg.ragged_kernel = k
                    outs[name] = fn().clone()
                for name, out in outs.items():
                    if not torch.equal(out, outs["new"]):
                        raise SystemExit(f"{op} {rname} {shape}: {name} and today's kernel differ")
                del outs
                t = {name: [] for name in kernels}
                for _ in range(args.repeats):
                    for name, k in kernels.items():
                        kg.ragged_kernel = k
                        t[name].append(do_bench(fn, warmup=25, rep=args.rep))
                kg.ragged_kernel = kernels["new"]
                flops = 2.0 * shape[1] * shape[2] * shape[3]
                best = {name: flops / min(ms) / 1e9 for name, ms in t.items()}
                for name, ms in t.items():
                    rows.append({"op": op, "shape": list(shape), "recipe": rname, "impl": name,
                                 "tflops": best[name], "tflops_all": [flops / m / 1e9 for m in ms]})
                cells = "  ".join(f"{name} {v:7.1f} ({best['new'] / v:.3f})" for name, v in best.items())
                print(f"{op:5} {rname:10} {','.join(map(str, shape)):22} {cells}", flush=True)
            del q
        del p
        torch.cuda.empty_cache()
    return rows


def wgrad_ab(args) -> list[dict]:
    """The FP8 per-tensor wgrad (the Gluon kernel) through today's build and each ``--wgrad-ab`` module's
    (other builds of ``gluon.grouped_wgrad_fp8``, modules of ``distwgrad.kernels``), at each ring depth of
    ``--wgrad-stages``, interleaved in one process (medians of ``--repeats`` passes, each in a rotated
    order), beside our bf16 kernel: fresh in
    fp32 and in bf16, fresh in bf16 on the aligned layout ([Note: aligned token groups]), and added into fp32.
    Every build's output must equal today's at the default depth bit for bit; a build that does not fit a
    depth (shared memory) is skipped with a line."""
    import contextlib
    import functools
    import importlib
    import statistics

    import fp8 as B
    from distwgrad.kernels import grouped_gemm_fp8 as F
    from distwgrad.kernels import token_layout as kt
    from distwgrad.kernels.gluon import grouped_wgrad_fp8 as kw
    from distwgrad.kernels.gluon import grouped_wgrad_fp8_launch as kl
    from triton.testing import do_bench

    from distwgrad.fp8.recipe import PerTensorScaling
    from distwgrad.ops.grouped_gemm_fp8 import wgrad_offsets
    builds = {"new": kw}
    builds.update({m: importlib.import_module(f"distwgrad.kernels.{m}") for m in args.wgrad_ab})
    bf = torch.bfloat16
    rows = []

    @contextlib.contextmanager
    def build(mod, stages):
        """``mod``'s build of the kernel (the launchers look it up on ``kl._k`` at each call) at ``stages``."""
        saved = kl._k
        kl._k = mod
        try:
            with tuning(grouped_gemm_fp8=dict(wgrad_gluon_stages=stages, wgrad_gluon_stages_16=stages)):
                yield
        finally:
            kl._k = saved

    for shape in SHAPES:
        E, T, K, N = shape
        p = B._gemm_problem(*shape, "cuda")
        q = B._fp8_operands(p, PerTensorScaling())
        dy, x = q["dy_qt"], q["x_qt"]
        dy_a, x_a = (kt.transpose_aligned(a.data, p["offs"])[0] for a in (q["dy_q"], q["x_q"]))
        offs_a = wgrad_offsets(p["offs"], T)
        main = torch.zeros(E, N, K, device="cuda")
        plain = (dy.data, dy.scale_inv, x.data, x.scale_inv, p["offs"], 0)
        aligned = (dy_a, dy.scale_inv, x_a, x.scale_inv, offs_a, 0)
        cells = {"fresh_fp32": functools.partial(F._wgrad, *plain, gluon=True),
                 "fresh_bf16": functools.partial(F._wgrad, *plain, out_dtype=bf, gluon=True),
                 "fresh_bf16_aligned": functools.partial(F._wgrad, *aligned, out_dtype=bf, gluon=True),
                 "accumulate": functools.partial(F._wgrad, *plain, out=main, gluon=True)}
        fresh = functools.partial(G.grouped_wgrad, p["dy"], p["x"], p["offs"])
        peers = {"fresh_fp32": fresh, "fresh_bf16": fresh, "fresh_bf16_aligned": fresh,
                 "accumulate": functools.partial(G.grouped_wgrad, p["dy"], p["x"], p["offs"], out=main)}
        flops = 2.0 * T * N * K
        for cell, fn in cells.items():
            runs = {}
            expect = None
            for name, mod in builds.items():
                for stages in args.wgrad_stages:
                    with build(mod, stages):
                        try:
                            main.zero_()
                            out = fn().clone() if cell != "accumulate" else (fn(), main.clone())[1]
                        except Exception as exc:  # noqa: BLE001 - a depth that does not fit is skipped
                            print(f"  {cell} {shape} {name}/s{stages}: {type(exc).__name__}: {exc}"[:300])
                            continue
                    if expect is None:
                        expect = out
                    elif not torch.equal(out, expect):
                        raise SystemExit(f"{cell} {shape}: {name}/s{stages} differs from the first build")
                    runs[f"{name}/s{stages}"] = (mod, stages)
            del expect
            t = {label: [] for label in runs}
            t["bf16"] = []
            order = list(runs) + ["bf16"]
            for r in range(args.repeats):  # each pass in a rotated order: no build always runs first
                for label in order[r % len(order):] + order[:r % len(order)]:
                    if label == "bf16":
                        t[label].append(do_bench(peers[cell], warmup=25, rep=args.rep))
                        continue
                    with build(*runs[label]):
                        t[label].append(do_bench(fn, warmup=25, rep=args.rep))
            med = {label: flops / statistics.median(ms) / 1e9 for label, ms in t.items()}
            for label, ms in t.items():
                rows.append({"op": cell, "shape": list(shape), "impl": label, "tflops": med[label],
                             "vs_bf16": med[label] / med["bf16"], "tflops_all": [flops / m / 1e9 for m in ms]})
            print(f"{cell:18} {','.join(map(str, shape)):20} " + "  ".join(
                f"{label} {v:6.1f} ({v / med['bf16']:.2f}x)" for label, v in med.items()), flush=True)
        del p, q, main, dy_a, x_a, cells, peers, fresh, plain, aligned
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ncu", action="store_true", help="launch each target once for Nsight Compute")
    ap.add_argument("--targets", nargs="+", default=None, help="with --ncu: only targets containing one of these")
    ap.add_argument("--fp8-ab", nargs="+", default=None, metavar="MODULE",
                    help="time the FP8 Gluon kernel against distwgrad.kernels.MODULE's builds of it instead "
                         "(new/other ratios in parentheses)")
    ap.add_argument("--wgrad-ab", nargs="*", default=None, metavar="MODULE",
                    help="time the FP8 Gluon wgrad (fresh fp32 / bf16 / bf16 aligned, accumulating) against "
                         "distwgrad.kernels.MODULE's builds of it and our bf16 kernel instead (none: today's only)")
    ap.add_argument("--wgrad-stages", nargs="+", type=int, default=[5], help="with --wgrad-ab: ring depths")
    ap.add_argument("--json", default=None)
    results.add_arguments(ap)
    ap.add_argument("--repeats", type=int, default=2, help="timing passes over the impls (interleaved)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    args = ap.parse_args()
    if args.ncu:
        ncu_targets(args.targets)
        return
    if args.wgrad_ab is not None:
        rows = wgrad_ab(args)
    else:
        rows = fp8_ab(args) if args.fp8_ab else time_all(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    results.record(results.from_records(rows, bench="gemm_profile", device="cuda", case_keys=("repeat",)), args)


if __name__ == "__main__":
    main()
