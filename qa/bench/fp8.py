"""FP8 quantize bandwidth: our Triton kernels vs the same math in torch eager and torch.compile.

Run on a GPU machine from the repository root::

    PYTHONPATH=. python qa/bench/fp8.py --json out.json                 # 8192x16384 bf16, all ops
    PYTHONPATH=. python qa/bench/fp8.py --ops per_tensor --impls triton  # a subset
    PYTHONPATH=. python qa/bench/fp8.py --device cpu --shape 256x512 --impls eager   # smoke test

Quantization is memory bound, so each implementation is reported in GB/s and as a fraction of the
device's copy bandwidth, measured here with a clone of the same input. Bytes are the op's minimal
traffic (read x once, write the fp8 data and the fp32 scales) for every implementation, so GB/s
compares times at equal work: a two-pass or padding implementation is not credited for its extra
traffic. "eager" and "compile" run the reference ``distwgrad.fp8.quantize`` (eagerly, and under
``torch.compile``); "triton" runs ``distwgrad.kernels.quantize``, checked bit-exact against eager
before it is timed.

Output: a table on stdout and, with ``--json``, a list of rows ``{"op", "shape", "impl", "gbps", ...}``
(extra keys: ``ms``, ``frac_of_copy``, ``device``; ``bit_exact``: same bits as eager). ``BENCHMARKS``
lists the row producers; a new benchmark (e.g. the FP8 grouped GEMM) is one more function
``(args, copy_gbps) -> rows`` appended there.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections.abc import Callable

import torch

from distwgrad.fp8 import quantize as ref
from distwgrad.fp8.recipe import BlockwiseScaling

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
    args = p.parse_args(argv)
    try:
        args.M, args.N = (int(v) for v in args.shape.lower().split("x"))
    except ValueError:
        p.error(f"--shape must look like 8192x16384, got {args.shape!r}")
    unknown = set(args.ops or ()) - set(QUANTIZE_OPS)
    if unknown:
        p.error(f"unknown --ops {sorted(unknown)}; choose from {sorted(QUANTIZE_OPS)}")
    return args


def time_ms(fn: Callable[[], object], device: str, reps: int) -> float:
    """Median milliseconds of ``fn()``: Triton's do_bench on CUDA, a wall-clock loop on CPU."""
    if device.startswith("cuda"):
        from triton.testing import do_bench
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


def _rowcol(m):
    return lambda x: _as_tuple(m.quantize_rowwise_and_columnwise(x, BlockwiseScaling()))


# op -> (make(module) -> fn(x) -> tensors, number of fp8 outputs, scale count for an MxN input)
QUANTIZE_OPS: dict[str, tuple[Callable, int, Callable[[int, int], int]]] = {
    "per_tensor": (_per_tensor, 1, lambda M, N: 1),
    "blockwise_1x128": (lambda m: _blockwise(m, (1, 128)), 1, lambda M, N: M * -(-N // 128)),
    "blockwise_128x128": (lambda m: _blockwise(m, (128, 128)), 1, lambda M, N: -(-M // 128) * -(-N // 128)),
    "rowcol_1x128": (_rowcol, 2, lambda M, N: M * -(-N // 128) + N * -(-M // 128)),
}


def _row(op: str, args: argparse.Namespace, impl: str, nbytes: int, ms: float,
         copy_gbps: float | None, **extra) -> Row:
    gbps = nbytes / (ms * 1e-3) / 1e9
    return {"op": op, "shape": f"{args.M}x{args.N}", "impl": impl, "gbps": round(gbps, 2), "ms": round(ms, 4),
            "frac_of_copy": None if not copy_gbps else round(gbps / copy_gbps, 3), "device": args.device_name,
            **extra}


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
            from distwgrad.kernels import quantize as kq
            mods["triton"] = kq
        else:
            print(f"skipping impl triton on {args.device}")
    if "eager" in args.impls:
        mods["eager"] = ref
    if "compile" in args.impls:
        mods["compile"] = "compile"
    return mods


def bench_quantize(args: argparse.Namespace, copy_gbps: float) -> list[Row]:
    """One row per (op, impl): GB/s of the op's minimal traffic."""
    x = torch.randn(args.M, args.N, device=args.device).mul_(3).to(DTYPES[args.dtype]).contiguous()
    rows, mods = [], _impl_modules(args)
    for op in args.ops or QUANTIZE_OPS:
        make, n_fp8, n_scales = QUANTIZE_OPS[op]
        nbytes = x.numel() * (x.element_size() + n_fp8) + 4 * n_scales(args.M, args.N)
        expected = make(ref)(x)
        for impl, mod in mods.items():
            fn = torch.compile(make(ref), dynamic=False) if impl == "compile" else make(mod)
            got = fn(x)
            same = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, expected, strict=True))
            if impl == "triton" and not same:
                raise AssertionError(f"{op}: triton result differs from the reference; not timing it")
            ms = time_ms(functools.partial(fn, x), args.device, args.reps)
            rows.append(_row(op, args, impl, nbytes, ms, copy_gbps, bit_exact=same))
        del expected
    return rows


# Row producers, run in order after the copy baseline. Append new benchmarks here.
BENCHMARKS: list[Callable[[argparse.Namespace, float], list[Row]]] = [bench_quantize]


def print_table(rows: list[Row]) -> None:
    cols = ("op", "shape", "impl", "gbps", "frac_of_copy", "ms", "bit_exact")
    widths = [max(len(c), *(len(str(r.get(c))) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for r in rows:
        print("  ".join(str(r.get(c)).ljust(w) for c, w in zip(cols, widths, strict=True)))


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --device cpu for a smoke test")
    args.device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    copy = bench_copy(args)
    rows = [copy]
    for bench in BENCHMARKS:
        rows += bench(args, copy["gbps"])
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
