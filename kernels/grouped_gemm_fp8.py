"""FP8 grouped GEMMs for MoE: the three products over ragged token groups, scales applied in the kernel.

Legend: E experts (groups), T tokens, K in-features, N out-features, L the scale block (128); ``offs_E`` as
in ``grouped_gemm`` (int32 end offsets, read on the device only).

    fprop  y_TN[g]   = deq(x_TK)[g] @ deq(w_ENK[e])^T (+ bias_EN[e])
    dgrad  dx_TK[g]  = deq(dy_TN)[g] @ deq(w_ENK[e])
    wgrad  dW_ENK[e] = deq(dy^T_NT)[:, g] @ deq(x^T_KT)[:, g]^T

Scales (``block`` = L, or 0 for per-tensor; one recipe per call): per tensor, or DeepSeek-V3's 1xL tiles
along the contraction for activations and gradients (for wgrad along the tokens of dy^T and x^T) with LxL
weight blocks, square so that dgrad's transposed use is exact. Per-row ``(1, 128)`` weight scales are the
dispatcher's to emulate ([Note: fp8 gemm dispatch]). Products are exact in fp32, partial sums promoted
every L products ([Note: fp8 split accumulator]); wgrad chunks follow the global L grid ([Note: fp8 wgrad
chunks]), so a chunk has one scale per row even where a token tile spans two groups. NaN scales propagate.
On Hopper, Gluon kernels with the same bits take over where they apply ([Note: promotion under the next
MMA], [Note: fp8 wgrad under the next MMA]; tuning: [Note: kernel tuning]).

Interpreter (TRITON_INTERPRET=1): fp8 operands are upcast to fp32 (its fp8 ``tl.dot`` gets e5m2 subnormals
wrong); its fp8 -> fp32 cast maps NaN/inf to finite values, its bf16 stores truncate (pinned in the tests).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._dispatch import call
from ._grouped_gemm_fp8_checks import _check_ragged, _check_split, _check_wgrad
from ._grouped_gemm_fp8_launch import _dgrad, _fprop, _wgrad

__all__ = ["grouped_fprop_fp8", "grouped_dgrad_fp8", "grouped_wgrad_fp8"]


# [Note: fp8 wgrad edges]
# A wgrad chunk that straddles a group edge must zero the other group's tokens in registers: a TMA box
# cannot stop at a group's end, and its token offset must be 16-byte aligned ([Note: fp8 wgrad chunks]).
# The TMA path runs masked head and tail chunks around an unmasked pipelined loop over the full chunks
# (masking inside the loop ran slower: docs/benchmarks/LOG.md).

# [Note: fp8 wgrad chunks]
# The wgrad contracts each group's tokens in 128-token chunks (the promotion interval) on the global
# 128-token grid and adds the chunks' partial sums in token order, in every path of every kernel (Gluon
# included), so all give the same bits (``_case_wgrad_chunks`` pins the order). Why: docs/benchmarks/LOG.md.

# [Note: fp8 split accumulator]
# Hopper's fp8 tensor cores accumulate with ~13 mantissa bits (DeepSeek-V3 report, Sec. 3.3.2).
# ``split_accumulator=True`` (every default here) starts a fresh partial sum every BLOCK_K = 128 products
# and adds it to an fp32 accumulator (``max_num_imprecise_acc=BLOCK_K``); False accumulates the whole
# contraction in the tensor cores: wider tiles, an error growing with depth. Blockwise always splits; CPU
# paths are exact fp32 either way. The recipe's per-GEMM knobs (TransformerEngine's): docs/fp8.md.


# ---------------------------------------------------------------------------------------------------
# torch.library custom ops (+ fake implementations) and the public API
# ---------------------------------------------------------------------------------------------------


def _fprop_impl(x: torch.Tensor, x_scale_inv: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                offs_E: torch.Tensor, bias_EN: torch.Tensor | None, block: int, out_dtype: torch.dtype,
                split_accumulator: bool = True) -> torch.Tensor:
    return _fprop(x, x_scale_inv, w, w_scale_inv, offs_E, bias_EN, block, out_dtype,
                  split_accumulator=split_accumulator)


_fprop_op = torch.library.custom_op("distwgrad::grouped_fprop_fp8", _fprop_impl, mutates_args=())


@_fprop_op.register_fake
def _(x, x_scale_inv, w, w_scale_inv, offs_E, bias_EN, block, out_dtype, split_accumulator=True):
    _check_ragged("grouped_fprop_fp8", x, x_scale_inv, w, w_scale_inv, offs_E, block, out_dtype, bias_EN)
    _check_split("grouped_fprop_fp8", block, split_accumulator)
    return x.new_empty(x.shape[0], w.shape[1], dtype=out_dtype)


def _dgrad_impl(dy: torch.Tensor, dy_scale_inv: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                offs_E: torch.Tensor, block: int, out_dtype: torch.dtype,
                split_accumulator: bool = True) -> torch.Tensor:
    return _dgrad(dy, dy_scale_inv, w, w_scale_inv, offs_E, block, out_dtype, split_accumulator=split_accumulator)


_dgrad_op = torch.library.custom_op("distwgrad::grouped_dgrad_fp8", _dgrad_impl, mutates_args=())


@_dgrad_op.register_fake
def _(dy, dy_scale_inv, w, w_scale_inv, offs_E, block, out_dtype, split_accumulator=True):
    _check_ragged("grouped_dgrad_fp8", dy, dy_scale_inv, w, w_scale_inv, offs_E, block, out_dtype)
    _check_split("grouped_dgrad_fp8", block, split_accumulator)
    return dy.new_empty(dy.shape[0], w.shape[2], dtype=out_dtype)


def _wgrad_impl(dy_t: torch.Tensor, dy_t_scale_inv: torch.Tensor, x_t: torch.Tensor, x_t_scale_inv: torch.Tensor,
                offs_E: torch.Tensor, block: int, out_dtype: torch.dtype,
                split_accumulator: bool = True) -> torch.Tensor:
    return _wgrad(dy_t, dy_t_scale_inv, x_t, x_t_scale_inv, offs_E, block, out_dtype=out_dtype,
                  split_accumulator=split_accumulator)


_wgrad_op = torch.library.custom_op("distwgrad::grouped_wgrad_fp8", _wgrad_impl, mutates_args=())


@_wgrad_op.register_fake
def _(dy_t, dy_t_scale_inv, x_t, x_t_scale_inv, offs_E, block, out_dtype, split_accumulator=True):
    _check_wgrad(dy_t, dy_t_scale_inv, x_t, x_t_scale_inv, offs_E, block, None, out_dtype)
    _check_split("grouped_wgrad_fp8", block, split_accumulator)
    return dy_t.new_empty(offs_E.shape[0], dy_t.shape[0], x_t.shape[0], dtype=out_dtype)


def _wgrad_acc_impl(dy_t: torch.Tensor, dy_t_scale_inv: torch.Tensor, x_t: torch.Tensor,
                    x_t_scale_inv: torch.Tensor, offs_E: torch.Tensor, block: int, out: torch.Tensor,
                    split_accumulator: bool = True, first: torch.Tensor | None = None) -> None:
    _wgrad(dy_t, dy_t_scale_inv, x_t, x_t_scale_inv, offs_E, block, out, split_accumulator=split_accumulator,
           first=first)


_wgrad_acc_op = torch.library.custom_op(
    "distwgrad::grouped_wgrad_fp8_accumulate", _wgrad_acc_impl, mutates_args=("out",))


@_wgrad_acc_op.register_fake
def _(dy_t, dy_t_scale_inv, x_t, x_t_scale_inv, offs_E, block, out, split_accumulator=True, first=None):
    _check_wgrad(dy_t, dy_t_scale_inv, x_t, x_t_scale_inv, offs_E, block, out, first=first)
    _check_split("grouped_wgrad_fp8", block, split_accumulator)


def _wgrad_acc_list_impl(dy_t: torch.Tensor, dy_t_scale_inv: torch.Tensor, x_t: torch.Tensor,
                         x_t_scale_inv: torch.Tensor, offs_E: torch.Tensor, block: int,
                         out: list[torch.Tensor], split_accumulator: bool = True,
                         first: torch.Tensor | None = None) -> None:
    _wgrad(dy_t, dy_t_scale_inv, x_t, x_t_scale_inv, offs_E, block, out, split_accumulator=split_accumulator,
           first=first)


_wgrad_acc_list_op = torch.library.custom_op(
    "distwgrad::grouped_wgrad_fp8_accumulate_list", _wgrad_acc_list_impl, mutates_args=("out",))


@_wgrad_acc_list_op.register_fake
def _(dy_t, dy_t_scale_inv, x_t, x_t_scale_inv, offs_E, block, out, split_accumulator=True, first=None):
    _check_wgrad(dy_t, dy_t_scale_inv, x_t, x_t_scale_inv, offs_E, block, out, first=first)
    _check_split("grouped_wgrad_fp8", block, split_accumulator)


# What the public functions below run in plain eager mode, after checking their arguments once ([Note: custom
# op bypass]); the ops' own implementations above check, for whoever calls an op directly.


def _fprop_checked(x, x_scale_inv, w, w_scale_inv, offs_E, bias_EN, block, out_dtype, split_accumulator):
    return _fprop(x, x_scale_inv, w, w_scale_inv, offs_E, bias_EN, block, out_dtype,
                  split_accumulator=split_accumulator, checked=True)


def _dgrad_checked(dy, dy_scale_inv, w, w_scale_inv, offs_E, block, out_dtype, split_accumulator):
    return _dgrad(dy, dy_scale_inv, w, w_scale_inv, offs_E, block, out_dtype, split_accumulator=split_accumulator,
                  checked=True)


def _wgrad_checked(dy_t, dy_t_scale_inv, x_t, x_t_scale_inv, offs_E, block, out_dtype, split_accumulator):
    return _wgrad(dy_t, dy_t_scale_inv, x_t, x_t_scale_inv, offs_E, block, out_dtype=out_dtype,
                  split_accumulator=split_accumulator, checked=True)


def _wgrad_acc_checked(dy_t, dy_t_scale_inv, x_t, x_t_scale_inv, offs_E, block, out, split_accumulator,
                       first=None) -> None:
    _wgrad(dy_t, dy_t_scale_inv, x_t, x_t_scale_inv, offs_E, block, out, split_accumulator=split_accumulator,
           checked=True, first=first)


def grouped_fprop_fp8(x: torch.Tensor, x_scale_inv: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                      offs_E: torch.Tensor, bias_EN: torch.Tensor | None = None,
                      out_dtype: torch.dtype = torch.bfloat16, *, block: int,
                      split_accumulator: bool = True) -> torch.Tensor:
    """``y_TN[g] = deq(x)[g] @ deq(w_e)^T (+ bias_EN[e])`` for the tokens g of each group e: ``[T, N]``.

    Args:
        x, x_scale_inv: float8 ``[T, K]``; fp32 scales ``[]`` or ``[T, cdiv(K, L)]`` (1xL tiles along K).
        w, w_scale_inv: float8 ``[E, N, K]`` (any strides); fp32 ``[E]`` or ``[E, cdiv(N, L), cdiv(K, L)]``.
        offs_E: ``[E]`` int32 end offsets on the device; output rows at or past ``offs_E[-1]`` stay unwritten.
        bias_EN, out_dtype: optional ``[E, N]`` bias, added in fp32; bf16 (default), fp16 or fp32.
        block: L, or 0 for per-tensor scaling.
        split_accumulator: False is faster and less precise, per tensor only ([Note: fp8 split accumulator]).
    """
    _check_ragged("grouped_fprop_fp8", x, x_scale_inv, w, w_scale_inv, offs_E, block, out_dtype, bias_EN)
    _check_split("grouped_fprop_fp8", block, split_accumulator)
    return call(torch.ops.distwgrad.grouped_fprop_fp8, _fprop_checked, x, x_scale_inv, w, w_scale_inv, offs_E,
                bias_EN, block, out_dtype, split_accumulator)


def grouped_dgrad_fp8(dy: torch.Tensor, dy_scale_inv: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                      offs_E: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, *, block: int,
                      split_accumulator: bool = True) -> torch.Tensor:
    """``dx_TK[g] = deq(dy)[g] @ deq(w_e)``; ``dy`` ``[T, N]`` scaled per tensor or in 1xL tiles along N, the
    rest as in :func:`grouped_fprop_fp8`. An N-contiguous weight reads fastest (Hopper's fp8 MMA is K-major)."""
    _check_ragged("grouped_dgrad_fp8", dy, dy_scale_inv, w, w_scale_inv, offs_E, block, out_dtype)
    _check_split("grouped_dgrad_fp8", block, split_accumulator)
    return call(torch.ops.distwgrad.grouped_dgrad_fp8, _dgrad_checked, dy, dy_scale_inv, w, w_scale_inv, offs_E,
                block, out_dtype, split_accumulator)


def grouped_wgrad_fp8(dy_t: torch.Tensor, dy_t_scale_inv: torch.Tensor, x_t: torch.Tensor,
                      x_t_scale_inv: torch.Tensor, offs_E: torch.Tensor,
                      out: torch.Tensor | Sequence[torch.Tensor] | None = None, *, block: int,
                      split_accumulator: bool = True, out_dtype: torch.dtype | None = None,
                      first: torch.Tensor | None = None):
    """``dW_e = deq(dy)[g]^T @ deq(x)[g]`` summed over the tokens g of each group e: a fresh tensor, or ``out``.

    Args:
        dy_t, dy_t_scale_inv, x_t, x_t_scale_inv: the TRANSPOSED quantizations ``[N, T]`` and ``[K, T]``,
            scaled per tensor or in 1xL tiles along the whole token range (``quantize_rowwise_and_columnwise``).
        out: None for a fresh ``[E, N, K]`` (zeros for an empty group); or fp32 buffers to ADD into: a stacked
            ``[E, N, K]`` or a list of E ``[N, K]`` sharing shape and strides.
        offs_E, block, split_accumulator: as in :func:`grouped_fprop_fp8`.
        out_dtype: a fresh output's dtype: fp32 (None), bf16 or fp16; ValueError with ``out``.
        first: only with ``out``: an int32 ``[1]`` device flag; while not 0, ``out`` is written instead of
            added into ([Note: an unwritten accumulator] in ``distwgrad/weights/first_write.py``).
    """
    if out is not None and out_dtype not in (None, torch.float32):
        raise ValueError(f"grouped_wgrad_fp8: out_dtype={out_dtype} is a fresh output's dtype; an out to add "
                         f"into is fp32 (pass one or the other)")
    out_dtype = torch.float32 if out_dtype is None else out_dtype
    dy_s, x_s = dy_t_scale_inv, x_t_scale_inv
    _check_wgrad(dy_t, dy_s, x_t, x_s, offs_E, block, out, out_dtype, first)
    _check_split("grouped_wgrad_fp8", block, split_accumulator)
    ops, split = torch.ops.distwgrad, split_accumulator
    if out is None:
        return call(ops.grouped_wgrad_fp8, _wgrad_checked, dy_t, dy_s, x_t, x_s, offs_E, block, out_dtype, split)
    if isinstance(out, torch.Tensor):
        call(ops.grouped_wgrad_fp8_accumulate, _wgrad_acc_checked, dy_t, dy_s, x_t, x_s, offs_E, block, out, split,
             first, mutated=(6,))
    else:
        call(ops.grouped_wgrad_fp8_accumulate_list, _wgrad_acc_checked, dy_t, dy_s, x_t, x_s, offs_E, block,
             list(out), split, first, mutated=(6,))
    return out
