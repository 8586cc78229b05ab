"""A Linear's FP8 GEMMs: the Triton kernels against cuBLASLt (``torch._scaled_mm``) and bf16 (CUDA).

    python qa/studies/linear_cublas.py                      # per tensor, the Linear shapes of large and xl
    python qa/studies/linear_cublas.py --recipe blockwise   # 1x128 activations by 128x128 weights
    python qa/studies/linear_cublas.py --recipe blockwise --limits --shapes proj_large  # where cuBLASLt is right
    python qa/studies/linear_cublas.py --host-only          # host microseconds a call only

What [Note: a Linear's fp8 GEMMs on cuBLASLt] (``distwgrad/ops/scaled_mm.py``) rests on, for each Linear of the
presets (16384 tokens: qkv, proj and the lm_head): fprop, dgrad and wgrad (added into fp32, as into ``main_grad``)
on the same quantized operands, in the layouts the modules hand over, each timed as device time in a CUDA graph
(``triton.testing.do_bench_cudagraph``: the host out of the picture), with the error against the fp32 product of
the dequantized operands relative to its largest value (the Triton kernels' and cuBLASLt's should agree), and the
host time a call takes at a small shape, where the host is the bound. The switch ``linear_cublas`` is off here:
the Triton columns call the grouped kernels directly. Blockwise, cuBLASLt (CUDA 12.9 or later, Hopper) reads
a 1x128 operand's scales outer-dimension-major and a 128x128 weight's in the transposed grid, where the kernels
write them row-major: its column includes the copies that reorder them.
"""

from __future__ import annotations

import argparse
import time

import torch

# (name, tokens, in features, out features)
SHAPES = [("qkv large", 16384, 2048, 6144), ("proj large", 16384, 2048, 2048), ("lm_head large", 16384, 2048, 32768),
          ("qkv xl", 16384, 4096, 12288), ("proj xl", 16384, 4096, 4096), ("lm_head xl", 16384, 4096, 32768)]


def _recipe(name: str):
    from distwgrad.fp8.recipes import BlockwiseScaling, PerTensorScaling
    return PerTensorScaling() if name == "per_tensor" else BlockwiseScaling()


def _operands(M: int, K: int, N: int, recipe):
    from distwgrad.fp8.weights import materialize_quantized_group
    from distwgrad.ops import grouped_gemm_fp8 as g8
    from distwgrad.ops.quantize import quantize_experts_blockwise

    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 0.01
    xq, xqt = g8.quantize_operand(x, recipe, grad=False)
    dyq, dyqt = g8.quantize_operand(dy, recipe, grad=True)
    if recipe.family == "blockwise":  # a Linear's weight held whole: one launch into each GEMM's layout
        wf, wb = (quantize_experts_blockwise(w[None], recipe, transpose=t) for t in (False, True))
    else:
        wf = materialize_quantized_group([w], recipe, backward=False, stacked=True)  # fprop's layout
        wb = materialize_quantized_group([w], recipe, backward=True, stacked=True)  # dgrad's: [1, N, K] of [1, K, N]
    return x, w, dy, xq, xqt, dyq, dyqt, wf, wb


def _outer_major(s: torch.Tensor) -> torch.Tensor:
    """A scale grid with the same shape, stored outer dimension first (what cuBLASLt reads blockwise)."""
    return s.t().contiguous().t()


def _gemms(M: int, K: int, N: int, recipe) -> dict:
    """{gemm: (bf16, triton, cublas, fp32 oracle)} as zero-argument callables on one set of operands."""
    from distwgrad.fp8.quantize import Quantized, dequantize
    from distwgrad.ops import grouped_gemm_fp8 as g8

    x, w, dy, xq, xqt, dyq, dyqt, wf, wb = _operands(M, K, N, recipe)
    offs = torch.tensor([M], dtype=torch.int32, device="cuda")
    acc = torch.zeros(N, K, device="cuda")
    deq = lambda q: dequantize(q, dtype=torch.float32)  # noqa: E731
    w_nk = deq(Quantized(wf.data[0], wf.scale_inv[0] if wf.block else wf.scale_inv.reshape(()), wf.block,
                         torch.bfloat16, wf.data[0].shape))
    if recipe.family == "blockwise":  # scales as cuBLASLt reads them: [Note: cuBLASLt's blockwise scale layouts]
        s_f = lambda: (_outer_major(xq.scale_inv), wf.scale_inv[0].t())  # noqa: E731
        s_d = lambda: (_outer_major(dyq.scale_inv), _outer_major(wb.scale_inv[0]))  # noqa: E731
        s_w = lambda: (_outer_major(dyqt.scale_inv), xqt.scale_inv.t().contiguous())  # noqa: E731
    else:
        s_f = lambda: (xq.scale_inv, wf.scale_inv)  # noqa: E731
        s_d = lambda: (dyq.scale_inv, wb.scale_inv)  # noqa: E731
        s_w = lambda: (dyqt.scale_inv, xqt.scale_inv)  # noqa: E731
    fast = not recipe.split_accumulator("fprop")
    return {
        "fprop": (lambda: x @ w.t(),
                  lambda: g8.grouped_fprop_fp8(xq, wf, offs, None, torch.bfloat16),
                  lambda: torch._scaled_mm(xq.data, wf.data[0].t(), *s_f(), out_dtype=torch.bfloat16,
                                           use_fast_accum=fast),
                  lambda: deq(xq) @ w_nk.t()),
        "dgrad": (lambda: dy @ w,
                  lambda: g8.grouped_dgrad_fp8(dyq, wb, offs, torch.bfloat16),
                  lambda: torch._scaled_mm(dyq.data, wb.data[0], *s_d(), out_dtype=torch.bfloat16,
                                           use_fast_accum=fast),
                  lambda: deq(dyq) @ w_nk),
        "wgrad": (lambda: dy.t() @ x,
                  lambda: (g8.grouped_wgrad_fp8(dyqt, xqt, offs, out=acc.unsqueeze(0)), acc)[1],
                  lambda: acc.add_(torch._scaled_mm(dyqt.data, xqt.data.t(), *s_w(), out_dtype=torch.float32,
                                                    use_fast_accum=fast)),
                  lambda: deq(dyqt) @ deq(xqt).t()),
    }, acc


