"""A Linear's FP8 GEMMs on cuBLASLt (``torch._scaled_mm``), where it runs them right; None elsewhere.

[Note: a Linear's fp8 GEMMs on cuBLASLt]
A Linear is one group of the grouped FP8 GEMMs ([Note: fp8 gemm dispatch] in ``grouped_gemm_fp8.py``). cuBLASLt's
FP8 GEMM reads the same operands (FP8 data and fp32 ``scale_inv``: one per tensor, or DeepSeek's 1x128 activation
tiles by 128x128 weight blocks) and accumulates as the recipe's ``MMParams`` say (``use_fast_accum`` is ``not
use_split_accumulator``; blockwise always splits), so its products differ from the Triton kernels' only in the
order of fp32 sums, within ``reference_fp8.error_bound``. Its kernels are faster at every Linear shape of the
``large`` and ``xl`` presets, and a call costs the host one C++ operation where the Triton path runs Python
(docs/benchmarks/LOG.md). So a Linear's fprop, dgrad and wgrad run there when all of these hold, else in the
grouped kernels:
* the operands are on a CUDA device of compute capability 8.9 or more, and ``GroupedGemmFp8Tuning.linear_cublas``;
* both are per tensor and not both E5M2 (cuBLASLt has no E5M2 x E5M2 GEMM), or both blockwise in exactly those
  tiles on compute capability 9.x with CUDA 12.9 or later (:func:`blockwise_ok`);
* the first is row-major and the second column-major, as the modules lay them out (fprop reads the weight,
  dgrad its transposed copy, wgrad x^T), with 16-byte aligned addresses and leading dimensions, the contraction
  and the output's width multiples of 16, and at least one row;
* fprop has no bias (the Triton epilogue adds it in fp32);
* wgrad writes a fresh product, or adds it into a contiguous fp32 ``out`` (one more pass over ``out``), zeroed
  first if flagged unwritten ([Note: an unwritten accumulator]): a graphed first contribution is then eager's
  fresh product, as the Triton kernels' would be.

[Note: cuBLASLt's blockwise scale layouts]
cuBLASLt reads a 1x128 operand's scales outer dimension first (``[M, K / 128]`` with strides ``(1, M)``) and a
128x128 weight's in the grid of the operand as the GEMM reads it; the kernels write both row-major, so a call
reorders the activations' grids and dgrad's weight grid (small copies: 4 bytes for each 128 of an operand's
values). torch checks the shapes and strides but not what cuBLASLt needs beyond them, and then cuBLASLt returns
wrong numbers without an error: on an H100 (torch 2.11, CUDA 13.0), of the 1x128 by 128x128 GEMMs whose
contraction was 256, 384 or 640 wide (a row of 2, 3 or 5 weight scales, not 16 bytes), 61 of 72 fprops and 52 of
60 dgrads came back wrong, by 12% to 3e37 of the product's largest value; every one at 512 and 2048 was right,
as were all the wgrads torch took (it refuses token counts that are not multiples of 16)
(``qa/studies/linear_cublas.py --recipe blockwise --limits``, the same counts in two runs). :func:`blockwise_ok`
therefore admits what that grid measured right: rows a multiple of 4, widths multiples of 128, and a 1x128 by
128x128 contraction a multiple of 512; and the calls take only the outputs measured: bf16 from fprop and dgrad,
fp32 from wgrad. ``tests/test_scaled_mm.py`` checks a Linear at the widths and dtypes refused against the oracle.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from distwgrad.fp8.quantize import Quantized, QuantizedExperts
from distwgrad.weights.first_write import zero_where_flagged

__all__ = ["linear_fprop", "linear_dgrad", "linear_wgrad", "layout_ok", "blockwise_ok"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT = (torch.bfloat16, torch.float16, torch.float32)
_ACT, _WEIGHT = (1, 128), (128, 128)  # the only blockwise tiles cuBLASLt takes
# blockwise outputs measured right ([Note: cuBLASLt's blockwise scale layouts]): fprop and dgrad, wgrad
_BLOCKWISE_OUT, _BLOCKWISE_WGRAD_OUT = (torch.bfloat16,), (torch.float32,)


@functools.cache
def _capable(index: int) -> bool:
    return hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(index) >= (8, 9)


@functools.cache
def _blockwise_capable(index: int) -> bool:
    """cuBLASLt's 1x128 / 128x128 block scaling: Hopper, CUDA 12.9 or later."""
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return torch.cuda.get_device_capability(index)[0] == 9 and cuda >= (12, 9)


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


def blockwise_ok(M: int, K: int, N: int, *, weight: bool) -> bool:
    """Whether an ``[M, K] @ [K, N]`` GEMM of blockwise operands is one cuBLASLt gets right ([Note: cuBLASLt's
    blockwise scale layouts]): ``weight``, 1x128 tiles by 128x128 blocks (fprop, dgrad): M a multiple of 4, K of
    512, N of 128; else 1x128 by 1x128 along the contraction (wgrad): M and N multiples of 128, K of 128."""
    if weight:
        return M > 0 and M % 4 == 0 and K % 512 == 0 and N % 128 == 0
    return M > 0 and M % 128 == 0 and K % 128 == 0 and N % 128 == 0


def _outer_major(s: torch.Tensor) -> torch.Tensor:
    """A scale grid of the same shape, stored outer dimension first."""
    return s.t().contiguous().t()


