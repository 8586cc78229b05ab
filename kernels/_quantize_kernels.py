"""The ``@triton.jit`` side of the FP8 quantizers launched by ``quantize.py`` (whose docstring has the math):
the shared scale arithmetic and fp32 -> fp8 cast, then one kernel per scaling. ``weights_fp8.py`` and the
Gluon rows + columns kernel build on the same helpers, so every path gives ``distwgrad.fp8.quantize``'s bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

_FLT_MAX = tl.constexpr(3.4028234663852886e38)
_FLT_MIN_NORMAL = tl.constexpr(2.0**-126)
_INF = tl.constexpr(float("inf"))


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)  # max.NaN.f32: one instruction


@triton.jit
def _absmax(x, axis):
    """max |x| along ``axis`` as fp32, NaN-propagating (``tl.max`` may drop NaN); the caller maps NaN to +inf
    once per scale (``_inf_if_nan``). fp32 is exact (a max picks an input); Triton rejects a bf16 reduction here."""
    return tl.reduce(tl.abs(x).to(tl.float32), axis, _max_nan)


@triton.jit
def _inf_if_nan(amax):
    return tl.where(amax == amax, amax, _INF)


@triton.jit
def _scale_from_amax(amax, NUM: tl.constexpr, POW2: tl.constexpr):
    """The reference's ``compute_scale``, op for op, or for POW2 by exponent arithmetic with the same bits
    ([Note: power-of-two scales without division]). NUM = fp8_max * 2**-margin; ``amax`` >= 0 or +inf."""
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
    """``1 / scale`` by IEEE division as the reference, or for POW2 2**k -> 2**-k from the exponent bits."""
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
    """Program ``pid`` of ``nprog``: max |x| over its BLOCK-element strides of x, atomically into ``amax_ptr``."""
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
def _quantize_blocks_kernel(x_ptr, q_ptr, s_inv_ptr, M, N, GROUP_ROWS, NUM: tl.constexpr, FP8: tl.constexpr,
                            FP8_MAX: tl.constexpr, MANT: tl.constexpr, EMIN_BIASED: tl.constexpr,
                            HW_CAST: tl.constexpr, POW2: tl.constexpr, TRANSPOSE: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) block per program: amax, scale, cast. ``TRANSPOSE``: x is stacked ``[GROUP_ROWS, N]``
    matrices (GROUP_ROWS a multiple of BLOCK_M), each stored transposed; the scale grid is x's either way."""
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
    if TRANSPOSE:
        g = (pid_m * BLOCK_M) // GROUP_ROWS  # the matrix this block lies in
        rows = offs_m - g * GROUP_ROWS
        q_g = q_ptr + g.to(tl.int64) * GROUP_ROWS * N
        tl.store(q_g + offs_n.to(tl.int64)[:, None] * GROUP_ROWS + rows[None, :], tl.trans(q), mask=tl.trans(mask))
    else:
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
    """Scales of a tile's row tiles (A) and column tiles (B) from their NaN-free amaxes; stores the inverses.

    [Note: compact scales]
    A reduction's result is replicated on every thread that held its input, so each thread derives ~20 scales;
    computing each once via global memory ran slower (docs/benchmarks/LOG.md), so the replicated form stays.
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
    """An [L, L] tile of x per program, loaded once for x's 1xL row tiles and x^T's (along M). ``tl.trans``
    relabels the layout; Triton stages x^T's bytes through shared memory, so its stores stay 16-byte wide."""
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
