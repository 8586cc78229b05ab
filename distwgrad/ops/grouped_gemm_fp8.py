"""The FP8 grouped GEMMs the modules call under an FP8 recipe: Triton on CUDA, emulation elsewhere.

Legend as in ``distwgrad.ops.grouped_gemm``; ``Linear`` is one group. ``w_qs``: E per-expert ``[N, K]``
``Quantized`` or one ``QuantizedExperts`` (``distwgrad.fp8.weights``).

    grouped_fprop_fp8(x_q, w_qs, offs_E, bias_EN, out_dtype)   y_TN[g]   = deq(x)[g] @ deq(w_e)^T (+ b_e)
    grouped_dgrad_fp8(dy_q, w_qs, offs_E, out_dtype)           dx_TK[g]  = deq(dy)[g] @ deq(w_e)
    grouped_wgrad_fp8(dy_qt, x_qt, offs_E, out=None, out_dtype) dW_ENK[e] = deq(dy)[g]^T @ deq(x)[g]

``split_accumulator`` (the recipe's ``MMParams``) reaches the kernels; ``kernel_grouped_*_fp8`` call them alone.

[Note: fp8 gemm dispatch]
Operands are quantized once, by the Triton kernels on CUDA and the torch reference elsewhere: the same bits
on every device. The products run in the FP8 Triton kernels on CUDA when these accept the operands
(per-tensor scales, or 1xL tiles with LxL weight blocks, L >= 32), else by EMULATION: dequantize, then the
fp32 GEMM of ``distwgrad.ops.grouped_gemm``. The two differ only in the order of fp32 sums and in Hopper's
fp8 accumulation, which ``distwgrad.testing.reference_fp8.error_bound`` bounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from distwgrad.fp8 import quantize as reference_quantize
from distwgrad.fp8.emulate import dequantize_weights
from distwgrad.fp8.quantize import Quantized, QuantizedExperts, dequantize
from distwgrad.fp8.recipes import PerTensorScaling, Recipe
from distwgrad.ops import grouped_gemm as gg

__all__ = ["quantize_operand", "grouped_fprop_fp8", "grouped_dgrad_fp8", "grouped_wgrad_fp8", "align_token_groups",
           "align_wgrad", "wgrad_offsets", "kernel_grouped_fprop_fp8", "kernel_grouped_dgrad_fp8",
           "kernel_grouped_wgrad_fp8", "fp8_kernels_accept", "saved_tensors", "saved_meta", "from_saved"]


# The grouped modules lay the per-tensor wgrad operands out with each token group on the 128-token grid
# ([Note: aligned token groups] in kernels/token_layout.py) where the groups average this many tokens or
# more: the padding then adds at most 127 / ALIGN_MIN_TOKENS of the wgrad's MMAs on average.
ALIGN_MIN_TOKENS = 512
ALIGN = 128  # the FP8 wgrad's chunk: the 1xL tile of the blockwise recipe, 128 tokens per-tensor


def align_wgrad(x_TK: torch.Tensor, recipe: Recipe | None, num_groups: int) -> bool:
    """Whether a grouped module's FP8 wgrad operands take the aligned layout: per-tensor scaling on the
    kernels, two groups or more, ``ALIGN_MIN_TOKENS`` tokens per group on average (shapes only: no sync)."""
    return (recipe is not None and recipe.family == "per_tensor" and num_groups > 1
            and x_TK.shape[0] >= ALIGN_MIN_TOKENS * num_groups and gg.kernels_available(x_TK))


def _aligned_groups(offs_E: torch.Tensor, num_tokens: int, align: int) -> tuple[torch.Tensor, ...]:
    """Per group: its end, size, size padded to ``align`` and aligned end (int64; ``offs_E`` clamped to the tokens)."""
    ends = offs_E.long().clamp(0, num_tokens)
    sizes = (ends - torch.cat([ends.new_zeros(1), ends[:-1]])).clamp_min(0)
    padded = -(-sizes // align) * align
    return ends, sizes, padded, padded.cumsum(0)


def wgrad_offsets(offs_E: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The int32 end offsets of the aligned layout ([Note: aligned token groups]) of ``num_tokens`` tokens in groups
    ending at ``offs_E``; on the kernels, computed once per routing ([Note: one layout per routing])."""
    if gg.kernels_available(offs_E):
        from distwgrad.kernels import token_layout as kt
        return kt.aligned_offsets(offs_E, num_tokens, ALIGN)[0]
    return _aligned_groups(offs_E, num_tokens, ALIGN)[3].to(torch.int32)


