"""FP8 quantization of a GroupedLinear's experts into the layout the GEMM reads: per tensor in two launches
(one for a packed ``[E, N, K]`` weight whose amax the caller has), blockwise in one.

[Note: a group of weights in two launches]
Quantized one by one, E experts cost E amax passes, E casts and a stacking copy, more than the GEMMs of a
per-tensor FP8 step. Here one launch takes every expert's amax (experts found through a table of their
addresses, so separate parameters need no stacking) and one casts them all into ONE stacked buffer, ``[E, N,
K]`` for fprop or ``[E, K, N]`` for dgrad (one ``QuantizedExperts``). Each expert's bits are those of
``distwgrad.fp8.weights.quantize_weight`` on it alone.

[Note: aligned table entries]
Triton assumes nothing of an address loaded from the table and loads one 4-byte element per instruction.
When every address is a multiple of 16 bytes (a view at an offset may not be), the kernels are told so
(``ALIGNED``) and vectorize the loads; the arithmetic is the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ._host import cdiv, device_table
from ._launch import launch
from ._quantize_kernels import _amax_into, _inverse, _quantize_blocks_kernel, _scale_from_amax, _to_fp8_bits
from ._tuning import current as _tuning
from .quantize import _check_block, _check_input, _fmt_args

__all__ = ["quantize_weights_per_tensor", "group_amax", "quantize_packed_per_tensor", "quantize_experts_blockwise"]

_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _expert_ptr(table_ptr, e, X_TY: tl.constexpr, ALIGNED: tl.constexpr):
    """Expert e's address from the table, as a pointer to X_TY. [Note: aligned table entries]"""
    x_ptr = tl.load(table_ptr + e).to(tl.pointer_type(X_TY))
    if ALIGNED:
        x_ptr = tl.multiple_of(x_ptr, 16)
    return x_ptr


