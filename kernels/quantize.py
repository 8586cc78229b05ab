"""Triton FP8 quantization: fused amax + scale + cast, bit-exact with ``distwgrad.fp8.quantize``.

Legend: M rows, N columns of a row-major (contiguous) 2-D input; ``L`` the 1xL tile length; ``gm, gn``
the scale-grid dims. Inputs fp32 / fp16 / bf16; outputs float8 (E4M3FN or E5M2) data and fp32
``scale_inv``; the Python API returns ``distwgrad.fp8.quantize.Quantized``, as the reference does.

Kernels:
- per-tensor, two passes: ``_amax_kernel`` (grid-stride max of |x|, one fp32 ``atomic_max`` per
  program) then ``_cast_per_tensor_kernel`` (every program derives the same scale from the amax; the
  first also writes ``scale_inv``). A caller-given amax (a sharded weight's all-reduced one) skips
  the first pass. The cast pass walks the blocks last to first: the amax pass read them last, so they
  may still be in L2.
- ``_quantize_blocks_kernel``: one program per (bm, bn) block, e.g. 128x128 weights: block amax,
  scale and cast in one pass over the block.
- ``_quantize_rows_kernel``: 1xL tiles for activations and gradients: a [TILE_M, L] tile per program,
  one scale per row.
- ``_quantize_rowcol_kernel``: both quantizations an activation (or gradient) needs, from one read of
  x: an [L, L] tile per program gives the 1xL row tiles of x (along N) and the 1xL tiles of x^T (along
  M, one per column of the tile), the latter stored transposed as [N, M]; the tile is held in registers
  for both (visiting it twice in column chunks, the second visit a cache hit, ran at half the speed:
  1045 vs 2180 GB/s on an H200, so that variant is gone).

Speed (H200: ~4.1 TB/s copy, 132 SMs at ~1.98 GHz). At copy bandwidth an SM must take ~4 bf16 elements
per cycle while issuing at most 128 thread-instructions per cycle, so the per-element work must stay
near ~10 instructions: a load's bf16 -> fp32 shift, one max.NaN (|x| folded in), one multiply, half a
cvt (it converts two values) and byte packing. Per-scale work (the scale, its inverse and the clamps) is
repeated by every thread that holds part of the scale's row or column, which is why the tilings matter,
and why power-of-two scales skip the divisions (below): in the rows + columns kernel each thread
computes ~40 scales, and the two IEEE divisions per scale are a third of its instructions (sm_90a SASS,
``qa/bench/quantize_sass.py``: 34.6 instructions per element with divisions, the ``power_of_two=False``
build, 24.4 without; H200: 2205 -> 2723-2914 GB/s). Per-tensor scaling needs the global
amax before the first element can be cast, so x is read twice: holding x on chip until every program's
amax is in would take a grid-wide barrier and room for all of x (256 MiB at 8192x16384 bf16, vs ~33 MiB
of registers + ~30 MiB of shared memory + 50 MB of L2 on an H200). For bf16 -> fp8 that is 5 bytes moved
per 3 of minimal traffic: a bound of 3/5 = 0.6 of copy on the minimal-traffic GB/s the benchmark
reports; L2 hits of the reversed cast pass can only shave the re-read of the last few tens of MB.
Delayed scaling (the previous step's amax) reads x once, but it is another recipe, not this one.

Bit-exactness ([Note: fp8 scale arithmetic] in ``distwgrad/fp8/quantize.py``):
- the scale and ``scale_inv`` use ``tl.math.div_rn`` (IEEE division; Triton's ``/`` is approximate
  on NVIDIA) and the same clamps and mask as the reference, selected with ``tl.where`` (comparisons
  with NaN are false, so no NaN-dropping min/max is involved); power-of-two scales use no division:
- [Note: power-of-two scales without division] The reference takes ``s = fl(NUM / amax)``, clamps it
  to [2**-126, FLT_MAX] and keeps its exponent. Write NUM = mn * 2**en and amax = ma * 2**ea with
  mantissas in [1, 2). If mn >= ma the quotient lies in [1, 2) and cannot round up to 2 (it is at
  most mn <= 2 - 2**-23, representable); if mn < ma it lies in (1/2, 1) and cannot round up to 1 (it
  is at most 1 - 2**-24, representable). So fl(NUM / amax) has exponent en - ea - [mn < ma] exactly,
  and the kernel computes that from the bits, clamped to [-126, 127] (a subnormal amax overflows the
  quotient: 2**127); 0 and non-finite amaxes are handled as in the division path. ``scale_inv`` of
  2**k is 2**-k (2**-127 is subnormal). Checked in the kernels against the reference over every
  exponent, the mantissas where the exponent changes, 0, inf, NaN and random amaxes
  (``case_pow2_scales`` of tests/test_fp8_quantize.py);
- the amax reductions use the NaN-propagating max (``tl.max`` may drop NaN) and map a NaN result to
  +inf, as ``compute_amax`` does; a max picks one of its inputs, so reducing in bf16/fp16 is exact;
- the fp32 -> fp8 cast (``_to_fp8_bits``) saturates to +-fp8_max and rounds to nearest even: on CUDA
  with the hardware conversion alone (``cvt.rn.satfinite``, sm_89+: Ada, Hopper, Blackwell; it
  saturates +-inf and finite overflow, and keeps NaN); under ``TRITON_INTERPRET=1`` with explicit
  integer/power-of-two arithmetic onto the fp8 grid, because the interpreter's own cast rounds wrongly
  (it drops mantissa carries: 31.6 -> 16) and turns NaN into 256. Each path is tested bit-exact
  against torch's conversion on every fp8 value and midpoint, saturation and non-finite values
  (``case_rounding``). NaN bytes are unspecified (the reference's note): the interpreter path writes
  0x7F | sign, the hardware its own NaN.
Partial edge blocks are masked: masked lanes load 0 and are never stored.
"""