def quantize_operand(x_MK: torch.Tensor, recipe: Recipe, *, grad: bool,
                     aligned_offs: torch.Tensor | None = None) -> tuple[Quantized, Quantized]:
    """``(q, q_t)``: ``x`` quantized along its rows and ``x^T`` along the tokens, in one read on CUDA; the same bits
    on every device. ``aligned_offs`` (per-tensor only): lay ``q_t`` out aligned ([Note: aligned token groups]);
    the wgrad then takes ``wgrad_offsets(aligned_offs, T)``."""
    if aligned_offs is not None:
        if recipe.family != "per_tensor":
            raise ValueError(f"quantize_operand: the aligned layout is for per-tensor scaling, got {recipe!r}")
        if gg.kernels_available(x_MK):
            from distwgrad.kernels.cast_transpose import cast_transpose_per_tensor
            data, scale_inv, data_t, _ = cast_transpose_per_tensor(
                x_MK.contiguous(), recipe.dtype_for(grad=grad), margin=cast(PerTensorScaling, recipe).margin,
                offs_E=aligned_offs, align=ALIGN)
            return (Quantized(data, scale_inv, None, x_MK.dtype, data.shape),
                    Quantized(data_t, scale_inv, None, x_MK.dtype, data_t.shape))
        q, q_t = reference_quantize.quantize_rowwise_and_columnwise(x_MK, recipe, grad=grad)
        return q, align_token_groups(q_t, aligned_offs, ALIGN)[0]
    if recipe.family is not None and gg.kernels_available(x_MK):  # a family the kernels implement
        from distwgrad.ops import quantize as kq
        return kq.quantize_rowwise_and_columnwise(x_MK.contiguous(), recipe, grad=grad)
    return reference_quantize.quantize_rowwise_and_columnwise(x_MK, recipe, grad=grad)


def saved_tensors(q: Quantized) -> tuple[torch.Tensor, torch.Tensor]:
    """``q``'s tensors for ``ctx.save_for_backward`` (the rest: :func:`saved_meta`). The modules save x^T
    quantized, which wgrad reads, so backward never quantizes x again."""
    return q.data, q.scale_inv


def saved_meta(q: Quantized) -> tuple:
    return q.block, q.orig_dtype, q.shape


def from_saved(tensors: Sequence[torch.Tensor], meta: tuple) -> Quantized:
    data, scale_inv = tensors
    return Quantized(data, scale_inv, *meta)


def _act_block(q: Quantized) -> int | None:
    """L of 1xL tiles, 0 for per-tensor, None for anything else."""
    if q.block is None:
        return 0
    return q.block[1] if q.block[0] == 1 else None


def fp8_kernels_accept(act_qs: Sequence[Quantized], w_qs: Sequence[Quantized] | QuantizedExperts = ()) -> bool:
    """True when the FP8 kernels run these operands: all on CUDA (or the CPU testing route), one
    recipe (all per-tensor, or 1xL tiles with L >= 32 and LxL weight blocks), 2-D weights."""
    if not gg.kernels_available(act_qs[0].data):
        return False
    blocks = {_act_block(q) for q in act_qs}
    if len(blocks) != 1:
        return False
    L = blocks.pop()
    if L is None or (L and L < 32):
        return False
    want = (L, L) if L else None
    if isinstance(w_qs, QuantizedExperts):
        return w_qs.block == want
    return all(q.block == want and len(q.shape) == 2 for q in w_qs)


