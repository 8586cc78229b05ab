"""A Linear's per-tensor FP8 GEMMs on cuBLASLt (``torch._scaled_mm``), where it runs them; None elsewhere.

[Note: a Linear's fp8 GEMMs on cuBLASLt]
A Linear is one group of the grouped FP8 GEMMs ([Note: fp8 gemm dispatch] in ``grouped_gemm_fp8.py``). Under
per-tensor scaling cuBLASLt's FP8 GEMM reads the same operands (FP8 data, one fp32 ``scale_inv`` each) and
accumulates as the recipe's ``MMParams`` say (``use_fast_accum`` is ``not use_split_accumulator``), so its
products differ from the Triton kernels' only in the order of fp32 sums, within ``reference_fp8.error_bound``.
Its kernels are faster at every Linear shape of the ``large`` and ``xl`` presets, and a call costs the host one
C++ operation where the Triton path runs Python (docs/benchmarks/LOG.md). So a Linear's fprop, dgrad and wgrad run
there when all of these hold, else in the grouped kernels:
* the operands are on a CUDA device of compute capability 8.9 or more, and ``GroupedGemmFp8Tuning.linear_cublas``;
* both are per tensor and not both E5M2 (cuBLASLt has no E5M2 x E5M2 GEMM);
* the first is row-major and the second column-major, as the modules lay them out (fprop reads the weight,
  dgrad its transposed copy, wgrad x^T), with 16-byte aligned addresses and leading dimensions, the contraction
  and the output's width multiples of 16, and at least one row;
* fprop has no bias (the Triton epilogue adds it in fp32);
* wgrad writes a fresh product, or adds it into a contiguous fp32 ``out`` (one more pass over ``out``), zeroed
  first if flagged unwritten ([Note: an unwritten accumulator]): a graphed first contribution is then eager's
  fresh product, as the Triton kernels' would be.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from distwgrad.fp8.quantize import Quantized, QuantizedExperts
from distwgrad.weights.first_write import zero_where_flagged

__all__ = ["linear_fprop", "linear_dgrad", "linear_wgrad", "layout_ok"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def _capable(index: int) -> bool:
    return hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(index) >= (8, 9)


def _enabled(t: torch.Tensor) -> bool:
    if not t.is_cuda or not _capable(t.device.index):
        return False
    from distwgrad.kernels._tuning import current  # late: CUDA only, where the kernels import
    return current().grouped_gemm_fp8.linear_cublas


def layout_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a @ b`` is a GEMM cuBLASLt's FP8 path takes: FP8 ``a`` [M, K] row-major and ``b`` [K, N]
    column-major, not both E5M2, M > 0, K and N multiples of 16, addresses and leading strides 16-byte aligned."""
    if a.dim() != 2 or b.dim() != 2 or a.dtype not in _FP8 or b.dtype not in _FP8:
        return False
    if a.dtype == b.dtype == torch.float8_e5m2:
        return False
    (M, K), (K2, N) = a.shape, b.shape
    return (M > 0 and K == K2 and K % 16 == 0 and N % 16 == 0 and a.stride(1) == 1 and b.stride(0) == 1
            and a.stride(0) % 16 == 0 and b.stride(1) % 16 == 0 and a.data_ptr() % 16 == 0
            and b.data_ptr() % 16 == 0)


def _per_tensor(q) -> bool:
    return q.block is None and q.scale_inv.numel() == 1


def _weight(w_qs: Sequence[Quantized] | QuantizedExperts) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The one weight's ``[N, K]`` data and scale, if per tensor; else None."""
    if isinstance(w_qs, QuantizedExperts):
        if w_qs.data.shape[0] != 1 or w_qs.block is not None:
            return None
        return w_qs.data[0], w_qs.scale_inv
    if len(w_qs) != 1 or not _per_tensor(w_qs[0]):
        return None
    return w_qs[0].data, w_qs[0].scale_inv


def _mm(a, a_s, b, b_s, out_dtype: torch.dtype, split: bool) -> torch.Tensor | None:
    if out_dtype not in _OUT or not layout_ok(a, b):
        return None
    return torch._scaled_mm(a, b, a_s, b_s, out_dtype=out_dtype, use_fast_accum=not split)


def linear_fprop(x_q: Quantized, w_qs, out_dtype: torch.dtype, split: bool) -> torch.Tensor | None:
    """``y = x w^T`` (no bias) in ``out_dtype``, or None where cuBLASLt does not run it."""
    w = _weight(w_qs)
    if w is None or not _per_tensor(x_q) or not _enabled(x_q.data):
        return None
    return _mm(x_q.data, x_q.scale_inv, w[0].t(), w[1], out_dtype, split)


def linear_dgrad(dy_q: Quantized, w_qs, out_dtype: torch.dtype, split: bool) -> torch.Tensor | None:
    """``dx = dy w`` in ``out_dtype`` from dgrad's weight layout, or None where cuBLASLt does not run it."""
    w = _weight(w_qs)
    if w is None or not _per_tensor(dy_q) or not _enabled(dy_q.data):
        return None
    return _mm(dy_q.data, dy_q.scale_inv, w[0], w[1], out_dtype, split)


def linear_wgrad(dy_qt: Quantized, x_qt: Quantized, out: torch.Tensor | None, out_dtype: torch.dtype,
                 split: bool, first: torch.Tensor | None = None) -> torch.Tensor | None:
    """``dW = dy^T x``: fresh in ``out_dtype`` (``out`` None) or added into a contiguous fp32 ``out``, returned;
    ``first``: ``out``'s flag ([Note: an unwritten accumulator]), zeroed first where set. None where cuBLASLt does
    not run it (nothing written)."""
    if not (_per_tensor(dy_qt) and _per_tensor(x_qt)) or not _enabled(dy_qt.data):
        return None
    if out is not None and not (out.dtype == torch.float32 and out.is_contiguous()
                                and tuple(out.shape) == (dy_qt.shape[0], x_qt.shape[0])):
        return None
    dW = _mm(dy_qt.data, dy_qt.scale_inv, x_qt.data.t(), x_qt.scale_inv,
             out_dtype if out is None else torch.float32, split)
    if dW is None or out is None:
        return dW
    if first is not None:
        zero_where_flagged(out, first)
    return out.add_(dW)