def kernels(shapes, recipe) -> None:
    import triton

    print(f"{'shape':14s} {'gemm':6s} {'bf16 ms':>8s} {'triton':>8s} {'cublas':>8s} {'triton/cublas':>13s} "
          f"{'TFLOP/s triton':>14s} {'cublas':>7s}  rel. error triton, cublas")
    for name, M, K, N in shapes:
        gemms, acc = _gemms(M, K, N, recipe)
        for gemm, (bf16, ours, cublas, oracle) in gemms.items():
            want = oracle()
            errs = []
            for f in (ours, cublas):
                acc.zero_()
                try:
                    errs.append((f().float() - want).abs().max().item() / want.abs().max().item())
                except (RuntimeError, ValueError, NotImplementedError) as e:  # refused: say why, time the rest
                    print(f"{name:14s} {gemm:6s} {'cublas' if f is cublas else 'triton'} refused: "
                          f"{str(e).splitlines()[0][:160]}", flush=True)
                    errs.append(float("nan"))
            if any(e != e for e in errs):
                continue
            t = [triton.testing.do_bench_cudagraph(f, rep=100) for f in (bf16, ours, cublas)]
            flop = 2 * M * N * K
            print(f"{name:14s} {gemm:6s} {t[0]:8.3f} {t[1]:8.3f} {t[2]:8.3f} {t[1] / t[2]:12.2f}x "
                  f"{flop / t[1] / 1e9:14.0f} {flop / t[2] / 1e9:7.0f}  {errs[0]:.1e}, {errs[1]:.1e}", flush=True)
        del gemms, acc
        torch.cuda.empty_cache()


def limits(recipe) -> None:
    """Which shapes cuBLASLt takes and gets right: each GEMM over a grid of rows (tokens), contraction and output
    widths, its error against the fp32 oracle beside the Triton kernels' (right: within twice theirs)."""
    grid = [(M, K, N) for M in (100, 112, 128, 200, 256, 1024) for K in (256, 384, 512, 640, 2048)
            for N in (256, 384, 512, 2048)]
    verdicts: dict[str, dict[str, list]] = {}
    for M, K, N in grid:
        gemms, acc = _gemms(M, K, N, recipe)
        for gemm, (_, ours, cublas, oracle) in gemms.items():
            want = oracle()
            scale = want.abs().max().item()
            acc.zero_()
            e_ours = (ours().float() - want).abs().max().item() / scale
            acc.zero_()
            try:
                e_cublas = (cublas().float() - want).abs().max().item() / scale
                verdict = "right" if e_cublas <= 2 * e_ours + 1e-6 else f"WRONG ({e_cublas:.1e} vs {e_ours:.1e})"
            except (RuntimeError, ValueError, NotImplementedError) as e:
                verdict = "refused: " + str(e).splitlines()[0][:100]
            key = "right" if verdict == "right" else verdict[:5] if verdict.startswith("WRONG") else verdict[:50]
            verdicts.setdefault(gemm, {}).setdefault(key, []).append((M, K, N, verdict))
        del gemms, acc
    for gemm, by in verdicts.items():
        for verdict, cases in by.items():
            print(f"{gemm:6s} {verdict:50s} {len(cases):3d} cases", flush=True)
            if verdict != "right":
                for M, K, N, why in cases:
                    print(f"       M {M} K {K} N {N}: {why}", flush=True)


def host(recipe, calls: int = 2000) -> None:
    """Host microseconds a call at 256 x 256 x 256 (the device idles: the host is the bound)."""
    gemms, _ = _gemms(256, 256, 256, recipe)
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
    p.add_argument("--recipe", choices=("per_tensor", "blockwise"), default="per_tensor")
    p.add_argument("--host-only", action="store_true", help="only the host time a call")
    p.add_argument("--limits", action="store_true", help="also which small shapes cuBLASLt takes")
    args = p.parse_args(argv)
    names = {s[0].replace(" ", "_"): s for s in SHAPES}
    chosen = [v for v in args.shapes.split(",") if v]
    bad = [v for v in chosen if v not in names]
    if bad or not chosen:
        p.error(f"--shapes: choose from {','.join(names)}, got {args.shapes!r}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        p.error("needs a CUDA device of compute capability 8.9 or more (cuBLASLt's FP8 GEMMs)")
    torch.backends.cuda.matmul.allow_tf32 = False
    recipe = _recipe(args.recipe)
    print(f"recipe {args.recipe}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{torch.cuda.get_device_name()}", flush=True)
    if args.limits:
        limits(recipe)
    if not args.host_only:
        kernels([names[v] for v in chosen], recipe)
    host(recipe)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
