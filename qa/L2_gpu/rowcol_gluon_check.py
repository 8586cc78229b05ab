"""Repeats the Gluon rows + columns quantize kernel ([Note: rows and columns without a transpose] in
kernels/gluon/quantize_rowcol.py) in both settings against the torch reference, several times per input,
and times the settings that always matched (a setting that differed only sometimes would have a race),
beside the Triton kernel (CUDA-graph replays; fractions of a clone's bandwidth).

    python qa/L2_gpu/rowcol_gluon_check.py [--repeats 3]      # one GPU (sm_90+), repository root
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.testing
from distwgrad.kernels import quantize as kq
from distwgrad.kernels import tuning
from distwgrad.kernels.gluon import quantize_rowcol as kg

from distwgrad.fp8 import BlockwiseScaling
from distwgrad.fp8.quantize import quantize_rowwise_and_columnwise as reference
from distwgrad.ops.quantize import quantize_rowwise_and_columnwise


def _inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    wide = lambda m, n, dt: (torch.randn(m, n, generator=gen) * torch.logspace(-3, 3, n)).to(dt)
    bits = torch.randint(0, 0x7F800000, (2808,), generator=gen).to(torch.int32).view(torch.float32)
    g = bits[:, None] * torch.linspace(1.0, -0.25, 128)
    odd = wide(8200, 4161, torch.bfloat16)
    odd[3, 5], odd[17, 130] = float("nan"), float("inf")
    return {"amax rows 2808x128 fp32": g, "amax cols 128x2808 fp32": g.t().contiguous(), "odd 8200x4161 bf16": odd,
            "8192x16384 bf16": wide(8192, 16384, torch.bfloat16)}


def _same(got, ref) -> bool:
    """Same bits in both outputs (x quantized by rows and x^T), data and scales."""
    return all(torch.equal(g.data.view(torch.uint8), r.data.view(torch.uint8))
               and torch.equal(g.scale_inv.view(torch.int32), r.scale_inv.view(torch.int32)) for g, r in zip(got, ref))


def _quantize(x, rec, **settings):
    """``quantize_rowwise_and_columnwise`` with ``QuantizeTuning`` fields overridden for the call."""
    with tuning(quantize=settings):
        return quantize_rowwise_and_columnwise(x, rec)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    assert kg.AVAILABLE and torch.cuda.is_available(), "needs Gluon and a GPU"
    rec = BlockwiseScaling()
    xs = {k: v.cuda() for k, v in _inputs().items()}
    refs = {k: reference(x, rec) for k, x in xs.items()}
    assert all(kq._gluon_rowcol(x, 128, True) for x in xs.values()), "an input the Gluon kernel does not take"
    big = xs["8192x16384 bf16"]
    gbps = lambda ms: big.numel() * 4 / ms / 1e6  # bytes read (bf16) + written (two fp8 copies)
    graph = lambda fn: triton.testing.do_bench_cudagraph(fn, return_mode="median")
    copy_gbps = gbps(graph(lambda: big.clone()))  # a clone also moves 4 bytes per element
    print(f"copy {copy_gbps:.0f} GB/s; triton kernel "
          f"{gbps(graph(lambda: _quantize(big, rec, rowcol_gluon=False))) / copy_gbps:.3f} of copy")
    line = "gluon: "
    run = lambda x: _quantize(x, rec, rowcol_gluon=True)  # noqa: E731
    bad = [name for _ in range(args.repeats) for name, x in xs.items() if not _same(run(x), refs[name])]
    if kq._GLUON_FAILED is not None:  # the library fell back to the Triton kernel: nothing to judge
        print(line + f"does not build: {kq._GLUON_FAILED}"[:400], flush=True)
        return 1
    if bad:
        line += f"MISMATCH {sorted(set(bad))} ({len(bad)} of {args.repeats * len(xs)} runs)"
    else:
        line += f"bit-exact every time, {gbps(graph(lambda: run(big))) / copy_gbps:.3f} of copy"
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