@triton.jit
def _amax_group_kernel(table_ptr, amax_ptr, n, X_TY: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """amax[e] = max |w_e| (+inf for a NaN or inf) over expert e's n elements, programs (chunk, e)."""
    e = tl.program_id(1)
    x_ptr = _expert_ptr(table_ptr, e, X_TY, ALIGNED)
    _amax_into(x_ptr, amax_ptr + e, n, tl.program_id(0), tl.num_programs(0), BLOCK)


@triton.jit
def _cast_group_kernel(table_ptr, amax_ptr, q_ptr, s_inv_ptr, N, K, X_TY: tl.constexpr, NUM: tl.constexpr,
                       FP8: tl.constexpr, FP8_MAX: tl.constexpr, MANT: tl.constexpr, EMIN_BIASED: tl.constexpr,
                       HW_CAST: tl.constexpr, ALIGNED: tl.constexpr, TRANSPOSE: tl.constexpr, BLOCK: tl.constexpr,
                       TILE: tl.constexpr, PACKED: tl.constexpr = False):
    """q[e] = fp8(w_e * scale_e), scale_e from amax[e]; [N, K] as w_e, or [K, N] with TRANSPOSE. PACKED:
    ``table_ptr`` is the packed ``[E, N, K]`` weight itself and every expert's scale comes from amax[0]."""
    pid = tl.program_id(0)
    e = tl.program_id(1)
    if PACKED:
        x_ptr = table_ptr + e.to(tl.int64) * N * K
        scale = _scale_from_amax(tl.load(amax_ptr), NUM, False)
    else:
        x_ptr = _expert_ptr(table_ptr, e, X_TY, ALIGNED)
        scale = _scale_from_amax(tl.load(amax_ptr + e), NUM, False)
    q_e = q_ptr + e.to(tl.int64) * N * K
    if TRANSPOSE:
        tiles_k = tl.cdiv(K, TILE)
        rows = (pid // tiles_k) * TILE + tl.arange(0, TILE)
        cols = (pid % tiles_k) * TILE + tl.arange(0, TILE)
        mask = (rows < N)[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        q = _to_fp8_bits(x * scale, FP8, FP8_MAX, MANT, EMIN_BIASED, HW_CAST)
        tl.store(q_e + cols.to(tl.int64)[:, None] * N + rows[None, :], tl.trans(q), mask=tl.trans(mask))
    else:
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < N * K, other=0.0).to(tl.float32)
        tl.store(q_e + offs, _to_fp8_bits(x * scale, FP8, FP8_MAX, MANT, EMIN_BIASED, HW_CAST), mask=offs < N * K)
    if pid == 0:
        tl.store(s_inv_ptr + e, _inverse(scale, False))


def _first_unlike(weights: Sequence[torch.Tensor]) -> int | None:
    """Index of the first weight that is not a contiguous tensor of weights[0]'s shape, dtype and device, or None."""
    w0 = weights[0]
    shape, dtype, device = w0.shape, w0.dtype, w0.device
    for i, w in enumerate(weights):
        if not (isinstance(w, torch.Tensor) and w.shape == shape and w.dtype == dtype and w.device == device
                and w.is_contiguous()):
            return i
    return None


def _check_weights(weights: Sequence[torch.Tensor]) -> None:
    """Checks weights[0] as any kernel input and the others alike; raises naming the first that is not."""
    if not weights:
        raise ValueError("quantize_weights_per_tensor: no weights")
    w0 = weights[0]
    _check_input(w0, two_d=True)
    i = _first_unlike(weights)
    if i is not None:
        w = weights[i]
        _check_input(w, two_d=True)
        raise ValueError(f"quantize_weights_per_tensor: weights[{i}] is {w.dtype} {tuple(w.shape)} on "
                         f"{w.device}, weights[0] {w0.dtype} {tuple(w0.shape)} on {w0.device}")


def group_amax(weights: Sequence[torch.Tensor], shared: Sequence[int] | None = None) -> torch.Tensor:
    """fp32 ``[E]``: each weight's ``max |w|`` (+inf for NaN or inf), in one launch; ``shared`` as below."""
    _check_weights(weights)
    ptrs = tuple(w.data_ptr() for w in weights)
    return _group_amax(weights, _on_device(ptrs, weights[0].device), _aligned(ptrs), shared)


def _aligned(ptrs: tuple[int, ...]) -> bool:
    """Whether every address is a multiple of 16 bytes. [Note: aligned table entries]"""
    return all(p % 16 == 0 for p in ptrs)


def _group_amax(weights: Sequence[torch.Tensor], table: torch.Tensor, aligned: bool,
                shared: Sequence[int] | None) -> torch.Tensor:
    """:func:`group_amax` of checked ``weights`` whose addresses ``table`` holds (``aligned``: all 16-byte)."""
    w0, E = weights[0], len(weights)
    n = w0.numel()
    amax = torch.zeros(E, dtype=torch.float32, device=w0.device)
    if n:
        t = _tuning().quantize
        chunks = max(1, min(cdiv(n, t.per_tensor_block), t.amax_max_programs // E))
        launch(_amax_group_kernel, (chunks, E), table, amax, n, X_TY=_TL[w0.dtype], ALIGNED=aligned,
               BLOCK=t.per_tensor_block, num_warps=t.per_tensor_warps)
    if shared is not None and len(set(shared)) < E:
        if len(shared) != E:
            raise ValueError(f"quantize_weights_per_tensor: shared has {len(shared)} entries for {E} weights")
        idx = _on_device(tuple(shared), w0.device)
        amax = torch.zeros(max(shared) + 1, dtype=torch.float32, device=w0.device).scatter_reduce_(
            0, idx, amax, "amax")[idx]
    return amax


def quantize_weights_per_tensor(weights: Sequence[torch.Tensor], dtype: torch.dtype, *, margin: int = 0,
                                transpose: bool = False, shared: Sequence[int] | None = None,
                                amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(data, scale_inv, amax)``: alike contiguous ``[N, K]`` weights quantized per tensor into one float8
    ``[E, N, K]`` ([Note: a group of weights in two launches]), stored ``[E, K, N]`` with ``transpose`` (dgrad's
    layout; ``data`` is the ``[E, N, K]`` view either way). ``shared``: weight e takes the max amax over weights
    of number ``shared[e]`` (a packed parameter's experts share a scale). ``amax``: their ``group_amax``, if known."""
    _check_weights(weights)
    return _quantize(weights, dtype, margin, transpose, shared, amax)


def _quantize_alike(weights: Sequence[torch.Tensor], dtype: torch.dtype, *, margin: int = 0, transpose: bool = False,
                    shared: Sequence[int] | None = None, amax: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`quantize_weights_per_tensor` if the weights are alike, else None (the caller quantizes each)."""
    if not weights:
        return None
    _check_input(weights[0], two_d=True)
    if _first_unlike(weights) is not None:
        return None
    return _quantize(weights, dtype, margin, transpose, shared, amax)


def _quantize(weights, dtype, margin, transpose, shared, amax) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_weights_per_tensor` of checked ``weights``."""
    w0 = weights[0]
    E, (N, K) = len(weights), w0.shape
    fmt = _fmt_args(dtype, margin)
    ptrs = tuple(w.data_ptr() for w in weights)
    table, aligned = _on_device(ptrs, w0.device), _aligned(ptrs)
    if amax is None:
        amax = _group_amax(weights, table, aligned, shared)
    elif tuple(amax.shape) != (E,) or amax.dtype != torch.float32 or amax.device != w0.device:
        raise ValueError(f"quantize_weights_per_tensor: amax must be fp32 [{E}] on {w0.device}, got "
                         f"{amax.dtype} {tuple(amax.shape)} on {amax.device}")
    data = torch.empty((E, K, N) if transpose else (E, N, K), dtype=dtype, device=w0.device)
    s_inv = torch.empty(E, dtype=torch.float32, device=w0.device)
    n = N * K
    t = _tuning().quantize
    tile = t.weights_tile  # the transposing cast's [tile, tile] tiles
    programs = cdiv(N, tile) * cdiv(K, tile) if transpose else cdiv(n, t.per_tensor_block)
    launch(_cast_group_kernel, (max(programs, 1), E), table, amax, data.view(torch.uint8), s_inv, N, K,
           X_TY=_TL[w0.dtype], ALIGNED=aligned, TRANSPOSE=transpose, BLOCK=t.per_tensor_block, TILE=tile,
           num_warps=t.per_tensor_warps, **fmt)
    return data.transpose(1, 2) if transpose else data, s_inv, amax


def quantize_packed_per_tensor(w_ENK: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor, *, margin: int = 0,
                               transpose: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale_inv)``: a contiguous packed ``[E, N, K]`` weight quantized per tensor with its one fp32
    ``amax``, in one launch, as :func:`quantize_weights_per_tensor` with that amax for every expert."""
    _check_input(w_ENK, two_d=False)
    if w_ENK.dim() != 3:
        raise ValueError(f"quantize_packed_per_tensor: a packed [E, N, K] weight, got shape {tuple(w_ENK.shape)}")
    if amax.numel() != 1 or amax.dtype != torch.float32 or amax.device != w_ENK.device:
        raise ValueError(f"quantize_packed_per_tensor: amax must be one fp32 value on {w_ENK.device}, got "
                         f"{amax.dtype} {tuple(amax.shape)} on {amax.device}")
    E, N, K = w_ENK.shape
    data = torch.empty((E, K, N) if transpose else (E, N, K), dtype=dtype, device=w_ENK.device)
    s_inv = torch.empty(E, dtype=torch.float32, device=w_ENK.device)
    t = _tuning().quantize
    tile = t.weights_tile
    programs = cdiv(N, tile) * cdiv(K, tile) if transpose else cdiv(N * K, t.per_tensor_block)
    if E:
        launch(_cast_group_kernel, (max(programs, 1), E), w_ENK, amax, data.view(torch.uint8), s_inv, N, K,
               X_TY=_TL[w_ENK.dtype], ALIGNED=True, TRANSPOSE=transpose,
               BLOCK=t.per_tensor_block, TILE=tile, PACKED=True,
               num_warps=t.per_tensor_warps, **_fmt_args(dtype, margin))
    return data.transpose(1, 2) if transpose else data, s_inv


def quantize_experts_blockwise(w_ENK: torch.Tensor, block: tuple[int, int], dtype: torch.dtype, *,
                               power_of_two: bool = True, transpose: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale_inv)``: a packed ``[E, N, K]`` weight (N a multiple of B) in square ``block`` B x B blocks,
    in one launch, each expert's bits those of ``quantize_blockwise`` on it alone; ``transpose`` as above.
    ``scale_inv``: fp32 ``[E, N / B, cdiv(K, B)]`` for both layouts (square blocks transpose with their scale)."""
    _check_input(w_ENK, two_d=False)
    bm, bn = _check_block(block)
    if w_ENK.dim() != 3 or bm != bn or w_ENK.shape[1] % bm:
        raise ValueError(f"quantize_experts_blockwise: a [E, N, K] weight with N a multiple of a square block's "
                         f"side, got shape {tuple(w_ENK.shape)} and block {tuple(block)}")
    E, N, K = w_ENK.shape
    data = torch.empty((E, K, N) if transpose else (E, N, K), dtype=dtype, device=w_ENK.device)
    grid = (E * N // bm, cdiv(K, bn))
    s_inv = torch.empty(E, N // bm, grid[1], dtype=torch.float32, device=w_ENK.device)
    if data.numel():
        launch(_quantize_blocks_kernel, grid, w_ENK, data.view(torch.uint8), s_inv, E * N, K, N, POW2=power_of_two,
               TRANSPOSE=transpose, BLOCK_M=bm, BLOCK_N=bn,
               num_warps=_tuning().quantize.blocks_warps, **_fmt_args(dtype))
    return data.transpose(1, 2) if transpose else data, s_inv


def _on_device(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 table on ``device``, made once ([Note: device tables] in ``_host.py``)."""
    return device_table(values, device, "quantize_weights_per_tensor")
