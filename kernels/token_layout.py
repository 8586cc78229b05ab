"""The per-tensor FP8 wgrad operand x^T with each token group on the 128-token grid, in one pass.

[Note: aligned token groups]
The FP8 wgrad contracts each group's tokens in 128-token chunks on a grid ([Note: fp8 wgrad chunks] in
``grouped_gemm_fp8``); a group's edge chunks then hold other groups' tokens, which the kernels must zero, a
large share of their time at ~1024 tokens per group. With every group starting on the grid and zeros up to
the next, no chunk holds two groups and nothing is masked; the products are the same (the fp32 sums follow
each group's own grid). Per tensor, x^T is a transposed copy of x's fp8 bits, so ``transpose_aligned``
builds this layout in one pass, at a plain transpose's cost; its end offsets count each group's padding.
Torch reference (bit-identical): ``distwgrad.ops.grouped_gemm_fp8.align_token_groups``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._dispatch import call
from ._host import cdiv, next_pow2
from ._launch import launch
from ._tuning import current as _tuning

__all__ = ["transpose_aligned", "transpose", "aligned_width", "aligned_offsets"]



def aligned_width(T: int, E: int, align: int) -> int:
    """Columns of the aligned layout: room for every group's padding, and a last column past them all."""
    return -(-(T + (align - 1) * E + 1) // align) * align


def aligned_offsets(offs_E: torch.Tensor, T: int, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 end offsets of the aligned layout, int32 [3, E] table of each group's new start, size, old start
    - new start), offsets clamped into [0, T]; kept per routing ([Note: one layout per routing])."""
    memo = _memo(offs_E)
    key = (T, align)
    kept = memo.get(key) if memo is not None else None
    if kept is not None and all(t._version == v for t, v in zip(*kept)):
        return kept[0]
    layout = _layout_kernel_call(offs_E, T, align) if _on_kernel(offs_E) else _layout_torch(offs_E, T, align)
    if memo is not None:
        memo[key] = (layout, tuple(t._version for t in layout))
    return layout


def _layout_torch(offs_E: torch.Tensor, T: int, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`aligned_offsets`' layout in torch ops (what a torch.compile trace records, and the CPU path)."""
    ends = offs_E.long().clamp(0, T)
    sizes = (ends - torch.cat([ends.new_zeros(1), ends[:-1]])).clamp_min(0)
    padded = -(-sizes // align) * align
    new_ends = padded.cumsum(0)
    starts = new_ends - padded
    return new_ends.to(torch.int32), torch.stack([starts, sizes, (ends - sizes) - starts]).to(torch.int32)


def _on_kernel(offs_E: torch.Tensor) -> bool:
    """Whether :func:`_layout_kernel` makes the layout (one launch instead of a dozen small ops): a plain tensor
    on CUDA (or CPU under TRITON_INTERPRET=1), and not while torch.compile traces (the ops belong in the graph)."""
    if type(offs_E) is not torch.Tensor or torch.compiler.is_compiling():
        return False
    return offs_E.is_cuda or (offs_E.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _layout_kernel(offs_ptr, ends_ptr, table_ptr, E, T, align, BLOCK: tl.constexpr):
    """``_layout_torch`` in one program of BLOCK >= E lanes, the same integer arithmetic (int64)."""
    i = tl.arange(0, BLOCK)
    inside = i < E
    ends = tl.minimum(tl.maximum(tl.load(offs_ptr + i, mask=inside, other=0).to(tl.int64), 0), T)
    prev = tl.load(offs_ptr + i - 1, mask=inside & (i > 0), other=0).to(tl.int64)
    sizes = tl.maximum(ends - tl.minimum(tl.maximum(prev, 0), T), 0)
    padded = (sizes + align - 1) // align * align
    new_ends = tl.cumsum(padded, 0)
    starts = new_ends - padded
    tl.store(ends_ptr + i, new_ends.to(tl.int32), mask=inside)
    tl.store(table_ptr + i, starts.to(tl.int32), mask=inside)
    tl.store(table_ptr + E + i, sizes.to(tl.int32), mask=inside)
    tl.store(table_ptr + 2 * E + i, ((ends - sizes) - starts).to(tl.int32), mask=inside)


def _layout_kernel_call(offs_E: torch.Tensor, T: int, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    E = offs_E.shape[0]
    ends = torch.empty(E, dtype=torch.int32, device=offs_E.device)
    table = torch.empty(3, E, dtype=torch.int32, device=offs_E.device)
    if E:
        launch(_layout_kernel, (1,), offs_E, ends, table, E, T, align, BLOCK=next_pow2(E))
    return ends, table


# [Note: one layout per routing]
# A grouped module under per-tensor FP8 needs its routing's aligned layout six times a step (x^T and dy^T of
# fc1 and fc2, and their wgrads' offsets), all from one offsets tensor, and the layout's dozen small ops cost
# more host time than the transposes. So it is kept on the offsets tensor (an attribute: it dies with the
# routing), keyed by (T, align), valid while neither the offsets nor the layout's tensors were written in
# place. Not while torch.compile traces or a CUDA graph captures (the layout must be the graph's own), and
# only for plain tensors.
_ATTR = "_distwgrad_aligned_layouts"


def _memo(offs_E: torch.Tensor) -> dict | None:
    if type(offs_E) is not torch.Tensor or torch.compiler.is_compiling():
        return None
    if offs_E.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    version, memo = getattr(offs_E, _ATTR, (None, None))
    if version != offs_E._version:
        memo = {}
        setattr(offs_E, _ATTR, (offs_E._version, memo))
    return memo


@triton.jit
def _place_tokens(col0, cols, ends_ptr, table_ptr, W, E, E_POW2: tl.constexpr, BLOCK_T: tl.constexpr,
                  ALIGNED: tl.constexpr, ONE_GROUP: tl.constexpr):
    """(valid, token) of the places ``cols`` of x^T: whether each holds a token, and which (0 where none).
    ALIGNED: the place's group g is the first whose aligned end lies past it; else the plain transpose (W = T).
    ONE_GROUP: ``align`` is a multiple of BLOCK_T, so a program's places lie in one group, found once."""
    if ALIGNED:
        e = tl.arange(0, E_POW2)
        ends = tl.load(ends_ptr + e, mask=e < E, other=2147483647)
        if ONE_GROUP:
            g = tl.sum((ends <= col0).to(tl.int32), axis=0) + tl.zeros([BLOCK_T], tl.int32)
        else:
            g = tl.sum((ends[None, :] <= cols[:, None]).to(tl.int32), axis=1)  # [BLOCK_T] group of each place
        inside = g < E
        start = tl.load(table_ptr + g, mask=inside, other=0)
        size = tl.load(table_ptr + E + g, mask=inside, other=0)
        shift = tl.load(table_ptr + 2 * E + g, mask=inside, other=0)
        valid = inside & (cols - start < size)                             # a token's place, not padding
        token = tl.where(valid, cols + shift, 0)
    else:
        valid = cols < W
        token = cols
    return valid, token


@triton.jit
def _transpose_aligned_kernel(src_ptr, dst_ptr, ends_ptr, table_ptr, R, W, E, stride_s, stride_d,
                              E_POW2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                              ALIGNED: tl.constexpr = True, ONE_GROUP: tl.constexpr = False):
    """dst[r, c] = src[token, r] for the place c of a token (``_place_tokens``), else 0 (padding, the tail)."""
    col0 = tl.program_id(0) * BLOCK_T
    cols = col0 + tl.arange(0, BLOCK_T)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid, token = _place_tokens(col0, cols, ends_ptr, table_ptr, W, E, E_POW2, BLOCK_T, ALIGNED, ONE_GROUP)
    src = src_ptr + token.to(tl.int64)[:, None] * stride_s + rows[None, :]
    tile = tl.load(src, mask=valid[:, None] & (rows < R)[None, :], other=0)  # [BLOCK_T, BLOCK_R]
    dst = dst_ptr + rows.to(tl.int64)[:, None] * stride_d + cols[None, :]
    tl.store(dst, tl.trans(tile), mask=(rows < R)[:, None] & (cols < W)[None, :])


def _impl(data: torch.Tensor, ends: torch.Tensor, table: torch.Tensor, align: int) -> torch.Tensor:
    T, R = data.shape
    E = ends.shape[0]
    W = aligned_width(T, E, align)
    out = torch.empty(R, W, dtype=data.dtype, device=data.device)
    if R:
        t = _tuning().token_layout  # output columns (token places) and rows (features) per program
        grid = (cdiv(W, t.block_t), cdiv(R, t.block_r))
        launch(_transpose_aligned_kernel, grid, data.view(torch.uint8), out.view(torch.uint8), ends, table, R, W, E,
               data.stride(0), out.stride(0), E_POW2=next_pow2(max(E, 1)),
               BLOCK_T=t.block_t, BLOCK_R=t.block_r, ONE_GROUP=align % t.block_t == 0)
    return out


_op = torch.library.custom_op("distwgrad::fp8_transpose_aligned", _impl, mutates_args=())


@_op.register_fake
def _(data, ends, table, align):
    T, R = data.shape
    return data.new_empty(R, aligned_width(T, ends.shape[0], align))


def _plain_impl(data: torch.Tensor) -> torch.Tensor:
    T, R = data.shape
    out = torch.empty(R, T, dtype=data.dtype, device=data.device)
    if R and T:
        t = _tuning().token_layout
        grid = (cdiv(T, t.block_t), cdiv(R, t.block_r))
        launch(_transpose_aligned_kernel, grid, data.view(torch.uint8), out.view(torch.uint8), data, data, R, T, 0,
               data.stride(0), out.stride(0), E_POW2=1, BLOCK_T=t.block_t,
               BLOCK_R=t.block_r, ALIGNED=False)
    return out


_plain_op = torch.library.custom_op("distwgrad::fp8_transpose", _plain_impl, mutates_args=())


@_plain_op.register_fake
def _(data):
    return data.new_empty(data.shape[1], data.shape[0])


def _check_data(what: str, data: torch.Tensor) -> None:
    if data.dim() != 2 or not data.is_contiguous() or data.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"{what}: data must be a contiguous float8 [T, R] tensor, got {data.dtype} "
                         f"{tuple(data.shape)} with strides {tuple(data.stride())}")


def _check_layout_args(what: str, device: torch.device, offs_E: torch.Tensor, align: int) -> None:
    """The aligned layout's arguments: int32 ``[E]`` end offsets on the data's device, a 16-multiple grid."""
    if offs_E.dim() != 1 or offs_E.dtype != torch.int32 or offs_E.device != device:
        raise ValueError(f"{what}: offs_E must be int32 [E] on {device}, got {offs_E.dtype} "
                         f"{tuple(offs_E.shape)} on {offs_E.device}")
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align % 16:
        raise ValueError(f"{what}: align must be a positive multiple of 16, got {align!r}")


def transpose(data: torch.Tensor) -> torch.Tensor:
    """The per-tensor x^T: the contiguous transpose of fp8 ``data`` ``[T, R]``, faster than torch's 1-byte copy."""
    _check_data("transpose", data)
    return call(torch.ops.distwgrad.fp8_transpose, _plain_impl, data)


def transpose_aligned(data: torch.Tensor, offs_E: torch.Tensor, align: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data_t, ends)``: the fp8 bits ``data`` (contiguous ``[T, R]``) transposed into the aligned layout
    ``[R, aligned_width(T, E, align)]`` of [Note: aligned token groups], and its int32 end offsets. ``offs_E``:
    non-decreasing int32 ``[E]`` group end offsets on ``data``'s device; ``align``: a multiple of 16 (TMA)."""
    _check_data("transpose_aligned", data)
    _check_layout_args("transpose_aligned", data.device, offs_E, align)
    ends, table = aligned_offsets(offs_E, data.shape[0], align)
    return call(torch.ops.distwgrad.fp8_transpose_aligned, _impl, data, ends, table, align), ends
