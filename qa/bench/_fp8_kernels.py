"""FP8 quantize bandwidth: our Triton kernels vs the same math in torch eager and torch.compile.

Run on a GPU machine from the repository root::

    PYTHONPATH=. python qa/bench/kernels.py fp8 --json out.json                 # 8192x16384 bf16, all ops
    PYTHONPATH=. python qa/bench/kernels.py fp8 --ops per_tensor --impls triton  # a subset
    PYTHONPATH=. python qa/bench/kernels.py fp8 --device cpu --shape 256x512 --impls eager   # smoke test
    PYTHONPATH=. python qa/bench/kernels.py fp8 --benchmarks quantize --quant-sweep --json q.json  # + every tuning
    PYTHONPATH=. python qa/bench/kernels.py fp8 --benchmarks quantize --cuda-graph  # device time, no launch cost
    TRITON_INTERPRET=1 PYTHONPATH=. python qa/bench/kernels.py fp8 --device cpu --shape 256x512 --benchmarks quantize \
        --impls triton --quant-sweep --reps 1                                          # smoke test
    PYTHONPATH=. python qa/bench/kernels.py fp8 --benchmarks grouped_gemm --json gg.json  # FP8 vs bf16 grouped GEMM
    PYTHONPATH=. python qa/bench/kernels.py fp8 --benchmarks grouped_gemm --gemm-sweep         # + every fp8 tile config
    PYTHONPATH=. python qa/bench/kernels.py fp8 --benchmarks grouped_gemm --gluon-stages 3 4 5  # + Gluon kernel depths
    TRITON_INTERPRET=1 PYTHONPATH=. python qa/bench/kernels.py fp8 --device cpu --benchmarks grouped_gemm \
        --gemm-shapes 2,64,64,48 --reps 1                                               # smoke test

Quantization is memory bound, so each implementation is reported in GB/s and as a fraction of the
device's copy bandwidth, measured here with a clone of the same input. Bytes are the op's minimal
traffic (read x once, write the fp8 data and the fp32 scales) for every implementation, so GB/s
compares times at equal work: a two-pass or padding implementation is not credited for its extra
traffic. "eager" and "compile" run the reference ``distwgrad.fp8.quantize`` (eagerly, and under
``torch.compile``); "triton" runs ``distwgrad.kernels.quantize`` (through ``distwgrad.ops.quantize``, which
wraps its tensors as the reference returns them), checked bit-exact against eager
before it is timed. ``--quant-sweep`` adds one row per candidate tuning of each op (the ``SWEEP`` table
of ``distwgrad.kernels.quantize``: module tuning constants, overridden while that candidate is built,
checked bit-exact against eager and timed), ``impl`` "triton@NAME=VALUE,...".

Output: a table on stdout and, with ``--json``, a list of rows ``{"op", "shape", "impl", "gbps", ...}``
(extra keys: ``ms``, ``frac_of_copy``, ``device``; ``bit_exact``: same bits as eager). ``BENCHMARKS``
lists the row producers (``--benchmarks`` picks some by name); a new benchmark is one more function
``(args, copy_gbps) -> rows`` appended there.

``grouped_gemm`` (``bench_grouped_gemm``): our FP8 grouped GEMM (``distwgrad.kernels.grouped_gemm_fp8``)
against our bf16 one (``distwgrad.kernels.grouped_gemm``) at the three MoE shapes (E, T, K, N), ops fprop,
dgrad, wgrad (fresh: bf16 writes bf16, fp8 writes fp32, and bf16 in the "..._bf16out" rows: like for
like, what a module without ``main_grad`` asks for) and wgrad_accumulate (into an fp32 main_grad),
per recipe. Rows: ``op`` ("gg_" + op), ``shape`` "E,T,K,N", ``impl`` ("bf16", "fp8_<recipe>", for dgrad
also "fp8_<recipe>_wT": the weight as a transposed copy, N contiguous; for wgrad also
"fp8_<recipe>_bf16out"; on a GPU, for the recipes that
promote, also "..._triton": the Triton kernel where the default dispatch takes the Gluon one, [Note:
promotion under the next MMA]), ``ms``, ``tflops`` (2*T*N*K / time
for every op), ``vs_bf16`` (bf16 time / this time: > 1 is faster), ``worst`` (largest error/bound ratio
of the pre-timing check against ``distwgrad.testing.reference_fp8``; a failed check raises). Timed: the
GEMM alone on pre-quantized operands and stacked fp8 weights (quantization is ``bench_quantize``'s).
Routing as qa/bench/kernels.py gemm: each token picks one expert uniformly at random, seed 0 (``--gemm-routing
balanced``: T // E tokens per group).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from distwgrad.kernels import tuning

from distwgrad.fp8 import quantize as ref
from distwgrad.fp8.recipe import BlockwiseScaling, MMParams, PerTensorScaling, split_accumulator
from distwgrad.fp8.weights import quantize_weight

if __package__ in (None, ""):  # run as a script: the repository root on the path, for ``qa.bench``
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from qa.bench import results  # noqa: E402

E4M3 = torch.float8_e4m3fn
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
IMPLS = ("triton", "eager", "compile")
Row = dict


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8192x16384", help="MxN of the input (default 8192x16384)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="input dtype (default bf16)")
    p.add_argument("--ops", nargs="+", default=None, help=f"subset of {sorted(QUANTIZE_OPS)}")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS), help="implementations to time")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test; no triton)")
    p.add_argument("--reps", type=int, default=50, help="timed repetitions on CPU (GPU: do_bench's own)")
    p.add_argument("--json", default=None, help="write the rows to this file")
    results.add_arguments(p)
    p.add_argument("--benchmarks", nargs="+", default=None,
                   help="row producers to run (default all): quantize, grouped_gemm")
    p.add_argument("--cuda-graph", action="store_true",
                   help="time CUDA-graph replays (triton.testing.do_bench_cudagraph): the kernels' device time "
                        "without the host's launch cost; rows get timing='cuda_graph'")
    p.add_argument("--quant-sweep", action="store_true",
                   help="quantize: also time every candidate tuning in distwgrad.kernels.quantize.SWEEP")
    _add_gemm_args(p)
    args = p.parse_args(argv)
    try:
        args.M, args.N = (int(v) for v in args.shape.lower().split("x"))
    except ValueError:
        p.error(f"--shape must look like 8192x16384, got {args.shape!r}")
    unknown = set(args.ops or ()) - set(QUANTIZE_OPS)
    if unknown:
        p.error(f"unknown --ops {sorted(unknown)}; choose from {sorted(QUANTIZE_OPS)}")
    names = [_bench_name(b) for b in BENCHMARKS]
    if set(args.benchmarks or ()) - set(names):
        p.error(f"unknown --benchmarks {args.benchmarks}; choose from {names}")
    try:
        shapes = [tuple(int(v) for v in s.split(",")) for s in args.gemm_shapes or ()]
    except ValueError:
        shapes = [()]
    if any(len(s) != 4 for s in shapes):
        p.error(f"--gemm-shapes must be E,T,K,N each, got {args.gemm_shapes}")
    args.gemm_shapes = shapes or list(GEMM_SHAPES)
    return args


CUDA_GRAPH = False  # --cuda-graph


def time_ms(fn: Callable[[], object], device: str, reps: int) -> float:
    """Median milliseconds of ``fn()``: Triton's do_bench on CUDA, a wall-clock loop on CPU."""
    if device.startswith("cuda"):
        from triton.testing import do_bench, do_bench_cudagraph
        if CUDA_GRAPH:  # device time of back-to-back replays, without the host's launch cost
            return float(do_bench_cudagraph(fn, rep=100, return_mode="median"))
        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return sorted(samples)[len(samples) // 2]


def _as_tuple(q: ref.Quantized | tuple) -> tuple[torch.Tensor, ...]:
    qs = q if isinstance(q, tuple) else (q,)
    return tuple(t for x in qs for t in (x.data, x.scale_inv))


def _per_tensor(m):
    return lambda x: _as_tuple(m.quantize_per_tensor(x, E4M3))


def _blockwise(m, block):
    return lambda x: _as_tuple(m.quantize_blockwise(x, block, E4M3))


def _rowcol(m, recipe: BlockwiseScaling | PerTensorScaling | None = None):
    recipe = recipe or BlockwiseScaling()
    return lambda x: _as_tuple(m.quantize_rowwise_and_columnwise(x, recipe))


# op -> (make(module) -> fn(x) -> tensors, number of fp8 outputs, scale count for an MxN input)
QUANTIZE_OPS: dict[str, tuple[Callable, int, Callable[[int, int], int]]] = {
    "per_tensor": (_per_tensor, 1, lambda M, N: 1),
    "blockwise_1x128": (lambda m: _blockwise(m, (1, 128)), 1, lambda M, N: M * -(-N // 128)),
    "blockwise_128x128": (lambda m: _blockwise(m, (128, 128)), 1, lambda M, N: -(-M // 128) * -(-N // 128)),
    "rowcol_1x128": (_rowcol, 2, lambda M, N: M * -(-N // 128) + N * -(-M // 128)),
    # one scale; the cast and its transposed copy (our kernels: after the amax pass, which is not counted)
    "rowcol_per_tensor": (lambda m: _rowcol(m, PerTensorScaling()), 2, lambda M, N: 2),
}


def _row(op: str, args: argparse.Namespace, impl: str, nbytes: int, ms: float,
         copy_gbps: float | None, **extra) -> Row:
    gbps = nbytes / (ms * 1e-3) / 1e9
    shape = f"{args.M}x{args.N}" + ("" if args.dtype == "bf16" else f" {args.dtype}")  # the input's dtype
    return {"op": op, "shape": shape, "impl": impl, "gbps": round(gbps, 2), "ms": round(ms, 4),
            "frac_of_copy": None if not copy_gbps else round(gbps / copy_gbps, 3), "device": args.device_name,
            "timing": "cuda_graph" if CUDA_GRAPH else "do_bench", **extra}


def bench_copy(args: argparse.Namespace) -> Row:
    x = torch.randn(args.M, args.N, device=args.device).to(DTYPES[args.dtype])
    ms = time_ms(lambda: x.clone(), args.device, args.reps)
    return _row("copy", args, "torch_clone", 2 * x.numel() * x.element_size(), ms, None)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _impl_modules(args: argparse.Namespace) -> dict[str, object]:
    mods: dict[str, object] = {}
    if "triton" in args.impls:
        if args.device.startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1":
            from distwgrad.ops import quantize as kq
            mods["triton"] = kq
        else:
            print(f"skipping impl triton on {args.device}")
    if "eager" in args.impls:
        mods["eager"] = ref
    if "compile" in args.impls:
        mods["compile"] = "compile"
    return mods


def _same_bits(got: tuple, expected: tuple) -> bool:
    return all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, expected, strict=True))


def _quant_sweep(args: argparse.Namespace, op: str, x: torch.Tensor, expected: tuple, nbytes: int,
                 copy_gbps: float, kq) -> list[Row]:
    """One row per candidate of ``distwgrad.kernels.quantize.SWEEP[op]`` (``QuantizeTuning`` fields, set with
    ``tuning``), run through ``kq`` (``distwgrad.ops.quantize``); a candidate that fails to build or differs
    from the reference is printed and skipped (it is a result too, but not a timing)."""
    from distwgrad.kernels.quantize import SWEEP
    rows = []
    for cand in SWEEP.get(op, []):
        impl = "triton@" + ",".join(f"{k}={v}" for k, v in cand.items())
        try:
            with tuning(quantize=cand):
                fn = functools.partial(QUANTIZE_OPS[op][0](kq), x)
                if not _same_bits(fn(), expected):
                    print(f"  sweep {op} {impl}: differs from the reference; not timed", flush=True)
                    continue
                ms = time_ms(fn, args.device, args.reps)
        except Exception as exc:  # noqa: BLE001 - a candidate that fails to build is reported, not fatal
            print(f"  sweep {op} {impl}: {exc!r}"[:400], flush=True)
            continue
        rows.append(_row(op, args, impl, nbytes, ms, copy_gbps, bit_exact=True))
        print(f"  sweep {op} {impl}: {rows[-1]['gbps']} GB/s", flush=True)
    return rows


def bench_quantize(args: argparse.Namespace, copy_gbps: float) -> list[Row]:
    """One row per (op, impl): GB/s of the op's minimal traffic; with ``--quant-sweep`` also one per
    candidate tuning of our kernels (``_quant_sweep``)."""
    x = torch.randn(args.M, args.N, device=args.device).mul_(3).to(DTYPES[args.dtype]).contiguous()
    rows, mods = [], _impl_modules(args)
    for op in args.ops or QUANTIZE_OPS:
        make, n_fp8, n_scales = QUANTIZE_OPS[op]
        nbytes = x.numel() * (x.element_size() + n_fp8) + 4 * n_scales(args.M, args.N)
        expected = make(ref)(x)
        for impl, mod in mods.items():
            fn = torch.compile(make(ref), dynamic=False) if impl == "compile" else make(mod)
            same = _same_bits(fn(x), expected)
            if impl == "triton" and not same:
                raise AssertionError(f"{op}: triton result differs from the reference; not timing it")
            ms = time_ms(functools.partial(fn, x), args.device, args.reps)
            rows.append(_row(op, args, impl, nbytes, ms, copy_gbps, bit_exact=same))
        if args.quant_sweep:
            if "triton" in mods:
                rows += _quant_sweep(args, op, x, expected, nbytes, copy_gbps, mods["triton"])
            else:
                print(f"  sweep {op}: skipped, the triton impl is not selected or not available here")
        del expected
    return rows



# ---- FP8 grouped GEMM vs our bf16 grouped GEMM -------------------------------------------------------

GEMM_SHAPES = ((8, 32768, 4096, 14336), (64, 65536, 7168, 2048), (128, 16384, 2048, 768))  # E, T, K, N
GEMM_OPS = ("fprop", "dgrad", "wgrad", "wgrad_accumulate")
_FAST = MMParams(use_split_accumulator=False)
GEMM_RECIPES = {"per_tensor": PerTensorScaling(), "blockwise": BlockwiseScaling(),
                # every GEMM without the split accumulator ([Note: fp8 split accumulator])
                "per_tensor_fast": PerTensorScaling(fp8_gemm_fprop=_FAST, fp8_gemm_dgrad=_FAST, fp8_gemm_wgrad=_FAST)}


# the Gluon promoting kernel's variants: rows per tile
GLUON_VARIANTS = {"m128": 128, "m64": 64}


def _add_gemm_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("grouped_gemm: FP8 vs bf16 grouped GEMM")
    g.add_argument("--gemm-shapes", nargs="+", default=None, help="E,T,K,N each (default: the three MoE shapes)")
    g.add_argument("--gemm-ops", nargs="+", choices=GEMM_OPS, default=list(GEMM_OPS))
    g.add_argument("--gemm-recipes", nargs="+", choices=sorted(GEMM_RECIPES), default=sorted(GEMM_RECIPES))
    g.add_argument("--gemm-sweep", action="store_true", help="also time every candidate fp8 tile config")
    g.add_argument("--gemm-sweep-match", nargs="+", default=None,
                   help="sweep only the candidates whose short name contains one of these (e.g. /l2pf)")
    g.add_argument("--gluon-stages", nargs="+", type=int, default=None,
                   help="also time the Gluon fprop/dgrad kernel at these ring depths, 128- and 64-row tiles "
                        "(the sweep does 3-6)")
    g.add_argument("--gemm-routing", choices=("random", "balanced"), default="random",
                   help="random: each token picks a group uniformly (seed 0); balanced: T // E tokens per group "
                        "(with T // E a multiple of 128, no wgrad chunk straddles a group edge)")
    g.add_argument("--aligned-rows", action="store_true",
                   help="wgrad: also time the per-tensor wgrad on dy^T and x^T laid out with each group on the "
                        "128-token grid ([Note: aligned token groups]: no chunk holds two groups' tokens), impl "
                        "'fp8_<recipe>_aligned' (a fresh output in bf16), and that layout's transposed copy "
                        "against the plain one (ops 'transpose_x', 'transpose_dy')")
    g.add_argument("--gluon-wgrad", action="store_true",
                   help="also time the Gluon wgrad kernel's launch choices (GLUON_WGRAD_VARIANTS: add mode, ring "
                        "depth, epilogue warps)")
    g.add_argument("--gluon-wgrad-variants", nargs="+", choices=sorted(GLUON_WGRAD_VARIANTS), default=None,
                   help="which of GLUON_WGRAD_VARIANTS --gluon-wgrad times (default: all)")
    g.add_argument("--gluon-variants", nargs="+", choices=sorted(GLUON_VARIANTS), default=sorted(GLUON_VARIANTS),
                   help="which Gluon kernel variants --gluon-stages times")


def _bench_name(bench: Callable) -> str:
    return bench.__name__.removeprefix("bench_")


def gemm_flops(E: int, T: int, K: int, N: int) -> float:
    """FLOPs of any of the three products: every token meets one [N, K] expert: sum_e 2 T_e N K."""
    del E
    return 2.0 * T * N * K


def _gemm_problem(E: int, T: int, K: int, N: int, device: str, routing: str = "random") -> dict:
    """Operands and offsets; ``routing`` "balanced": T // E tokens per group (the rest to the last one)."""
    gen = torch.Generator().manual_seed(0)
    if routing == "balanced":
        counts = torch.full((E,), T // E, dtype=torch.int64)
        counts[-1] += T - counts.sum()
    else:
        counts = torch.bincount(torch.multinomial(torch.ones(E), T, replacement=True, generator=gen), minlength=E)
    offs = counts.cumsum(0).to(torch.int32).to(device)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float16  # interpreter: no bf16 stores
    r = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)
    return {"x": r(T, K), "w": r(E, N, K) * K ** -0.5, "dy": r(T, N), "offs": offs}


def _fp8_operands(p: dict, recipe) -> dict:
    """Pre-quantized operands (torch reference quantizers, bit-exact with the kernels; untimed)."""
    x_q, x_qt = ref.quantize_rowwise_and_columnwise(p["x"], recipe)
    dy_q, dy_qt = ref.quantize_rowwise_and_columnwise(p["dy"], recipe, grad=True)
    wq = [quantize_weight(w, recipe)[0] for w in p["w"].unbind(0)]
    w = (torch.stack([q.data for q in wq]), torch.stack([q.scale_inv for q in wq]))  # stacked: no copy per call
    w_t = (w[0].transpose(1, 2).contiguous().transpose(1, 2), w[1])  # same values, N contiguous
    return {"x_q": x_q, "x_qt": x_qt, "dy_q": dy_q, "dy_qt": dy_qt, "w": w, "w_t": w_t, "wq": wq,
            "split": {g: split_accumulator(recipe, g) for g in ("fprop", "dgrad", "wgrad")}}


def _add_aligned(args, p: dict, qs: dict) -> list[Row]:
    """``q["aligned"]`` for the per-tensor recipes: dy^T and x^T with each group's tokens on the 128 grid
    ([Note: aligned token groups] in kernels/token_layout.py: the Triton kernel on a GPU, the torch
    reference elsewhere), and rows timing that layout's transposed copy against the plain one (torch's
    ``transpose_quantized``, and on a GPU the Triton kernel the per-tensor recipe runs), GB/s of bytes
    read + written."""
    from distwgrad.fp8.quantize import transpose_quantized
    from distwgrad.ops.grouped_gemm_fp8 import align_token_groups, wgrad_offsets
    rows: list[Row] = []
    for name, q in qs.items():
        if q["x_qt"].block is not None:
            continue
        if args.device.startswith("cuda"):
            from distwgrad.kernels import token_layout as kt
            aligned = lambda a: kt.transpose_aligned(a.data, p["offs"])[0]  # noqa: E731
        else:
            aligned = lambda a: align_token_groups(transpose_quantized(a), p["offs"])[0].data  # noqa: E731
        offs_a = wgrad_offsets(p["offs"], p["x"].shape[0])
        for key in ("x", "dy"):
            a = q[f"{key}_q"]
            data_t = aligned(a)
            q[f"{key}_qt_aligned"] = dataclasses.replace(a, data=data_t, shape=data_t.shape)
            impls = [("plain", lambda a=a: transpose_quantized(a), a.data.numel()),
                     ("aligned", functools.partial(aligned, a), data_t.numel())]
            if args.device.startswith("cuda"):  # the plain layout by the same kernel (what the recipe runs)
                impls.append(("plain_triton", functools.partial(kt.transpose, a.data), a.data.numel()))
            for impl, fn, out_bytes in impls:
                ms = time_ms(fn, args.device, args.reps)
                gbps = (a.data.numel() + out_bytes) / (ms * 1e-3) / 1e9
                rows.append({"op": f"transpose_{key}", "shape": ",".join(map(str, a.data.shape)), "impl": impl,
                             "gbps": round(gbps, 1), "ms": round(ms, 4), "tflops": None,
                             "device": args.device_name, "recipe": name})
                print(f"  transpose {key} {tuple(a.data.shape)} {impl}: {ms:.3f} ms, {gbps:.0f} GB/s", flush=True)
        q["aligned"] = (q["dy_qt_aligned"], q["x_qt_aligned"], offs_a)
    return rows


def _bf16_call(op: str, p: dict, main: torch.Tensor):
    from distwgrad.kernels import grouped_gemm as G
    x, w, dy, offs = p["x"], p["w"], p["dy"], p["offs"]
    return {"fprop": lambda: G.grouped_fprop(x, w, offs), "dgrad": lambda: G.grouped_dgrad(dy, w, offs),
            "wgrad": lambda: G.grouped_wgrad(dy, x, offs),
            "wgrad_accumulate": lambda: G.grouped_wgrad(dy, x, offs, out=main)}[op]


def _split(q: dict, op: str) -> bool:
    """Whether ``op`` (a GEMM_OPS name) runs with the split accumulator under the operands' recipe."""
    return q["split"]["wgrad" if op.startswith("wgrad") else op]


def _fp8_calls(op: str, p: dict, q: dict, main: torch.Tensor | None, config=None, gluon: bool | None = None,
               variants: bool = True) -> dict:
    """impl -> zero-argument callable returning the result; ``config`` (sweep) goes to the launchers;
    ``gluon`` too ([Note: promotion under the next MMA]; wgrad: [Note: fp8 wgrad under the next MMA]). With
    neither, on a GPU, a call the Gluon kernels take by default (fprop / dgrad that promote, per-tensor
    wgrad with the split accumulator, blockwise wgrad of 1x128 tiles) also gets "<impl>_triton": the Triton
    kernel."""
    from distwgrad.kernels import grouped_gemm_fp8 as F
    offs, bf, kw = p["offs"], p["x"].dtype, {} if config is None else {"config": config}
    kw["split_accumulator"] = _split(q, op)
    block = 0 if q["x_q"].block is None else q["x_q"].block[1]
    split = kw["split_accumulator"]
    promoting = (block or split) if op in ("fprop", "dgrad") else (not block and split) or block == 128
    if variants and gluon is None and config is None and p["x"].is_cuda and promoting:
        triton_k = _fp8_calls(op, p, q, main, gluon=False)
        return {**_fp8_calls(op, p, q, main, variants=False), **{f"{k}_triton": v for k, v in triton_k.items()}}
    if gluon is not None:
        kw["gluon"] = gluon
    if op == "fprop":
        return {"fp8": lambda: F._fprop(q["x_q"].data, q["x_q"].scale_inv, *q["w"], offs, None, block, bf, **kw)}
    if op == "dgrad":
        dy, dy_s = q["dy_q"].data, q["dy_q"].scale_inv
        calls = {"fp8_wT": lambda: F._dgrad(dy, dy_s, *q["w_t"], offs, block, bf, **kw)}
        if not gluon:  # the Gluon kernel takes the N-contiguous weight only
            calls["fp8"] = lambda: F._dgrad(dy, dy_s, *q["w"], offs, block, bf, **kw)
        return calls
    args = (q["dy_qt"].data, q["dy_qt"].scale_inv, q["x_qt"].data, q["x_qt"].scale_inv, offs, block)
    calls = {"fp8": (lambda: F._wgrad(*args, **kw)) if op == "wgrad" else (lambda: F._wgrad(*args, out=main, **kw))}
    if op == "wgrad":
        calls["fp8_bf16out"] = lambda: F._wgrad(*args, out_dtype=bf, **kw)
    if not block and "aligned" in q:  # each group's tokens on the 128 grid (align_token_groups, untimed)
        dy_a, x_a, offs_a = q["aligned"]
        al = (dy_a.data, dy_a.scale_inv, x_a.data, x_a.scale_inv, offs_a, block)
        calls["fp8_aligned"] = (lambda: F._wgrad(*al, out_dtype=bf, **kw)) if op == "wgrad" else \
            (lambda: F._wgrad(*al, out=main, **kw))
    return calls


def _gemm_check(op: str, p: dict, q: dict, config=None, impl: str = "fp8", gluon: bool | None = None) -> float:
    """Worst error/bound ratio of ``impl``'s fp8 result (with ``config``, else the default) against the
    oracle, which is cached in ``q``; AssertionError if out of bound."""
    from distwgrad.testing import reference_fp8 as RF
    offs = p["offs"]
    T, K, N = p["x"].shape[0], p["x"].shape[1], p["dy"].shape[1]
    if ("oracle", op) not in q:
        addend = None
        if op in ("fprop", "dgrad"):
            ref_fn, a, depth = ((RF.grouped_fprop_fp8, q["x_q"], K) if op == "fprop" else
                                (RF.grouped_dgrad_fp8, q["dy_q"], N))
            exp, S = ref_fn(a, q["wq"], offs, out_dtype=torch.float32), ref_fn(a, q["wq"], offs, absolute=True)
            kw = dict(depth=depth, out_dtype=p["x"].dtype)
        else:
            exp = RF.grouped_wgrad_fp8(q["dy_qt"], q["x_qt"], offs)
            S = RF.grouped_wgrad_fp8(q["dy_qt"], q["x_qt"], offs, absolute=True)
            kw = dict(depth=T, out_dtype=torch.float32)
            if op == "wgrad_accumulate":
                addend = torch.randn(offs.shape[0], N, K, generator=torch.Generator().manual_seed(1)).to(offs.device)
                exp = addend.double() + exp.double()
        q[("oracle", op)] = (exp, S, addend, kw)
    exp, S, addend, kw = q[("oracle", op)]
    n = int(offs[-1])
    if op in ("fprop", "dgrad"):  # rows at or past offs_E[-1] are unwritten
        got, exp, S = _fp8_calls(op, p, q, None, config, gluon)[impl]()[:n], exp[:n], S[:n]
    else:
        got = _fp8_calls(op, p, q, None if addend is None else addend.clone(), config, gluon)[impl]()
    if got.dtype != torch.float32:  # a fresh wgrad in bf16: its rounding too
        kw = {**kw, "out_dtype": got.dtype}
    mma_rel = RF.hopper_mma_rel(128 if _split(q, op) else kw["depth"]) if p["x"].is_cuda else 0.0
    res = RF.check(got, exp, S, addend=addend, mma_rel=mma_rel, **kw)
    if not res["ok"]:
        raise AssertionError(f"fp8 grouped {op} (config {config}): result out of bound, not timing it: {res}")
    return res["worst"]


def _gemm_row(args: argparse.Namespace, shape: tuple, op: str, impl: str, ms: float, **extra) -> Row:
    tflops = gemm_flops(*shape) / (ms * 1e-3) / 1e12
    return {"op": f"gg_{op}", "shape": ",".join(map(str, shape)), "impl": impl, "gbps": None, "ms": round(ms, 4),
            "tflops": float(f"{tflops:.4g}"), "device": args.device_name, **extra}


def _gemm_sweep(args, shape, op, p, q, name, bf16_ms) -> list[Row]:
    """One row per candidate tile config of ``op``."""
    from distwgrad.kernels import _grouped_gemm_fp8_configs as CF
    block = 0 if q["x_q"].block is None else q["x_q"].block[1]
    main = torch.zeros(shape[0], shape[3], shape[2], device=args.device)
    rows = []
    impl = "fp8_wT" if op == "dgrad" else "fp8"  # dgrad: the N-contiguous weight the dispatcher passes
    wgrad = op not in ("fprop", "dgrad")
    match = getattr(args, "gemm_sweep_match", None)
    for cfg in CF.WGRAD_CANDIDATES if wgrad else CF.RAGGED_CANDIDATES:
        if op != "wgrad_accumulate" and cfg.add_mode != "load":
            continue
        if match and not any(m in cfg.short() for m in match):
            continue
        label = f"{impl.replace('fp8', f'fp8_{name}')}@{CF.with_block_k(cfg, block).short()}"
        try:
            worst = _gemm_check(op, p, q, cfg, impl=impl)
            ms = time_ms(_fp8_calls(op, p, q, main, config=cfg)[impl], args.device, args.reps)
        except Exception as exc:  # noqa: BLE001 - a config that fails to build or to check is a result too
            print(f"  sweep {op} {shape} {label}: {exc!r}"[:400], flush=True)
            continue
        rows.append(_gemm_row(args, shape, op, label, ms, vs_bf16=round(bf16_ms / ms, 3), worst=round(worst, 4)))
    return rows + _gluon_stage_rows(args, shape, op, p, q, name, bf16_ms, (3, 4, 5, 6))


# the Gluon wgrad kernel's launch choices ([Note: fp8 wgrad under the next MMA]): (add mode, ring depth,
# epilogue warps)
GLUON_WGRAD_VARIANTS = {"atomic/s5": ("atomic", 5, 0), "atomic/s4/epi": ("atomic", 4, 2),
                        "atomic/s5/epi": ("atomic", 5, 2), "load/s5": ("load", 5, 0), "load/s5/epi": ("load", 5, 2)}


def _gluon_wgrad_rows(args, shape, op, p, q, name, bf16_ms) -> list[Row]:
    """One row per launch choice of the Gluon wgrad kernel (``GLUON_WGRAD_VARIANTS``; fresh wgrad: those
    of the default add mode only, the add mode not applying), label "fp8_<recipe>@gluon/<variant>"; none
    where it does not apply (blockwise, no split accumulator, CPU)."""
    block = 0 if q["x_q"].block is None else q["x_q"].block[1]
    if not op.startswith("wgrad") or not args.device.startswith("cuda") or block or not _split(q, op):
        return []
    main = torch.zeros(shape[0], shape[3], shape[2], device=args.device)
    rows = []
    for variant, (add, stages, epilogue_warps) in GLUON_WGRAD_VARIANTS.items():
        if args.gluon_wgrad_variants and variant not in args.gluon_wgrad_variants:
            continue
        if op == "wgrad" and add != "atomic":  # a fresh output: no add mode
            continue
        rows += _gluon_row(args, shape, op, p, q, f"fp8_{name}@gluon/{variant}", bf16_ms, "fp8", main,
                           wgrad_gluon_add_mode=add, wgrad_gluon_stages=stages,
                           wgrad_gluon_epilogue_warps=epilogue_warps)
    return rows


def _gluon_row(args, shape, op, p, q, label, bf16_ms, impl, main, **overrides) -> list[Row]:
    """``impl``'s row through a Gluon kernel (``gluon=True``) with the ``GroupedGemmFp8Tuning`` fields
    ``overrides`` set, checked against the oracle first; none (and a printed line) if it fails to build or
    to check: a result too."""
    try:
        with tuning(grouped_gemm_fp8=overrides):
            worst = _gemm_check(op, p, q, impl=impl, gluon=True)
            ms = time_ms(_fp8_calls(op, p, q, main, gluon=True)[impl], args.device, args.reps)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        print(f"  {op} {shape} {label}: {exc!r}"[:400], flush=True)
        return []
    return [_gemm_row(args, shape, op, label, ms, vs_bf16=round(bf16_ms / ms, 3), worst=round(worst, 4))]


def _gluon_stage_rows(args, shape, op, p, q, name, bf16_ms, stages) -> list[Row]:
    """One row per variant (``GLUON_VARIANTS``, those of ``--gluon-variants``) and ring depth of the Gluon
    promoting kernel ([Note: promotion under the next MMA]), label "fp8_<recipe>[_wT]@gluon/<variant>/s<stages>";
    none where it does not apply."""
    block = 0 if q["x_q"].block is None else q["x_q"].block[1]
    if op not in ("fprop", "dgrad") or not args.device.startswith("cuda") or not (block or _split(q, op)):
        return []
    impl = "fp8_wT" if op == "dgrad" else "fp8"
    rows = []
    for variant in getattr(args, "gluon_variants", None) or sorted(GLUON_VARIANTS):
        for n in stages:
            rows += _gluon_row(args, shape, op, p, q, f"{impl.replace('fp8', f'fp8_{name}')}@gluon/{variant}/s{n}",
                               bf16_ms, impl, None, ragged_gluon_stages=n, ragged_gluon_block_m=GLUON_VARIANTS[variant])
    return rows



def bench_grouped_gemm(args: argparse.Namespace, copy_gbps: float) -> list[Row]:
    """FP8 (per recipe) vs bf16 grouped GEMM: one row per (op, shape, impl); see the module docstring."""
    del copy_gbps
    rows: list[Row] = []
    for shape in args.gemm_shapes:
        E, T, K, N = shape
        p = _gemm_problem(E, T, K, N, args.device, args.gemm_routing)
        qs = {name: _fp8_operands(p, GEMM_RECIPES[name]) for name in args.gemm_recipes}
        if args.aligned_rows:
            rows += _add_aligned(args, p, qs)
        main = torch.zeros(E, N, K, device=args.device)
        for op in args.gemm_ops:
            bf16_ms = time_ms(_bf16_call(op, p, main), args.device, args.reps)
            rows.append(_gemm_row(args, shape, op, "bf16", bf16_ms, vs_bf16=1.0))
            for name, q in qs.items():
                for impl, fn in _fp8_calls(op, p, q, main).items():
                    worst = _gemm_check(op, p, q, impl=impl)
                    ms = time_ms(fn, args.device, args.reps)
                    rows.append(_gemm_row(args, shape, op, impl.replace("fp8", f"fp8_{name}"), ms,
                                          vs_bf16=round(bf16_ms / ms, 3), worst=round(worst, 4)))
                if args.gemm_sweep:
                    rows += _gemm_sweep(args, shape, op, p, q, name, bf16_ms)
                elif args.gluon_stages:
                    rows += _gluon_stage_rows(args, shape, op, p, q, name, bf16_ms, args.gluon_stages)
                if args.gluon_wgrad:
                    rows += _gluon_wgrad_rows(args, shape, op, p, q, name, bf16_ms)
                q.pop(("oracle", op), None)  # benchmark-sized oracles are GBs
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            print(f"  grouped_gemm {op} {shape}: " + "  ".join(
                f"{r['impl']} {r['tflops']:.0f} TFLOP/s ({r['vs_bf16']:.2f}x)" for r in rows
                if r["op"] == f"gg_{op}" and r["shape"] == ",".join(map(str, shape))), flush=True)
        del p, qs, main
    return rows


# Row producers, run in order after the copy baseline. Append new benchmarks here.
BENCHMARKS: list[Callable[[argparse.Namespace, float], list[Row]]] = [bench_quantize, bench_grouped_gemm]


def print_table(rows: list[Row]) -> None:
    cols = ("op", "shape", "impl", "gbps", "frac_of_copy", "ms", "bit_exact")
    cols += tuple(k for k in dict.fromkeys(k for r in rows for k in r) if k not in cols and k != "device")
    widths = [max(len(c), *(len(str(r.get(c))) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for r in rows:
        print("  ".join(str(r.get(c)).ljust(w) for c, w in zip(cols, widths, strict=True)))


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --device cpu for a smoke test")
    args.device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    global CUDA_GRAPH
    CUDA_GRAPH = args.cuda_graph
    copy = bench_copy(args)
    rows = [copy]
    for bench in BENCHMARKS:
        if args.benchmarks is None or _bench_name(bench) in args.benchmarks:
            rows += bench(args, copy["gbps"])
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    results.record(result_rows(rows, args.device), args)
    return rows


_RECIPES = ("fp8_per_tensor_fast", "fp8_per_tensor", "fp8_blockwise")


def result_rows(rows: list[Row], device: str) -> list[dict]:
    """This run's rows for docs/benchmarks/results.jsonl: benches ``fp8_grouped_gemm`` (precision = the
    recipe, impl = ``distwgrad`` plus the variant: ``_wT``, ``_bf16out``, ``_aligned``, ``_triton``),
    ``fp8_transpose`` and ``fp8_quantize``."""
    out = []
    for r in rows:
        op, impl = r["op"], str(r["impl"])
        if op.startswith("gg_"):
            prec = "bf16" if impl == "bf16" else next((x for x in _RECIPES if impl.startswith(x)), impl)
            rest = impl[len(prec):] if impl.startswith(prec) else ""
            variant = "distwgrad" + rest.replace("_triton", "") + ("_triton" if rest.endswith("_triton") else "")
            rec = {**r, "op": op[3:], "impl": variant, "precision": prec}
            out += results.from_records([rec], bench="fp8_grouped_gemm", device=device,
                                        metrics={"tflops": "TFLOP/s", "ms": "ms"})
        elif op.startswith("transpose_"):
            rec = {**r, "shape": str(r["shape"]).replace(",", "x")}
            out += results.from_records([rec], bench="fp8_transpose", device=device, metrics={"gbps": "GB/s"})
        else:
            prec = ("bf16" if op == "copy" else "fp8_per_tensor" if op in ("per_tensor", "rowcol_per_tensor")
                    else "fp8_blockwise")
            out += results.from_records([{**r, "precision": prec}], bench="fp8_quantize", device=device,
                                        metrics={"gbps": "GB/s"})
    return out
