"""FP8 grouped GEMMs for MoE: the three products over ragged token groups, scales applied in the kernel.

Dispatch: the modules reach these kernels on CUDA through ``distwgrad.ops.grouped_gemm_fp8`` ([Note: fp8
gemm dispatch]). dgrad reads the weight N-contiguous (Hopper's fp8 MMA takes B only K-major; the
dispatcher passes that copy). With promotion (per-tensor split accumulator, blockwise), fprop/dgrad of
contractions from 768 run in a persistent warp-specialized Gluon kernel on Hopper that adds each 128-deep
partial while the next step's MMAs run (``_grouped_gemm_fp8_gluon.py``, [Note: promotion under the next
MMA]; the same bits as the Triton kernel); per-tensor wgrad with the split accumulator and blockwise wgrad
of 1x128 tiles likewise (``gluon/grouped_wgrad_fp8.py``, [Note: fp8 wgrad under the next MMA], [Note:
blockwise wgrad scales]). Where the Gluon kernels take over,
their ring depths and tiles: ``GroupedGemmFp8Tuning`` ([Note: kernel tuning] in ``_tuning.py``). The tile
table (``_grouped_gemm_fp8_configs.py``) comes from H200 sweeps. Current speeds: docs/benchmarks.md;
history: docs/benchmarks/LOG.md.

Weights from a sharded gather off the 128-row grid come with per-row ``block=(1, 128)`` scales
(``distwgrad.fp8.weights``): not supported here; the dispatcher emulates those.

Legend: E experts (groups), T tokens, K in-features, N out-features, L the scale block (128).
``offs_E``: int32 END offsets on the device (``grouped_gemm``'s convention: no host sync, clamped into
``[0, T]``, rows at or past ``offs_E[-1]`` of fprop/dgrad outputs left unwritten).

    fprop  y_TN[g]   = deq(x_TK)[g] @ deq(w_ENK[e])^T (+ bias_EN[e])  grouped_fprop_fp8(x, x_s, w, w_s, offs_E)
    dgrad  dx_TK[g]  = deq(dy_TN)[g] @ deq(w_ENK[e])                  grouped_dgrad_fp8(dy, dy_s, w, w_s, offs_E)
    wgrad  dW_ENK[e] = deq(dy^T_NT)[:, g] @ deq(x^T_KT)[:, g]^T       grouped_wgrad_fp8(dy_t, dy_s, x_t, x_s, ...)

Operands: float8 data and fp32 ``scale_inv`` tensors side by side, ``block`` the recipe's L (0: per-tensor);
``distwgrad.ops.grouped_gemm_fp8`` unpacks the runtime's ``Quantized`` into them. One recipe for all
operands of a call:
- per-tensor: one fp32 ``scale_inv`` per activation / gradient, one per expert weight ([E]);
- blockwise (DeepSeek-V3): activations and gradients in 1xL tiles along the contraction (x: [T, cdiv(K,
  L)], dy: [T, cdiv(N, L)]; for wgrad the TRANSPOSED quantizations ``dy^T`` [N, T] and ``x^T`` [K, T] that
  ``quantize_rowwise_and_columnwise`` returns, tiles along the tokens), weights in LxL blocks ([E, cdiv(N,
  L), cdiv(K, L)]). dgrad contracts over N, so it reads weight block (nb, kb) for contraction block nb:
  the square blocks make the transposed use exact.
The weights are one stacked float8 ``w_ENK`` (any strides) with stacked scales ([E] or [E, gn, gk]).

Math: fp8 x fp8 products on the tensor cores (exact in fp32), fp32 accumulation. Blockwise: one K step
per scale block (BLOCK_K = L); each step's dot starts from zero and is added to the fp32 accumulator
times ``a_scale[row, kb] * b_scale[col_block, kb]`` (DeepSeek-V3's promotion every 128 elements, which
also bounds Hopper's limited-precision fp8 accumulation to 128-deep partial sums). Per-tensor: the dot
accumulates directly with ``max_num_imprecise_acc=BLOCK_K`` (the same promotion) and the two scales
multiply once after the loop. wgrad walks each group's tokens in chunks ALIGNED TO THE GLOBAL L GRID,
masking tokens outside the group, so every chunk lies in one token tile (one scale per row) even when a
group starts mid-tile: the module quantizes over the whole token range, and a tile may span two groups.
Outputs: fprop/dgrad in ``out_dtype`` (bf16 default; fp16, fp32); wgrad a fresh ``[E, N, K]`` in ``out_dtype``
(fp32 by default: an fp8 product has no natural output dtype; a module without ``main_grad`` asks for its
parameter's dtype, which the epilogue rounds to from the fp32 accumulator, the bits of the fp32 result cast,
at half or a quarter of its bytes written) or ADDED into fp32 ``out`` (stacked ``[E, N, K]`` or a list of E
``[N, K]``), as ``grouped_wgrad``. An empty group writes zeros to a fresh wgrad and adds nothing to ``out``.
Non-finite scales (the quantizers' NaN policy) propagate: a NaN scale makes the outputs that use it NaN.

Loads: TMA descriptors when layouts allow (16-byte aligned base and outer strides, unit inner stride;
the weight through a 3-D [E, rows, cols] descriptor, so a step never reads the next expert), else masked
pointer loads with any strides. wgrad's partial chunks (group edges) always take the pointer path.

Interpreter (TRITON_INTERPRET=1, CPU tensors; triton 3.9): fp8 loads (plain and TMA) and the fp8 ->
fp32 cast are exact for every finite fp8 value, but its fp8 ``tl.dot`` decodes through fp16 and turns
e5m2 subnormals wrong (2^-16 -> 0, 3 * 2^-16 -> 2^-15; e4m3 is exact), so the kernels upcast fp8
operands to fp32 there (UPCAST, as ``grouped_gemm`` does for bf16); the GPU path feeds fp8 to the tensor
cores. Other interpreter quirks: its fp8 -> fp32 cast maps NaN/inf to finite values (harmless: the
quantizers give a non-finite unit a NaN scale, which the kernels propagate) and fp32 -> bf16 stores
truncate. ``tests/test_grouped_gemm_fp8_kernels.py`` (cases interpreter_fp8_dot, e5m2_subnormals) pins
this down.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._dispatch import call
from ._grouped_gemm_fp8_checks import _check_ragged, _check_split, _check_wgrad
from ._grouped_gemm_fp8_launch import _dgrad, _fprop, _wgrad

__all__ = ["grouped_fprop_fp8", "grouped_dgrad_fp8", "grouped_wgrad_fp8"]


# [Note: fp8 wgrad edges]
# A wgrad chunk that straddles a group edge must zero the other group's tokens, in registers (a TMA box
# cannot stop at a group's end, and its innermost offset, here the token, must be 16-byte aligned: [Note:
# fp8 wgrad chunks]).
# The TMA path runs masked head and tail chunks around an unmasked pipelined loop over the full chunks
# (the head and tail run outside the pipeline, each waiting out a full TMA round trip; the arrangements
# that masked every chunk inside one pipelined loop ran slower at every config and shape:
# docs/benchmarks/LOG.md).

# [Note: fp8 wgrad chunks]
# The wgrad contracts each group's tokens in 128-token chunks (the promotion interval, [Note: fp8 split
# accumulator]) on the global 128-token grid and adds the chunks' partial sums in token order, in every
# path of every kernel (the Gluon one: ``_grouped_wgrad_fp8_gluon``), so that they give the same bits (the
# GPU tests compare them; ``_case_wgrad_chunks`` pins the order with sums whose rounding depends on it).
# Why this arrangement and not a 16-token grid or the first chunk last: docs/benchmarks/LOG.md.

# [Note: fp8 split accumulator]
# Hopper's fp8 tensor cores add each 32-deep product into the accumulator with ~13 explicit mantissa
# bits, not fp32's 23 (DeepSeek-V3 report, Sec. 3.3.2). ``split_accumulator=True`` (every default here)
# starts a fresh partial sum every BLOCK_K = 128 products and adds it to an fp32 accumulator
# (``max_num_imprecise_acc=BLOCK_K``): the error stays that of a 128-deep sum. False accumulates the
# whole contraction in the tensor cores (Triton's default for fp8 on sm_90): no second accumulator,
# so wider tiles fit the registers and each step saves an add, at an error that grows with the depth
# (``reference_fp8.hopper_mma_rel``). TransformerEngine's per-tensor recipes make the same trade per
# GEMM (``use_split_accumulator``: False for fprop, True for dgrad and wgrad); our ``PerTensorScaling``
# exposes it as ``fp8_gemm_fprop`` / ``fp8_gemm_dgrad`` / ``fp8_gemm_wgrad`` and keeps True for all
# three by default. The blockwise recipe scales every block's dot before adding it, so it always splits.
# On CPU (interpreter or emulation) products are exact fp32 either way.


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
    """``y_TN[g] = deq(x)[g] @ deq(w_e)^T (+ bias_EN[e])`` for the tokens g of every group e.

    Args:
        x, x_scale_inv: ``[T, K]`` float8 and its fp32 scales: ``[]`` per-tensor, ``[T, cdiv(K, L)]`` for 1xL
            tiles along K (``quantize_rowwise_and_columnwise(x)``'s first pair).
        w, w_scale_inv: ``[E, N, K]`` float8 (any strides) and ``[E]`` (per-tensor) or ``[E, cdiv(N, L),
            cdiv(K, L)]`` (LxL blocks, the same L) fp32 scales.
        offs_E: ``[E]`` int32 end offsets on the same device (never read on the host).
        bias_EN: optional ``[E, N]`` bf16/fp16/fp32 bias, added in fp32.
        out_dtype: bf16 (default), fp16 or fp32.
        block: L, or 0 for per-tensor scaling.
        split_accumulator: promote the tensor cores' partial sums to fp32 every L (128) products
            (default); False lets Hopper accumulate the whole contraction at its reduced fp8 precision
            (faster; per-tensor scaling only). [Note: fp8 split accumulator].

    Returns:
        ``[T, N]`` in ``out_dtype`` (rows at or past ``offs_E[-1]`` unwritten).
    """
    _check_ragged("grouped_fprop_fp8", x, x_scale_inv, w, w_scale_inv, offs_E, block, out_dtype, bias_EN)
    _check_split("grouped_fprop_fp8", block, split_accumulator)
    return call(torch.ops.distwgrad.grouped_fprop_fp8, _fprop_checked, x, x_scale_inv, w, w_scale_inv, offs_E,
                bias_EN, block, out_dtype, split_accumulator)


def grouped_dgrad_fp8(dy: torch.Tensor, dy_scale_inv: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                      offs_E: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, *, block: int,
                      split_accumulator: bool = True) -> torch.Tensor:
    """``dx_TK[g] = deq(dy)[g] @ deq(w_e)``; ``dy`` ``[T, N]`` per-tensor or 1xL tiles along N, the weights
    as in :func:`grouped_fprop_fp8` (``[E, N, K]``: block (nb, kb) serves contraction block nb; an
    N-contiguous layout reads fastest), ``block`` and ``split_accumulator`` as there."""
    _check_ragged("grouped_dgrad_fp8", dy, dy_scale_inv, w, w_scale_inv, offs_E, block, out_dtype)
    _check_split("grouped_dgrad_fp8", block, split_accumulator)
    return call(torch.ops.distwgrad.grouped_dgrad_fp8, _dgrad_checked, dy, dy_scale_inv, w, w_scale_inv, offs_E,
                block, out_dtype, split_accumulator)


def grouped_wgrad_fp8(dy_t: torch.Tensor, dy_t_scale_inv: torch.Tensor, x_t: torch.Tensor,
                      x_t_scale_inv: torch.Tensor, offs_E: torch.Tensor,
                      out: torch.Tensor | Sequence[torch.Tensor] | None = None, *, block: int,
                      split_accumulator: bool = True, out_dtype: torch.dtype | None = None,
                      first: torch.Tensor | None = None):
    """``dW_e = deq(dy)[g]^T @ deq(x)[g]`` summed over the tokens g of each group e.

    Args:
        dy_t, dy_t_scale_inv, x_t, x_t_scale_inv: the TRANSPOSED quantizations ``[N, T]`` and ``[K, T]`` with
            their scales (per-tensor, or 1xL tiles along the tokens over the whole token range:
            ``quantize_rowwise_and_columnwise``'s second pair).
        offs_E: ``[E]`` int32 end offsets on the same device.
        out: None for a fresh ``[E, N, K]`` in ``out_dtype`` (zeros for an empty group); or fp32 buffers
            to ADD into (``main_grad``): a stacked ``[E, N, K]`` tensor or a list of E ``[N, K]`` tensors
            sharing shape and strides (an empty group adds nothing).
        block: L, or 0 for per-tensor scaling (both operands).
        split_accumulator: as in :func:`grouped_fprop_fp8` (the contraction is each group's tokens).
        out_dtype: a fresh output's dtype: fp32 (None, the default), bf16 or fp16, rounded from the fp32
            accumulator in the epilogue (the bits of the fp32 output cast). Not with ``out``.
        first: only with ``out``: an int32 ``[1]`` flag on the device; while it is not 0, ``out`` holds
            nothing yet and is written instead of added into ([Note: an unwritten accumulator] in
            ``distwgrad/weights/first_write.py``; the caller clears it afterwards).

    Returns:
        The fresh tensor, or ``out`` itself.
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
