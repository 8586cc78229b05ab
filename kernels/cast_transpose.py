"""Per-tensor FP8: the cast of x and its transposed copy x^T (plain, or in the aligned token layout) in one pass.

[Note: per-tensor cast and transpose]
Under per-tensor scaling a GEMM operand is needed twice: as ``x`` ``[T, R]`` (fprop and dgrad contract over
its columns) and as ``x^T`` (the wgrad contracts over the tokens, and Hopper's FP8 MMAs take both operands
K-major). Both share the one scale, so x^T is a transposed copy of x's fp8 bits. Cast, then transpose,
moves 2 + 1 bytes per element (read x, write the fp8 data) and then 1 + 1 (read it again, write x^T): 5
bytes; cast and transpose from one read of x moves 2 + 1 + 1 = 4. The amax pass before them reads x once
more either way (current scaling: no element can be cast before the whole tensor's amax is known;
``quantize.py``'s docstring).

``_cast_transpose_kernel`` walks x^T's columns like ``token_layout._transpose_aligned_kernel``: a program
takes ``BLOCK_T`` places (columns of x^T) by ``BLOCK_R`` features, loads the tokens that lie there from x
(nothing for padding), casts them with the scale of the tensor's amax, stores the tile transposed into x^T
(zeros for padding and the tail, whatever the scale) and the same bits at the tokens' own rows of the data.
Tokens that lie in no group (from the largest end offset on: the up-steps of the offsets cover every token
below it) have no place; program ``i`` of the place grid, which has at least as many programs as tokens need
(x^T is at least T wide), casts the ones among tokens ``[i * BLOCK_T, (i + 1) * BLOCK_T)`` for the data.
A token in two groups (decreasing offsets) is stored twice, the same bits. The arithmetic is
``_cast_per_tensor_kernel``'s, op for op, so the bits are those of ``quantize_per_tensor`` followed by
``transpose`` / ``transpose_aligned`` (``tests/test_cast_transpose.py``).

fp32 operands round in software (``_to_fp8_bits`` without ``HW_CAST``: the same bits, a few integer ops
more per element). On an H200 with Triton 3.6 the hardware conversion (``cvt.rn.satfinite`` of pairs) of a
tile loaded from fp32 came out wrong in the transposed copy, though right in the row-major data: a quarter of
x^T's bytes at 1024 x 512 (E5M2, each of four tilings, 4 or 8 warps), none at 777 x 300 (R not a multiple of
16, which Triton does not specialize: the loads are not vectorized). The software rounding was right in each
of those cases, and tiles loaded from bf16 or fp16 are right with the hardware conversion
(``tests/test_cast_transpose.py`` holds both on the GPU at the failing shape).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import call
from ._host import cdiv, next_pow2
from ._quantize_kernels import _scale_from_amax, _to_fp8_bits
from ._tuning import current as _tuning
from .quantize import _amax, _check_input, _fmt_args, _fmt_args_of, _fp8_format
from .token_layout import (
    _check_layout_args,
    _place_tokens,
    aligned_offsets,
    aligned_width,
)

__all__ = ["cast_transpose_per_tensor"]


@triton.jit
def _cast_transpose_kernel(x_ptr, amax_ptr, q_ptr, qt_ptr, s_inv_ptr, ends_ptr, table_ptr, T, R, W, E,
                           NUM: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr, MANT: tl.constexpr,
                           EMIN_BIASED: tl.constexpr, HW_CAST: tl.constexpr, E_POW2: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, ALIGNED: tl.constexpr,
                           ONE_GROUP: tl.constexpr):
    """qt[r, c] = fp8(x[c + shift_g, r] * scale) for the place c of a token of group g, else 0; q[t, r] =
    fp8(x[t, r] * scale) for every token t ([Note: per-tensor cast and transpose]); places as
    ``token_layout._place_tokens`` reads them (not ALIGNED: W = T, the plain transpose)."""
    pid_t = tl.program_id(0)
    scale = _scale_from_amax(tl.load(amax_ptr), NUM, False)
    col0 = pid_t * BLOCK_T
    cols = col0 + tl.arange(0, BLOCK_T)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_r = (rows < R)[None, :]
    valid, token = _place_tokens(col0, cols, ends_ptr, table_ptr, W, E, E_POW2, BLOCK_T, ALIGNED, ONE_GROUP)
    mask = valid[:, None] & in_r
    src = token.to(tl.int64)[:, None] * R + rows[None, :]
    x = tl.load(x_ptr + src, mask=mask, other=0.0)
    q = _to_fp8_bits(x.to(tl.float32) * scale, FP8, FP8_MAX, MANT, EMIN_BIASED, HW_CAST)
    tl.store(q_ptr + src, q, mask=mask)
    q = tl.where(mask, q, 0)  # padding and the tail are zeros whatever the scale (0 * NaN is NaN)
    dst = qt_ptr + rows.to(tl.int64)[:, None] * W + cols[None, :]
    tl.store(dst, tl.trans(q), mask=(rows < R)[:, None] & (cols < W)[None, :])
    if ALIGNED:  # tokens in no group: this program casts those of tokens [col0, col0 + BLOCK_T)
        g_all = tl.arange(0, E_POW2)
        gin = g_all < E
        covered = tl.max(tl.load(table_ptr + g_all, mask=gin, other=0) + tl.load(table_ptr + E + g_all, mask=gin,
                         other=0) + tl.load(table_ptr + 2 * E + g_all, mask=gin, other=0), axis=0)
        if (col0 + BLOCK_T > covered) & (col0 < T):
            tail = ((cols >= covered) & (cols < T))[:, None] & in_r
            t_src = cols.to(tl.int64)[:, None] * R + rows[None, :]
            xt = tl.load(x_ptr + t_src, mask=tail, other=0.0)
            tl.store(q_ptr + t_src, _to_fp8_bits(xt.to(tl.float32) * scale, FP8, FP8_MAX, MANT, EMIN_BIASED,
                                                 HW_CAST), mask=tail)
    if pid_t == 0 and tl.program_id(1) == 0:
        tl.store(s_inv_ptr, tl.math.div_rn(1.0 + tl.zeros_like(scale), scale))


def _impl(x: torch.Tensor, ends: torch.Tensor | None, table: torch.Tensor | None, dtype: torch.dtype,
          margin: int, align: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T, R = x.shape
    E = 0 if ends is None else ends.shape[0]
    W = T if ends is None else aligned_width(T, E, align)
    data = torch.empty(T, R, dtype=dtype, device=x.device)
    data_t = torch.empty(R, W, dtype=dtype, device=x.device)
    scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    t = _tuning()
    amax = _amax(x)
    grid = (max(1, cdiv(W, t.token_layout.block_t)), max(1, cdiv(R, t.token_layout.block_r)))
    _cast_transpose_kernel[grid](
        x, amax, data.view(torch.uint8), data_t.view(torch.uint8), scale_inv,
        ends if ends is not None else amax, table if table is not None else amax, T, R, W, E,
        E_POW2=next_pow2(max(E, 1)), BLOCK_T=t.token_layout.block_t, BLOCK_R=t.token_layout.block_r,
        ALIGNED=ends is not None, ONE_GROUP=ends is not None and align % t.token_layout.block_t == 0,
        **(_fmt_args_of(dtype, margin, False) if x.dtype == torch.float32 else _fmt_args(dtype, margin)))
    return data, scale_inv, data_t


_op = torch.library.custom_op("distwgrad::fp8_cast_transpose_per_tensor", _impl, mutates_args=())


@_op.register_fake
def _(x, ends, table, dtype, margin, align):
    T, R = x.shape
    W = T if ends is None else aligned_width(T, ends.shape[0], align)
    return torch.empty_like(x, dtype=dtype), x.new_empty((), dtype=torch.float32), x.new_empty((R, W), dtype=dtype)


def cast_transpose_per_tensor(x: torch.Tensor, dtype: torch.dtype, *, margin: int = 0,
                              offs_E: torch.Tensor | None = None, align: int = 128
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(data, scale_inv, data_t, ends)``: ``x`` ``[T, R]`` quantized with one scale (the bits of
    ``quantize.quantize_per_tensor``) and its transposed fp8 copy, from one read of ``x`` after the amax pass
    ([Note: per-tensor cast and transpose]).

    Without ``offs_E``, ``data_t`` is the plain ``[R, T]`` transpose (``token_layout.transpose``'s bits) and
    ``ends`` is None. With ``offs_E`` (int32 ``[E]`` end offsets of the token groups), ``data_t`` is
    ``token_layout.transpose_aligned(data, offs_E, align)``'s layout and bits, and ``ends`` its end offsets.
    """
    _fp8_format(dtype)
    if isinstance(x, torch.Tensor) and x.dim() != 2:
        raise ValueError(f"cast_transpose_per_tensor: x must be 2-D [T, R] (tokens, features), got shape "
                         f"{tuple(x.shape)}")
    _check_input(x, two_d=True)
    if offs_E is not None:
        _check_layout_args("cast_transpose_per_tensor", x.device, offs_E, align)
    if offs_E is None:
        data, scale_inv, data_t = call(torch.ops.distwgrad.fp8_cast_transpose_per_tensor, _impl, x, None, None,
                                       dtype, margin, align)
        return data, scale_inv, data_t, None
    ends, table = aligned_offsets(offs_E, x.shape[0], align)
    data, scale_inv, data_t = call(torch.ops.distwgrad.fp8_cast_transpose_per_tensor, _impl, x, ends, table, dtype,
                                   margin, align)
    return data, scale_inv, data_t, ends