from __future__ import annotations

import os
import warnings

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError

from distwgrad.fp8.quantize import Quantized
from distwgrad.fp8.recipe import BlockwiseScaling, PerTensorScaling, Recipe, fp8_format

from ._dispatch import call
from ._tuning import current as _tuning
from .token_layout import transpose as _transpose_fp8

__all__ = ["quantize_per_tensor", "quantize_blockwise", "quantize_rowwise_and_columnwise"]

# Candidates of ``qa/bench/fp8.py --quant-sweep``: per benchmark op, ``QuantizeTuning`` fields to override
# (``tuning(quantize=...)``; the tuned values and their measurements: [Note: kernel tuning] in _tuning.py),
# each timed after a bit-exact check. Chosen from the register counts there to vary programs per SM, bytes
# per program and per-scale redundancy; the first of each list is the default.
SWEEP: dict[str, list[dict[str, int | bool | None]]] = {
    "per_tensor": [
        dict(per_tensor_block=4096, per_tensor_warps=4),
        dict(per_tensor_block=8192, per_tensor_warps=4),
        dict(per_tensor_block=8192, per_tensor_warps=8),    # amax 55 regs
        dict(per_tensor_block=2048, per_tensor_warps=4),
        dict(per_tensor_block=16384, per_tensor_warps=8),
        dict(per_tensor_block=16384, per_tensor_warps=16),
    ],
    "blockwise_1x128": [
        dict(rows_tile_m=32, rows_warps=4),
        dict(rows_tile_m=16, rows_warps=4),   # 37 regs (12/SM)
        dict(rows_tile_m=32, rows_warps=8),   # 37 regs (8/SM)
        dict(rows_tile_m=64, rows_warps=4),   # 96 regs (5/SM)
        dict(rows_tile_m=64, rows_warps=8),   # 59 regs (4/SM)
        dict(rows_tile_m=128, rows_warps=8),  # 97 regs (2/SM)
    ],
    "blockwise_128x128": [
        dict(blocks_warps=8),
        dict(blocks_warps=4),   # 167 regs (3/SM), fewest instructions per element
        dict(blocks_warps=16),  # 51 regs (2/SM)
    ],
    "rowcol_1x128": [
        # Gluon, sm_90a SASS instructions per element (qa/bench/quantize_sass.py): 18.1; the Triton kernel
        # (rowcol_gluon=False): 24.4 at 8 warps
        dict(rowcol_gluon=True),
        dict(rowcol_gluon=False, rowcol_warps=8, rowcol_maxnreg=128),
        dict(rowcol_gluon=False, rowcol_warps=4, rowcol_maxnreg=None),  # 206 regs (2/SM)
        dict(rowcol_gluon=False, rowcol_warps=16, rowcol_maxnreg=None),  # 64 regs (1/SM)
    ],
}

