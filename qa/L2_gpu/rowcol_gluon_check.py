"""Repeats the Gluon rows + columns quantize kernel ([Note: rows and columns without a transpose] in
kernels/_quantize_rowcol_gluon.py) in both settings against the torch reference, several times per input,
and times the settings that always matched (a setting that differed only sometimes would have a race),
beside the Triton kernel (CUDA-graph replays; fractions of a clone's bandwidth).

    python qa/L2_gpu/rowcol_gluon_check.py [--repeats 3]      # one GPU (sm_90+), repository root
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.testing
from distwgrad.kernels import _quantize_rowcol_gluon as kg
from distwgrad.kernels import quantize as kq

from distwgrad.fp8 import BlockwiseScaling
from distwgrad.fp8.quantize import quantize_rowwise_and_columnwise as reference


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
    """Same bits: ``got`` (data, scale_inv) pairs against the reference's two ``Quantized``."""
    return all(torch.equal(d.view(torch.uint8), q.data.view(torch.uint8))
               and torch.equal(s.view(torch.int32), q.scale_inv.view(torch.int32)) for (d, s), q in zip(got, ref))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    assert kg.AVAILABLE and torch.cuda.is_available(), "needs Gluon and a GPU"
    rec = BlockwiseScaling()
    xs = {k: v.cuda() for k, v in _inputs().items()}
    refs = {k: reference(x, rec) for k, x in xs.items()}
    big = xs["8192x16384 bf16"]
    gbps = lambda ms: big.numel() * 4 / ms / 1e6  # bytes read (bf16) + written (two fp8 copies)
    graph = lambda fn: triton.testing.do_bench_cudagraph(fn, return_mode="median")
    copy_gbps = gbps(graph(lambda: big.clone()))  # a clone also moves 4 bytes per element
    print(f"copy {copy_gbps:.0f} GB/s; triton kernel "
          f"{gbps(graph(lambda: _triton(big, rec))) / copy_gbps:.3f} of copy")
    for compact in (True, False):
        line = f"gluon compact={compact}: "
        try:
            bad = [name for _ in range(args.repeats) for name, x in xs.items()
                   if not _same(_run(x, rec, compact), refs[name])]
        except Exception as exc:  # noqa: BLE001 - a setting that does not build is a result too
            while exc.__cause__ is not None:
                exc = exc.__cause__
            print(line + f"does not build: {exc!r}"[:400], flush=True)
            continue
        if bad:
            line += f"MISMATCH {sorted(set(bad))} ({len(bad)} of {args.repeats * len(xs)} runs)"
        else:
            frac = gbps(graph(lambda c=compact: _run(big, rec, c))) / copy_gbps
            line += f"bit-exact every time, {frac:.3f} of copy"
        print(line, flush=True)
    return 0


def _triton(x, rec):
    """The Triton kernel (``ROWCOL_GLUON = False``)."""
    old, kq.ROWCOL_GLUON = kq.ROWCOL_GLUON, False
    try:
        return kq.quantize_rowwise_and_columnwise(x, rec)
    finally:
        kq.ROWCOL_GLUON = old


def _run(x, rec, compact):
    """The Gluon kernel with these settings (as ``quantize._rowcol_impl`` launches it): (data, scale_inv)
    of the rows and of the columns (x^T)."""
    M, N = x.shape
    dt = rec.dtype
    data = torch.empty((M, N), dtype=dt, device=x.device)
    s = torch.empty((M, triton.cdiv(N, 128)), dtype=torch.float32, device=x.device)
    dt_t = torch.empty((N, M), dtype=dt, device=x.device)
    st = torch.empty((N, triton.cdiv(M, 128)), dtype=torch.float32, device=x.device)
    kg.rowcol_kernel[(triton.cdiv(M, 128), triton.cdiv(N, 128))](
        x, data.view(torch.uint8), s, dt_t.view(torch.uint8).view(torch.int32), st, M, N,
        NUM=448.0, FP8=kq._TL_FP8[dt], COMPACT=compact, num_warps=kg.NUM_WARPS.value)
    return (data, s), (dt_t, st)


if __name__ == "__main__":
    raise SystemExit(main())
