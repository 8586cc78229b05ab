"""Per-tensor FP8: the cast of x and its transposed copy x^T (plain, or in the aligned token layout) in one pass.

[Note: per-tensor cast and transpose]
A per-tensor GEMM operand is needed as ``x`` ``[T, R]`` and as ``x^T`` (the wgrad contracts over the tokens;
Hopper's FP8 MMAs take both operands K-major). One scale serves both, so x^T is a transposed copy of x's fp8
bits, and writing both from one read of x saves a byte per element. The kernel walks x^T's places as
``token_layout._transpose_aligned_kernel`` does and stores the same bits at the tokens' rows of the data;
tokens in no group are cast by the program whose place range covers their index. The bits are those of
``quantize_per_tensor`` then ``transpose`` / ``transpose_aligned`` (``tests/test_cast_transpose.py``).
fp32 inputs round in software (``_to_fp8_bits`` without ``HW_CAST``): the hardware conversion of tiles loaded
from fp32 came out wrong in the transposed copy (Triton 3.6, H200; held by ``tests/test_cast_transpose.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import call
from ._host import cdiv, next_pow2
from ._launch import launch
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
    """qt[r, c] = fp8(x[token, r] * scale) for the place c of a token (``token_layout._place_tokens``), else 0;
    q[t, r] = fp8(x[t, r] * scale) for every token t ([Note: per-tensor cast and transpose])."""
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
    launch(_cast_transpose_kernel, grid,
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
    """``(data, scale_inv, data_t, ends)``: ``x`` ``[T, R]`` quantized with one scale (``quantize_per_tensor``'s
    bits) and its transposed fp8 copy, from one read after the amax pass ([Note: per-tensor cast and transpose]).
    Without ``offs_E``: ``data_t`` is the plain ``[R, T]`` transpose and ``ends`` None. With ``offs_E`` (int32
    ``[E]`` group end offsets): ``transpose_aligned(data, offs_E, align)``'s layout and bits, and its ``ends``."""
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