_FLT_MAX = tl.constexpr(3.4028234663852886e38)
_FLT_MIN_NORMAL = tl.constexpr(2.0**-126)
_INF = tl.constexpr(float("inf"))
_TL_FP8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}
_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)  # max.NaN.f32: one instruction


@triton.jit
def _absmax(x, axis):
    """max |x| along ``axis`` as fp32, NaN-propagating (``tl.max`` may drop NaN); the caller makes NaN
    +inf on the reduced value (``_inf_if_nan``): one select per scale instead of one per element.

    Reduced in fp32 (exact: a max picks one of its inputs). Reducing bf16 in place would keep pairs
    packed, but Triton 3.6 promotes ``tl.maximum`` of bf16 to fp32 inside the combine function and then
    rejects the reduction (its result type differs from the operand type; H200, 2026-11-29).
    """
    return tl.reduce(tl.abs(x).to(tl.float32), axis, _max_nan)


@triton.jit
def _inf_if_nan(amax):
    return tl.where(amax == amax, amax, _INF)


@triton.jit
def _scale_from_amax(amax, NUM: tl.constexpr, POW2: tl.constexpr):
    """The reference's ``compute_scale``: op for op, or for power-of-two scales by exponent arithmetic
    that gives the same bits ([Note: power-of-two scales without division]); NUM = fp8_max * 2**-margin
    (exact in fp32). ``amax`` is >= 0 or NaN-free +inf (``_inf_if_nan``)."""
    if POW2:
        a = amax.to(tl.int32, bitcast=True)
        num = tl.cast(NUM, tl.float32).to(tl.int32, bitcast=True)  # a constant
        e = (num >> 23) - (a >> 23) + 127 - ((a & 0x7FFFFF) > (num & 0x7FFFFF)).to(tl.int32)
        e = tl.where((a >> 23) == 0, 254, tl.minimum(tl.maximum(e, 1), 254))
        s = (e << 23).to(tl.float32, bitcast=True)
    else:
        safe = tl.where(amax == 0.0, 1.0, amax)  # amax == 0 is overwritten below; avoids a 1/0 warning
        s = tl.math.div_rn(NUM + tl.zeros_like(safe), safe)
        s = tl.where(s > _FLT_MAX, _FLT_MAX, s)
        s = tl.where(s < _FLT_MIN_NORMAL, _FLT_MIN_NORMAL, s)
    s = tl.where(amax == 0.0, 1.0, s)
    # NaN for a non-finite amax, made from it (inf - inf): a NaN global constexpr would fail Triton's
    # "global changed since compile" check, as NaN != NaN.
    return tl.where(tl.abs(amax) <= _FLT_MAX, s, amax - amax)


@triton.jit
def _inverse(scale, POW2: tl.constexpr):
    """``scale_inv = 1 / scale`` as the reference computes it (IEEE division, ``tl.math.div_rn``); a
    power-of-two scale 2**k inverts exactly to 2**-k, built from the exponent (2**-127 is subnormal)."""
    if POW2:
        e = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF
        inv = tl.where(e == 254, 0x400000, (254 - e) << 23).to(tl.float32, bitcast=True)
        inv = tl.where(scale == scale, inv, scale)  # NaN stays NaN
    else:  # (an else, not an early return: Gluon callers must not build this branch)
        inv = tl.math.div_rn(1.0 + tl.zeros_like(scale), scale)
    return inv


@triton.jit
def _row_scales(x_RC, NUM: tl.constexpr, POW2: tl.constexpr):
    """Scales of an [R, C] tile (input dtype) whose rows are whole 1xC scaling tiles."""
    return _scale_from_amax(_inf_if_nan(_absmax(x_RC, 1)), NUM, POW2)