def _per_tensor(q) -> bool:
    return q.block is None and q.scale_inv.numel() == 1


def _blockwise(q: Quantized, block: tuple[int, int]) -> bool:
    return q.block == block and q.scale_inv.is_contiguous()


def _weight(w_qs: Sequence[Quantized] | QuantizedExperts):
    """The one weight's ``[N, K]`` data, scale (per tensor, or its row-major 128x128 grid) and block; else None."""
    if isinstance(w_qs, QuantizedExperts):
        if w_qs.data.shape[0] != 1:
            return None
        w = (w_qs.data[0], w_qs.scale_inv if w_qs.block is None else w_qs.scale_inv[0], w_qs.block)
    elif len(w_qs) != 1:
        return None
    else:
        w = (w_qs[0].data, w_qs[0].scale_inv, w_qs[0].block)
    ok = w[1].numel() == 1 if w[2] is None else w[2] == _WEIGHT and w[1].is_contiguous()
    return w if ok else None


def _mm(a, a_s, b, b_s, out_dtype: torch.dtype, split: bool) -> torch.Tensor | None:
    if out_dtype not in _OUT or not layout_ok(a, b):
        return None
    return torch._scaled_mm(a, b, a_s, b_s, out_dtype=out_dtype, use_fast_accum=not split)


def _act_by_weight(a_q: Quantized, w, b: torch.Tensor, out_dtype, split, *, transposed: bool):
    """``a @ b``, ``b`` the weight ``w`` as the GEMM reads it (``transposed``: dgrad's copy): per tensor, or 1x128
    tiles by 128x128 blocks where :func:`blockwise_ok` admits them; else None."""
    if not _enabled(a_q.data):
        return None
    if _per_tensor(a_q) and w[2] is None:
        return _mm(a_q.data, a_q.scale_inv, b, w[1], out_dtype, split)
    if (_blockwise(a_q, _ACT) and w[2] == _WEIGHT and out_dtype in _BLOCKWISE_OUT and layout_ok(a_q.data, b)
            and blockwise_ok(a_q.shape[0], a_q.shape[1], b.shape[1], weight=True)
            and _blockwise_capable(a_q.data.device.index)):
        # [Note: cuBLASLt's blockwise scale layouts]: the weight's grid as the GEMM reads its operand
        b_s = _outer_major(w[1]) if transposed else w[1].t()
        return torch._scaled_mm(a_q.data, b, _outer_major(a_q.scale_inv), b_s, out_dtype=out_dtype,
                                use_fast_accum=not split)
    return None


def linear_fprop(x_q: Quantized, w_qs, out_dtype: torch.dtype, split: bool) -> torch.Tensor | None:
    """``y = x w^T`` (no bias) in ``out_dtype``, or None where cuBLASLt does not run it."""
    w = _weight(w_qs)
    return None if w is None else _act_by_weight(x_q, w, w[0].t(), out_dtype, split, transposed=False)


def linear_dgrad(dy_q: Quantized, w_qs, out_dtype: torch.dtype, split: bool) -> torch.Tensor | None:
    """``dx = dy w`` in ``out_dtype`` from dgrad's weight layout, or None where cuBLASLt does not run it."""
    w = _weight(w_qs)
    return None if w is None else _act_by_weight(dy_q, w, w[0], out_dtype, split, transposed=True)


def linear_wgrad(dy_qt: Quantized, x_qt: Quantized, out: torch.Tensor | None, out_dtype: torch.dtype,
                 split: bool, first: torch.Tensor | None = None) -> torch.Tensor | None:
    """``dW = dy^T x``: fresh in ``out_dtype`` (``out`` None) or added into a contiguous fp32 ``out``, returned;
    ``first``: ``out``'s flag ([Note: an unwritten accumulator]), zeroed first where set. None where cuBLASLt does
    not run it (nothing written)."""
    if not _enabled(dy_qt.data):
        return None
    if out is not None and not (out.dtype == torch.float32 and out.is_contiguous()
                                and tuple(out.shape) == (dy_qt.shape[0], x_qt.shape[0])):
        return None
    out_dtype = out_dtype if out is None else torch.float32
    if _per_tensor(dy_qt) and _per_tensor(x_qt):
        dW = _mm(dy_qt.data, dy_qt.scale_inv, x_qt.data.t(), x_qt.scale_inv, out_dtype, split)
    elif (_blockwise(dy_qt, _ACT) and _blockwise(x_qt, _ACT) and out_dtype in _BLOCKWISE_WGRAD_OUT
          and layout_ok(dy_qt.data, x_qt.data.t())
          and blockwise_ok(dy_qt.shape[0], dy_qt.shape[1], x_qt.shape[0], weight=False)
          and _blockwise_capable(dy_qt.data.device.index)):
        # [Note: cuBLASLt's blockwise scale layouts]: both operands' tiles run along the tokens
        dW = torch._scaled_mm(dy_qt.data, x_qt.data.t(), _outer_major(dy_qt.scale_inv),
                              _outer_major(x_qt.scale_inv).t(), out_dtype=out_dtype, use_fast_accum=not split)
    else:
        return None
    if dW is None or out is None:
        return dW
    if first is not None:
        zero_where_flagged(out, first)
    return out.add_(dW)
