"""A Linear's per-tensor FP8 GEMMs: the Triton kernels against cuBLASLt (``torch._scaled_mm``) and bf16 (CUDA).

    python qa/studies/linear_cublas.py              # the Linear shapes of the large and xl presets
    python qa/studies/linear_cublas.py --host-only  # host microseconds a call only

What [Note: a Linear's fp8 GEMMs on cuBLASLt] (``distwgrad/ops/scaled_mm.py``) rests on, for each Linear of the
presets (16384 tokens: qkv, proj and the lm_head): fprop, dgrad and wgrad (added into fp32, as into ``main_grad``)
on the same quantized operands, in the layouts the modules hand over, each timed as device time in a CUDA graph
(``triton.testing.do_bench_cudagraph``: the host out of the picture), with the error against the fp32 product of
the dequantized operands relative to its largest value (the Triton kernels' and cuBLASLt's should agree), and the
host time a call takes at a small shape, where the host is the bound. The switch ``linear_cublas`` is off here:
the Triton columns call the grouped kernels directly.
"""

from __future__ import annotations

import argparse
import time

import torch

# (name, tokens, in features, out features)
SHAPES = [("qkv large", 16384, 2048, 6144), ("proj large", 16384, 2048, 2048), ("lm_head large", 16384, 2048, 32768),
          ("qkv xl", 16384, 4096, 12288), ("proj xl", 16384, 4096, 4096), ("lm_head xl", 16384, 4096, 32768)]


def _operands(M: int, K: int, N: int):
    from distwgrad.fp8.recipes import PerTensorScaling
    from distwgrad.fp8.weights import materialize_quantized_group
    from distwgrad.ops import grouped_gemm_fp8 as g8

    recipe = PerTensorScaling()
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 0.01
    xq, xqt = g8.quantize_operand(x, recipe, grad=False)
    dyq, dyqt = g8.quantize_operand(dy, recipe, grad=True)
    wf = materialize_quantized_group([w], recipe, backward=False, stacked=True)  # fprop's layout
    wb = materialize_quantized_group([w], recipe, backward=True, stacked=True)  # dgrad's: [1, N, K] of [1, K, N]
    return x, w, dy, xq, xqt, dyq, dyqt, wf, wb


def _gemms(M: int, K: int, N: int) -> dict:
    """{gemm: (bf16, triton, cublas, fp32 oracle)} as zero-argument callables on one set of operands."""
    from distwgrad.fp8.quantize import dequantize
    from distwgrad.ops import grouped_gemm_fp8 as g8

    x, w, dy, xq, xqt, dyq, dyqt, wf, wb = _operands(M, K, N)
    offs = torch.tensor([M], dtype=torch.int32, device="cuda")
    w_nk, w_s = wf.data[0], wf.scale_inv
    acc = torch.zeros(N, K, device="cuda")
    deq = lambda q: dequantize(q, dtype=torch.float32)  # noqa: E731
    return {
        "fprop": (lambda: x @ w.t(),
                  lambda: g8.grouped_fprop_fp8(xq, wf, offs, None, torch.bfloat16),
                  lambda: torch._scaled_mm(xq.data, w_nk.t(), xq.scale_inv, w_s, out_dtype=torch.bfloat16),
                  lambda: deq(xq) @ (w_nk.float() * w_s).t()),
        "dgrad": (lambda: dy @ w,
                  lambda: g8.grouped_dgrad_fp8(dyq, wb, offs, torch.bfloat16),
                  lambda: torch._scaled_mm(dyq.data, wb.data[0], dyq.scale_inv, wb.scale_inv,
                                           out_dtype=torch.bfloat16),
                  lambda: deq(dyq) @ (w_nk.float() * w_s)),
        "wgrad": (lambda: dy.t() @ x,
                  lambda: (g8.grouped_wgrad_fp8(dyqt, xqt, offs, out=acc.unsqueeze(0)), acc)[1],
                  lambda: acc.add_(torch._scaled_mm(dyqt.data, xqt.data.t(), dyqt.scale_inv, xqt.scale_inv,
                                                    out_dtype=torch.float32)),
                  lambda: deq(dyqt) @ deq(xqt).t()),
    }, acc


def kernels(shapes) -> None:
    import triton

    print(f"{'shape':14s} {'gemm':6s} {'bf16 ms':>8s} {'triton':>8s} {'cublas':>8s} {'triton/cublas':>13s} "
          f"{'TFLOP/s triton':>14s} {'cublas':>7s}  rel. error triton, cublas")
    for name, M, K, N in shapes:
        gemms, acc = _gemms(M, K, N)
        for gemm, (bf16, ours, cublas, oracle) in gemms.items():
            want = oracle()
            errs = []
            for f in (ours, cublas):
                acc.zero_()
                errs.append((f().float() - want).abs().max().item() / want.abs().max().item())
            t = [triton.testing.do_bench_cudagraph(f, rep=100) for f in (bf16, ours, cublas)]
            flop = 2 * M * N * K
            print(f"{name:14s} {gemm:6s} {t[0]:8.3f} {t[1]:8.3f} {t[2]:8.3f} {t[1] / t[2]:12.2f}x "
                  f"{flop / t[1] / 1e9:14.0f} {flop / t[2] / 1e9:7.0f}  {errs[0]:.1e}, {errs[1]:.1e}", flush=True)
        del gemms, acc
        torch.cuda.empty_cache()


def host(calls: int = 2000) -> None:
    """Host microseconds a call at 256 x 256 x 256 (the device idles: the host is the bound)."""
    gemms, _ = _gemms(256, 256, 256)
    bf16, ours, cublas, _ = gemms["fprop"]
    for name, f in (("bf16 mm", bf16), ("Triton FP8 fprop", ours), ("cuBLASLt FP8 fprop", cublas)):
        for _ in range(50):
            f()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        elapsed = time.perf_counter() - t0
        torch.cuda.synchronize()
        print(f"{name:20s} {elapsed / calls * 1e6:7.1f} us of host time a call", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(s[0].replace(" ", "_") for s in SHAPES),
                   help="comma-separated subset of " + ",".join(s[0].replace(" ", "_") for s in SHAPES))
    p.add_argument("--host-only", action="store_true", help="only the host time a call")
    args = p.parse_args(argv)
    names = {s[0].replace(" ", "_"): s for s in SHAPES}
    chosen = [v for v in args.shapes.split(",") if v]
    bad = [v for v in chosen if v not in names]
    if bad or not chosen:
        p.error(f"--shapes: choose from {','.join(names)}, got {args.shapes!r}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        p.error("needs a CUDA device of compute capability 8.9 or more (cuBLASLt's FP8 GEMMs)")
    torch.backends.cuda.matmul.allow_tf32 = False
    if not args.host_only:
        kernels([names[v] for v in chosen])
    host()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