@triton.jit
def _to_fp8_bits(y, FP8: tl.constexpr, FP8_MAX: tl.constexpr, MANT: tl.constexpr, EMIN_BIASED: tl.constexpr,
                 HW_CAST: tl.constexpr):
    """fp32 -> float8 bits (uint8): saturate to +-FP8_MAX, round to nearest even; NaN stays NaN."""
    if HW_CAST:
        # One cvt.rn.satfinite.{e4m3,e5m2}x2.f32 per two values (sm_89+) and nothing else: RNE, NaN ->
        # NaN, finite overflow and +-inf -> +-fp8_max. Saturating after rounding equals saturating
        # first: every value above fp8_max rounds to fp8_max or above.
        return y.to(FP8).to(tl.uint8, bitcast=True)
    y = tl.where(y > FP8_MAX, FP8_MAX, tl.where(y < -FP8_MAX, -FP8_MAX, y))
    sign = y.to(tl.int32, bitcast=True) & -2147483648
    # ulp of the fp8 value at |y|: 2**(e - MANT), with e floored at the smallest normal exponent
    # (below it the fp8 grid is the uniform subnormal one). Both scalings are exact powers of two.
    mag = y.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    e = tl.maximum(mag >> 23, EMIN_BIASED)
    ulp = ((e - MANT) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((254 + MANT - e) << 23).to(tl.float32, bitcast=True)
    v = mag.to(tl.float32, bitcast=True) * inv_ulp          # in [0, 2**(MANT + 1)], exact
    v = (v + 8388608.0) - 8388608.0                          # round to an integer, ties to even
    r = ((v * ulp).to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    q = r.to(FP8).to(tl.uint8, bitcast=True)                 # exact: r is on the fp8 grid
    nan_bits = (0x7F | ((sign >> 24) & 0x80)).to(tl.uint8)
    return tl.where(y == y, q, nan_bits)


@triton.jit
def _amax_into(x_ptr, amax_ptr, n, pid, nprog, BLOCK: tl.constexpr):
    """Program ``pid`` of ``nprog``: max |x| over its BLOCK-element strides of x's n elements, into
    ``amax_ptr`` by an atomic max."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, tl.cdiv(n, BLOCK * nprog)):
        offs = (i * nprog + pid).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        acc = _max_nan(acc, tl.abs(x).to(tl.float32))
    # +inf, never NaN, into the atomic: the fp32 atomic_max is an integer max/min on the bits, which
    # orders NaN wrongly.
    tl.atomic_max(amax_ptr, _inf_if_nan(tl.reduce(acc, 0, _max_nan)))


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, n, BLOCK: tl.constexpr):
    _amax_into(x_ptr, amax_ptr, n, tl.program_id(0), tl.num_programs(0), BLOCK)


@triton.jit
def _cast_per_tensor_kernel(x_ptr, amax_ptr, q_ptr, s_inv_ptr, n, NUM: tl.constexpr, FP8: tl.constexpr,
                            FP8_MAX: tl.constexpr, MANT: tl.constexpr, EMIN_BIASED: tl.constexpr,
                            HW_CAST: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    scale = _scale_from_amax(tl.load(amax_ptr), NUM, False)
    blk = tl.num_programs(0) - 1 - pid  # last block first: the amax pass read it last, so it may still be in L2
    offs = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + offs, _to_fp8_bits(x * scale, FP8, FP8_MAX, MANT, EMIN_BIASED, HW_CAST), mask=mask)
    if pid == 0:
        tl.store(s_inv_ptr, tl.math.div_rn(1.0 + tl.zeros_like(scale), scale))


@triton.jit
def _quantize_blocks_kernel(x_ptr, q_ptr, s_inv_ptr, M, N, NUM: tl.constexpr, FP8: tl.constexpr,
                            FP8_MAX: tl.constexpr, MANT: tl.constexpr, EMIN_BIASED: tl.constexpr,
                            HW_CAST: tl.constexpr, POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) block per program, held in registers: amax, scale, cast."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    amax = _inf_if_nan(tl.reduce(_absmax(x, 1), 0, _max_nan))
    scale = _scale_from_amax(amax, NUM, POW2)
    q = _to_fp8_bits(x.to(tl.float32) * scale, FP8, FP8_MAX, MANT, EMIN_BIASED, HW_CAST)
    tl.store(q_ptr + offs, q, mask=mask)
    s_inv = _inverse(scale, POW2)
    tl.store(s_inv_ptr + pid_m * tl.cdiv(N, BLOCK_N) + pid_n, s_inv)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_inv_ptr, M, N, NUM: tl.constexpr, FP8: tl.constexpr,
                          FP8_MAX: tl.constexpr, MANT: tl.constexpr, EMIN_BIASED: tl.constexpr,
                          HW_CAST: tl.constexpr, POW2: tl.constexpr, TILE_M: tl.constexpr, L: tl.constexpr):
    """1xL tiles along N: a [TILE_M, L] tile per program, one scale per row."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * TILE_M + tl.arange(0, TILE_M)
    offs_n = pid_n * L + tl.arange(0, L)
    mask_m = offs_m < M
    mask = mask_m[:, None] & (offs_n < N)[None, :]
    offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    x_TL = tl.load(x_ptr + offs, mask=mask, other=0.0)
    scale_T = _row_scales(x_TL, NUM, POW2)
    q_TL = _to_fp8_bits(x_TL.to(tl.float32) * scale_T[:, None], FP8, FP8_MAX, MANT, EMIN_BIASED, HW_CAST)
    tl.store(q_ptr + offs, q_TL, mask=mask)
    s_inv_T = _inverse(scale_T, POW2)
    tl.store(s_inv_ptr + offs_m * tl.cdiv(N, L) + pid_n, s_inv_T, mask=mask_m)


@triton.jit
def _tile_scales(amax_A, s_inv_ptrs_A, mask_A, amax_B, s_inv_ptrs_B, mask_B, NUM: tl.constexpr, POW2: tl.constexpr):
    """Scales of a tile's row tiles (A) and column tiles (B) from their amaxes (NaN already +inf); the
    inverses stored at ``s_inv_ptrs_A`` / ``s_inv_ptrs_B``.

    [Note: compact scales] A reduction's result is replicated on every thread that held part of what it
    reduced (8 threads per row and 32 per column of a 128x128 tile at 8 warps), and Triton computes
    everything downstream in that layout: each thread derives ~20 scales and their inverses, ~3 of the
    rows + columns kernel's 24.4 sm_90a instructions per element. A variant routed the amaxes through
    their ``scale_inv`` slots in global memory (one scale per thread, then loaded back in the multiply's
    layout; Triton's own layout conversion rematerializes the arithmetic instead): 21.2 instructions per
    element, but its barriers and two L2 round trips per tile made it 2.0-2.4x slower on an H200
    (1036-1266 vs 2510 GB/s, 2026-11-29), so the replicated form stays.
    """
    scale_A = _scale_from_amax(amax_A, NUM, POW2)
    scale_B = _scale_from_amax(amax_B, NUM, POW2)
    tl.store(s_inv_ptrs_A, _inverse(scale_A, POW2), mask=mask_A)
    tl.store(s_inv_ptrs_B, _inverse(scale_B, POW2), mask=mask_B)
    return scale_A, scale_B


@triton.jit
def _quantize_rowcol_kernel(x_ptr, q_ptr, s_inv_ptr, qt_ptr, st_inv_ptr, M, N, NUM: tl.constexpr,
                            FP8: tl.constexpr, FP8_MAX: tl.constexpr, MANT: tl.constexpr,
                            EMIN_BIASED: tl.constexpr, HW_CAST: tl.constexpr, POW2: tl.constexpr,
                            L: tl.constexpr):
    """An [L, L] tile of x per program, loaded once and held for both: x's 1xL row tiles (along N) and
    x^T's (along M).

    ``tl.trans`` only relabels the layout; Triton moves x^T's fp8 bytes through shared memory before
    the store, so the stores to x^T are 16 contiguous bytes per thread like the others (TTGIR: one
    ``convert_layout`` on the uint8 tile).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * L + tl.arange(0, L)
    mask_m = offs_m < M
    rows = offs_m.to(tl.int64)[:, None] * N
    offs_n = pid_n * L + tl.arange(0, L)
    mask_n = offs_n < N
    mask = mask_m[:, None] & mask_n[None, :]
    xf_LL = tl.load(x_ptr + rows + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    xt_LL = tl.trans(xf_LL)  # row j: column j of the tile
    # scale_inv[m, pid_n] and scale_inv_t[n, pid_m]
    scale_M, scale_N = _tile_scales(_inf_if_nan(_absmax(xf_LL, 1)), s_inv_ptr + offs_m * tl.cdiv(N, L) + pid_n,
                                    mask_m, _inf_if_nan(_absmax(xt_LL, 1)),
                                    st_inv_ptr + offs_n * tl.cdiv(M, L) + pid_m, mask_n, NUM, POW2)
    tl.store(q_ptr + rows + offs_n[None, :],
             _to_fp8_bits(xf_LL * scale_M[:, None], FP8, FP8_MAX, MANT, EMIN_BIASED, HW_CAST), mask=mask)
    tl.store(qt_ptr + offs_n.to(tl.int64)[:, None] * M + offs_m[None, :],
             _to_fp8_bits(xt_LL * scale_N[:, None], FP8, FP8_MAX, MANT, EMIN_BIASED, HW_CAST),
             mask=mask_n[:, None] & mask_m[None, :])


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_input(x: torch.Tensor, *, two_d: bool) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"the fp8 quantize kernels take {list(_INPUT_DTYPES)}, got {x.dtype}")
    if x.device.type != "cuda" and not (_interpreting() and x.device.type == "cpu"):
        raise ValueError(f"the fp8 quantize kernels need a CUDA tensor (CPU only under TRITON_INTERPRET=1), "
                         f"got one on {x.device}; use distwgrad.fp8.quantize on CPU")
    if not x.is_contiguous():
        raise ValueError(f"the fp8 quantize kernels need a contiguous input, got shape {tuple(x.shape)} with "
                         f"strides {x.stride()}; call .contiguous() where the copy is intended")
    if two_d and x.dim() != 2:
        raise ValueError(f"blockwise quantization needs a 2-D tensor, got shape {tuple(x.shape)}")


def _check_block(block: tuple[int, int] | list[int]) -> tuple[int, int]:
    bad = lambda b: isinstance(b, bool) or not isinstance(b, int) or b < 1 or b & (b - 1)
    if len(block) != 2 or any(bad(b) for b in block):
        raise ValueError(f"the kernels need a block of two powers of two, got {block!r}")
    return int(block[0]), int(block[1])


def _fmt_args(dtype: torch.dtype, margin: int = 0) -> dict:
    fmt = fp8_format(dtype)
    return dict(NUM=fmt.max * 2.0**-margin, FP8=_TL_FP8[dtype], FP8_MAX=fmt.max, MANT=fmt.mantissa_bits,
                EMIN_BIASED=fmt.min_normal_exp + 127, HW_CAST=not _interpreting())


def _per_tensor_impl(x: torch.Tensor, amax: torch.Tensor | None, dtype: torch.dtype,
                     margin: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_input(x, two_d=False)
    n = x.numel()
    t = _tuning().quantize
    if amax is None:
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        grid = (max(1, min(triton.cdiv(n, t.per_tensor_block), t.amax_max_programs)),)
        _amax_kernel[grid](x, amax, n, BLOCK=t.per_tensor_block, num_warps=t.per_tensor_warps)
    elif amax.numel() != 1 or amax.dtype != torch.float32 or amax.device != x.device:
        raise ValueError(f"amax must be one float32 value on {x.device}, got shape {tuple(amax.shape)}, "
                         f"{amax.dtype} on {amax.device}")
    data = torch.empty(x.shape, dtype=dtype, device=x.device)
    scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    grid = (max(1, triton.cdiv(n, t.per_tensor_block)),)
    _cast_per_tensor_kernel[grid](x, amax, data.view(torch.uint8), scale_inv, n, BLOCK=t.per_tensor_block,
                                  num_warps=t.per_tensor_warps, **_fmt_args(dtype, margin))
    return data, scale_inv


_per_tensor_op = torch.library.custom_op("distwgrad::fp8_quantize_per_tensor", _per_tensor_impl, mutates_args=())


@_per_tensor_op.register_fake
def _(x, amax, dtype, margin):
    return torch.empty_like(x, dtype=dtype), x.new_empty((), dtype=torch.float32)


def _blockwise_impl(x: torch.Tensor, block_m: int, block_n: int, dtype: torch.dtype,
                    power_of_two: bool) -> tuple[torch.Tensor, torch.Tensor]:
    _check_input(x, two_d=True)
    bm, bn = _check_block((block_m, block_n))
    (M, N), grid = x.shape, (triton.cdiv(x.shape[0], bm), triton.cdiv(x.shape[1], bn))
    data = torch.empty(x.shape, dtype=dtype, device=x.device)
    scale_inv = torch.empty(grid, dtype=torch.float32, device=x.device)
    if M * N == 0:
        return data, scale_inv
    t = _tuning().quantize
    if bm == 1:
        tile_m = min(t.rows_tile_m, triton.next_power_of_2(M))
        _quantize_rows_kernel[(triton.cdiv(M, tile_m), grid[1])](
            x, data.view(torch.uint8), scale_inv, M, N, POW2=power_of_two, TILE_M=tile_m, L=bn,
            num_warps=t.rows_warps, **_fmt_args(dtype))
    else:
        _quantize_blocks_kernel[grid](x, data.view(torch.uint8), scale_inv, M, N, POW2=power_of_two,
                                      BLOCK_M=bm, BLOCK_N=bn, num_warps=t.blocks_warps, **_fmt_args(dtype))
    return data, scale_inv


_blockwise_op = torch.library.custom_op("distwgrad::fp8_quantize_blockwise", _blockwise_impl, mutates_args=())


@_blockwise_op.register_fake
def _(x, block_m, block_n, dtype, power_of_two):
    grid = (-(-x.shape[0] // block_m), -(-x.shape[1] // block_n))
    return torch.empty_like(x, dtype=dtype), x.new_empty(grid, dtype=torch.float32)


def _rowcol_impl(x: torch.Tensor, tile: int, dtype: torch.dtype,
                 power_of_two: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_input(x, two_d=True)
    _, L = _check_block((1, tile))
    M, N = x.shape
    data = torch.empty((M, N), dtype=dtype, device=x.device)
    scale_inv = torch.empty((M, triton.cdiv(N, L)), dtype=torch.float32, device=x.device)
    data_t = torch.empty((N, M), dtype=dtype, device=x.device)
    scale_inv_t = torch.empty((N, triton.cdiv(M, L)), dtype=torch.float32, device=x.device)
    if M * N > 0 and not (_gluon_rowcol(x, L, power_of_two)
                          and _launch_gluon_rowcol(x, data, scale_inv, data_t, scale_inv_t, dtype)):
        t = _tuning().quantize
        _quantize_rowcol_kernel[(triton.cdiv(M, L), triton.cdiv(N, L))](
            x, data.view(torch.uint8), scale_inv, data_t.view(torch.uint8), scale_inv_t, M, N,
            POW2=power_of_two, L=L, num_warps=t.rowcol_warps, maxnreg=t.rowcol_maxnreg,
            **_fmt_args(dtype))
    return data, scale_inv, data_t, scale_inv_t


_GLUON_FAILED: str | None = None  # why the Gluon kernel did not build here, once it failed


def _launch_gluon_rowcol(x, data, scale_inv, data_t, scale_inv_t, dtype) -> bool:
    """Launches the Gluon rows + columns kernel; False (and one warning) if this Triton cannot build it
    (Gluon is experimental and its API moves between releases): the caller then runs the Triton kernel,
    which computes the same bits."""
    global _GLUON_FAILED
    if _GLUON_FAILED is not None:
        return False
    from . import _quantize_rowcol_gluon as kg
    M, N = x.shape
    try:
        kg.rowcol_kernel[(triton.cdiv(M, kg.L), triton.cdiv(N, kg.L))](
            x, data.view(torch.uint8), scale_inv, data_t.view(torch.uint8).view(torch.int32), scale_inv_t, M, N,
            NUM=_fmt_args(dtype)["NUM"], FP8=_TL_FP8[dtype], num_warps=kg.NUM_WARPS.value)
    except CompilationError as exc:
        _GLUON_FAILED = f"{type(exc).__name__}: {exc}"[:2000]
        warnings.warn(f"the Gluon rows + columns FP8 quantize kernel does not build with triton "
                      f"{triton.__version__}; using the Triton kernel (same bits, slower): {_GLUON_FAILED[:400]}",
                      RuntimeWarning, stacklevel=3)
        return False
    return True


def _gluon_rowcol(x: torch.Tensor, L: int, power_of_two: bool) -> bool:
    """Whether the Gluon rows + columns kernel takes this call ([Note: rows and columns without a
    transpose]): asked for (``QuantizeTuning.rowcol_gluon``), available, and its preconditions hold (the 128 tile,
    power-of-two scales, M a multiple of 4, compute capability 9 or newer)."""
    if not _tuning().quantize.rowcol_gluon or not x.is_cuda or _interpreting():
        return False
    from . import _quantize_rowcol_gluon as kg
    return (kg.AVAILABLE and L == kg.L and power_of_two and x.shape[0] % 4 == 0
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


_rowcol_op = torch.library.custom_op("distwgrad::fp8_quantize_rowwise_and_columnwise", _rowcol_impl, mutates_args=())


@_rowcol_op.register_fake
def _(x, tile, dtype, power_of_two):
    M, N = x.shape
    return (torch.empty_like(x, dtype=dtype), x.new_empty((M, -(-N // tile)), dtype=torch.float32),
            x.new_empty((N, M), dtype=dtype), x.new_empty((N, -(-M // tile)), dtype=torch.float32))


def quantize_per_tensor(x: torch.Tensor, dtype: torch.dtype, *, amax: torch.Tensor | None = None,
                        margin: int = 0) -> Quantized:
    """Kernel version of ``distwgrad.fp8.quantize.quantize_per_tensor`` (same arguments, same bits).

    ``amax``, when given, must be a one-element fp32 tensor on ``x``'s device (e.g. the MAX all-reduce
    of ``compute_amax(shard)`` over the shard group); it is read on the device, never synced.
    """
    fp8_format(dtype)
    data, scale_inv = call(torch.ops.distwgrad.fp8_quantize_per_tensor, _per_tensor_impl, x, amax, dtype, margin)
    return Quantized(data, scale_inv, None, x.dtype, x.shape)


def quantize_blockwise(x: torch.Tensor, block: tuple[int, int], dtype: torch.dtype, *,
                       power_of_two: bool = True) -> Quantized:
    """Kernel version of ``distwgrad.fp8.quantize.quantize_blockwise``; blocks must be powers of two."""
    fp8_format(dtype)
    bm, bn = _check_block(block)
    data, scale_inv = call(torch.ops.distwgrad.fp8_quantize_blockwise, _blockwise_impl, x, bm, bn, dtype,
                           power_of_two)
    return Quantized(data, scale_inv, (bm, bn), x.dtype, x.shape)


def quantize_rowwise_and_columnwise(x: torch.Tensor, recipe: Recipe, *,
                                    grad: bool = False) -> tuple[Quantized, Quantized]:
    """Kernel version of ``distwgrad.fp8.quantize.quantize_rowwise_and_columnwise``.

    ``BlockwiseScaling``: one read of ``x`` for both outputs. ``PerTensorScaling``: the per-tensor
    kernels, then a transposed copy of the fp8 data (the scale is shared, so this is exact;
    ``token_layout.transpose``).
    """
    dtype = recipe.dtype_for(grad=grad)
    if isinstance(recipe, BlockwiseScaling):
        L = recipe.act_block[1]
        data, s_inv, data_t, s_inv_t = call(torch.ops.distwgrad.fp8_quantize_rowwise_and_columnwise, _rowcol_impl,
                                             x, L, dtype, recipe.power_of_two)
        return (Quantized(data, s_inv, (1, L), x.dtype, x.shape),
                Quantized(data_t, s_inv_t, (1, L), x.dtype, torch.Size((x.shape[1], x.shape[0]))))
    if isinstance(recipe, PerTensorScaling):
        _check_input(x, two_d=True)
        q = quantize_per_tensor(x, dtype, margin=recipe.margin)
        data_t = _transpose_fp8(q.data)  # the same bits as transpose_quantized, in one fast pass
        return q, Quantized(data_t, q.scale_inv, None, q.orig_dtype, data_t.shape)
    raise TypeError(f"recipe must be a PerTensorScaling or a BlockwiseScaling, got {recipe!r}")