def align_token_groups(q_t: Quantized, offs_E: torch.Tensor, align: int = 128) -> tuple[Quantized, torch.Tensor]:
    """``(q_t', offs')``: per-tensor ``q_t`` ``[R, T]`` with each group's tokens moved to start on a multiple of
    ``align`` (zeros between) and that layout's end offsets, so no ``align``-token chunk of the FP8 wgrad holds two
    groups ([Note: fp8 wgrad chunks]); only the order of fp32 sums moves. Offsets must be non-decreasing. No host
    sync: the width is ``T + (align - 1) * E + 1`` rounded up to ``align``."""
    if q_t.block is not None:
        raise ValueError(f"align_token_groups: per-tensor operands only (a 1xL tile's scale covers L tokens of "
                         f"the global grid), got block {q_t.block}")
    if q_t.data.dim() != 2 or offs_E.dim() != 1:
        raise ValueError(f"align_token_groups: q_t must be [R, T] and offs_E [E], got {tuple(q_t.data.shape)} and "
                         f"{tuple(offs_E.shape)}")
    R, T = q_t.data.shape
    E = offs_E.numel()
    width = -(-(T + (align - 1) * E + 1) // align) * align  # its last column lies past every group
    ends, sizes, padded, offs = _aligned_groups(offs_E, T, align)
    # token t of group e moves by (group e's new start) - (its old start); unrouted tokens (past the last
    # offset) to the last column, zeroed after
    tokens = torch.arange(T, device=ends.device)
    group = torch.searchsorted(ends, tokens, right=True)
    shift = ((offs - padded) - (ends - sizes))[group.clamp_max(E - 1)] if E else tokens
    dest = torch.where(group < E, tokens + shift, width - 1)
    out = torch.zeros(R, width, dtype=torch.uint8, device=q_t.data.device)
    out.index_copy_(1, dest, q_t.data.view(torch.uint8))
    out[:, width - 1] = 0
    data = out.view(q_t.data.dtype)
    return Quantized(data, q_t.scale_inv, q_t.block, q_t.orig_dtype, data.shape), offs.to(torch.int32)


def _emulated_weights(w_qs: Sequence[Quantized] | QuantizedExperts) -> torch.Tensor:
    if isinstance(w_qs, QuantizedExperts) and w_qs.block is None:  # fp32(data) * scale_inv, as dequantize
        return w_qs.data.float() * w_qs.scale_inv[:, None, None]
    if isinstance(w_qs, QuantizedExperts):
        w_qs = w_qs.unbind()
    return dequantize_weights(list(w_qs), packed=True)


def _contraction_contiguous(w_qs: Sequence[Quantized] | QuantizedExperts) -> tuple[torch.Tensor, torch.Tensor]:
    """The stacked dgrad weights stored ``[E, K, N]`` (N contiguous), as the ``[E, N, K]`` view the kernel takes:
    Hopper's fp8 MMA reads B only K-major, and one transposing copy beats transposing every tile in registers. A
    ``QuantizedExperts`` already so laid out ([Note: a group of weights in two launches]) is read in place."""
    if isinstance(w_qs, QuantizedExperts):
        data = w_qs.data
        return (data if data.stride(1) == 1 else data.transpose(1, 2).contiguous().transpose(1, 2)), w_qs.scale_inv
    data = torch.stack([q.data.t() for q in w_qs]).transpose(1, 2)
    return data, torch.stack([q.scale_inv for q in w_qs])


def grouped_fprop_fp8(x_q: Quantized, w_qs: Sequence[Quantized] | QuantizedExperts, offs_E: torch.Tensor,
                      bias_EN: torch.Tensor | None, out_dtype: torch.dtype, *,
                      split_accumulator: bool = True) -> torch.Tensor:
    """``y_TN`` in ``out_dtype`` (bias added in fp32); see the module docstring."""
    if fp8_kernels_accept([x_q], w_qs):
        w = list(w_qs) if not isinstance(w_qs, QuantizedExperts) else (  # K contiguous, as fprop reads it
            w_qs.data if w_qs.data.stride(2) == 1 else w_qs.data.contiguous(), w_qs.scale_inv)
        return kernel_grouped_fprop_fp8(x_q, w, offs_E, bias_EN, out_dtype, split_accumulator=split_accumulator)
    x_TK = dequantize(x_q, dtype=torch.float32)
    bias = None if bias_EN is None else bias_EN.float()
    return gg.grouped_fprop(x_TK, _emulated_weights(w_qs), offs_E, bias).to(out_dtype)


def grouped_dgrad_fp8(dy_q: Quantized, w_qs: Sequence[Quantized] | QuantizedExperts, offs_E: torch.Tensor,
                      out_dtype: torch.dtype, *, split_accumulator: bool = True) -> torch.Tensor:
    """``dx_TK`` in ``out_dtype``; see the module docstring."""
    if fp8_kernels_accept([dy_q], w_qs):
        return kernel_grouped_dgrad_fp8(dy_q, _contraction_contiguous(w_qs), offs_E, out_dtype,
                                        split_accumulator=split_accumulator)
    dy_TN = dequantize(dy_q, dtype=torch.float32)
    return gg.grouped_dgrad(dy_TN, _emulated_weights(w_qs), offs_E).to(out_dtype)


def grouped_wgrad_fp8(dy_qt: Quantized, x_qt: Quantized, offs_E: torch.Tensor, *,
                      out: torch.Tensor | Sequence[torch.Tensor] | None = None, split_accumulator: bool = True,
                      out_dtype: torch.dtype = torch.float32, first: torch.Tensor | None = None):
    """A fresh ``[E, N, K]`` in ``out_dtype``, or the product ADDED into ``out`` (fp32 ``[E, N, K]`` or E ``[N, K]``).
    ``first``: as in ``grouped_gemm.grouped_wgrad`` ([Note: an unwritten accumulator])."""
    if out is not None and out_dtype != torch.float32:
        raise ValueError(f"grouped_wgrad_fp8: out_dtype={out_dtype} is a fresh output's dtype; pass out (added "
                         f"into) or out_dtype, not both")
    if first is not None:
        if out is None:
            raise ValueError("grouped_wgrad_fp8: first= flags an output to add into; pass out as well")
        if fp8_kernels_accept([dy_qt, x_qt]) and gg.all_fp32(out):
            return kernel_grouped_wgrad_fp8(dy_qt, x_qt, offs_E, out=out, split_accumulator=split_accumulator,
                                            first=first)
        from distwgrad.weights.first_write import zero_where_flagged
        zero_where_flagged(out, first)
    if fp8_kernels_accept([dy_qt, x_qt]):
        split = split_accumulator
        if out is not None and not gg.all_fp32(out):  # the fused add is into fp32 only
            return gg.add_per_group(out, kernel_grouped_wgrad_fp8(dy_qt, x_qt, offs_E, split_accumulator=split))
        if out is None:
            return kernel_grouped_wgrad_fp8(dy_qt, x_qt, offs_E, out_dtype=out_dtype, split_accumulator=split)
        return kernel_grouped_wgrad_fp8(dy_qt, x_qt, offs_E, out=out, split_accumulator=split)
    dy_TN = dequantize(dy_qt, dtype=torch.float32).t().contiguous()
    x_TK = dequantize(x_qt, dtype=torch.float32).t().contiguous()
    if out is None:
        return gg.grouped_wgrad(dy_TN, x_TK, offs_E).to(out_dtype)
    return gg.grouped_wgrad(dy_TN, x_TK, offs_E, out=out)


# ---- the FP8 kernels on Quantized operands: unpacked into data, scales and the recipe's block L ----


def _act(op: str, name: str, q) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(data, scale_inv, L) of an activation/gradient ``Quantized``; L = 0 for per-tensor."""
    if not isinstance(q, Quantized):
        raise TypeError(f"{op}: {name} must be a distwgrad.fp8.quantize.Quantized, got {type(q).__name__}")
    if q.block is None:
        return q.data, q.scale_inv, 0
    if q.block[0] != 1:
        raise ValueError(f"{op}: {name} must be quantized per tensor or in 1xL tiles along its last dim, "
                         f"got block {q.block}")
    return q.data, q.scale_inv, q.block[1]


def _weights(op: str, w_qs, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_ENK, scale_inv) from a sequence of per-expert ``Quantized`` or a (data, scale_inv) tuple."""
    if isinstance(w_qs, tuple) and len(w_qs) == 2 and all(isinstance(t, torch.Tensor) for t in w_qs):
        return w_qs
    if isinstance(w_qs, (Quantized, torch.Tensor)) or not isinstance(w_qs, Sequence) or len(w_qs) == 0:
        raise TypeError(f"{op}: w_qs must be a non-empty sequence of per-expert Quantized or a (w_ENK, "
                        f"scale_inv) tuple of tensors, got {type(w_qs).__name__}")
    want = (block, block) if block else None
    for i, q in enumerate(w_qs):
        if not isinstance(q, Quantized):
            raise TypeError(f"{op}: w_qs[{i}] must be a Quantized, got {type(q).__name__}")
        if q.block != want or len(q.shape) != 2:
            raise ValueError(f"{op}: w_qs[{i}] has block {q.block} and shape {tuple(q.shape)}; with "
                             f"{'per-tensor' if not block else f'1x{block}'} activations every expert must be a "
                             f"2-D weight quantized {'per tensor' if not block else f'in {block}x{block} blocks'}")
    if len(w_qs) == 1:  # one weight (a Linear's): a one-expert view, no copy
        return w_qs[0].data.unsqueeze(0), w_qs[0].scale_inv.unsqueeze(0)
    return torch.stack([q.data for q in w_qs]), torch.stack([q.scale_inv for q in w_qs])


def kernel_grouped_fprop_fp8(x_q: Quantized, w_qs, offs_E: torch.Tensor, bias_EN: torch.Tensor | None = None,
                             out_dtype: torch.dtype = torch.bfloat16, *,
                             split_accumulator: bool = True) -> torch.Tensor:
    """``kernels.grouped_gemm_fp8.grouped_fprop_fp8`` on ``x_q`` ``[T, K]`` (per tensor or 1xL tiles) and ``w_qs``:
    E ``[N, K]`` ``Quantized`` (stacked here) or ``(w_ENK, scale_inv)``, scale_inv ``[E]`` or
    ``[E, cdiv(N, L), cdiv(K, L)]``."""
    from distwgrad.kernels import grouped_gemm_fp8 as k
    x, x_s, block = _act("grouped_fprop_fp8", "x_q", x_q)
    w, w_s = _weights("grouped_fprop_fp8", w_qs, block)
    return k.grouped_fprop_fp8(x, x_s, w, w_s, offs_E, bias_EN, out_dtype, block=block,
                               split_accumulator=split_accumulator)


def kernel_grouped_dgrad_fp8(dy_q: Quantized, w_qs, offs_E: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                             *, split_accumulator: bool = True) -> torch.Tensor:
    """``kernels.grouped_gemm_fp8.grouped_dgrad_fp8`` on ``dy_q`` ``[T, N]`` (per tensor or 1xL tiles) and weights
    as in :func:`kernel_grouped_fprop_fp8`."""
    from distwgrad.kernels import grouped_gemm_fp8 as k
    dy, dy_s, block = _act("grouped_dgrad_fp8", "dy_q", dy_q)
    w, w_s = _weights("grouped_dgrad_fp8", w_qs, block)
    return k.grouped_dgrad_fp8(dy, dy_s, w, w_s, offs_E, out_dtype, block=block, split_accumulator=split_accumulator)


def kernel_grouped_wgrad_fp8(dy_qt: Quantized, x_qt: Quantized, offs_E: torch.Tensor,
                             out: torch.Tensor | Sequence[torch.Tensor] | None = None, *,
                             split_accumulator: bool = True, out_dtype: torch.dtype | None = None,
                             first: torch.Tensor | None = None):
    """``kernels.grouped_gemm_fp8.grouped_wgrad_fp8`` on the TRANSPOSED ``dy_qt`` ``[N, T]`` and ``x_qt`` ``[K, T]``
    (``quantize_rowwise_and_columnwise(...)[1]``); ``out``, ``out_dtype`` and ``first`` as there."""
    from distwgrad.kernels import grouped_gemm_fp8 as k
    dy_t, dy_s, block = _act("grouped_wgrad_fp8", "dy_qt", dy_qt)
    x_t, x_s, x_block = _act("grouped_wgrad_fp8", "x_qt", x_qt)
    if x_block != block:
        raise ValueError(f"grouped_wgrad_fp8: dy_qt and x_qt must share one recipe, got blocks {dy_qt.block} "
                         f"and {x_qt.block}")
    return k.grouped_wgrad_fp8(dy_t, dy_s, x_t, x_s, offs_E, out, block=block, split_accumulator=split_accumulator,
                               out_dtype=out_dtype, first=first)
