"""FP8 Triton kernels of ``grouped_gemm_fp8``: fprop/dgrad over ragged token rows, and the wgrad over each group's
tokens in chunks on the global 128-token grid. Math, layouts, launchers and Notes: ``grouped_gemm_fp8``.
"""

import triton
import triton.language as tl

from ._grouped_ragged import _find_group
from ._grouped_wgrad import _prefetch_out_tile, _reads_out, _skips, _swizzle, _wgrad_out_base, _wgrad_tile, _wgrad_write


@triton.jit
def _scaled_dot(a, b, acc, a_s, b_s, BLOCKWISE: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                SPLIT_ACC: tl.constexpr):
    """acc + a @ b: blockwise, the step's dot times its row/column scales; per-tensor, into acc (scaled after the
    loop), promoted to fp32 every BLOCK_K iff SPLIT_ACC ([Note: fp8 split accumulator]). UPCAST (interpreter,
    whose fp8 dot mis-decodes e5m2 subnormals): fp32 operands, exact for every finite fp8 value."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if BLOCKWISE:
        return acc + tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
    if SPLIT_ACC:
        return tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
    return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["T", "E"])
def _fp8_ragged_kernel(a_desc, b_desc, a_ptr, b_ptr, as_ptr, bs_ptr, out_ptr, bias_ptr, offs_ptr,
                       T, E, N, K,
                       stride_at, stride_ak, stride_be, stride_bk, stride_bn,
                       stride_ast, stride_ask, stride_bse, stride_bsk, stride_bsn,
                       stride_ot, stride_on, stride_biase, stride_biasn, stride_o,
                       BLOCKWISE: tl.constexpr, B_K_INNER: tl.constexpr, HAS_BIAS: tl.constexpr,
                       USE_TMA: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       BLOCK_E: tl.constexpr, SPLIT_ACC: tl.constexpr):
    """out[t, :N] = a[t, :K] @ B_e for group e's tokens t; B_e by strides or a 3-D descriptor, [E, N, K] if
    B_K_INNER else [E, K, N]. Blockwise scales a_s[t, kb], b_s[e, kb, n // BLOCK_K]."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    e, local, start, size, total = _find_group(offs_ptr, stride_o, E, T, pid, tiles_n, BLOCK_M, BLOCK_E)
    if pid >= total:
        return
    pid_m, pid_n = _swizzle(local, tl.cdiv(size, BLOCK_M), tiles_n, GROUP_M)
    row0 = start + pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    rows_ok = rows < start + size
    cols_ok = cols < N
    rows64 = rows.to(tl.int64)
    e64 = e.to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows64[:, None] * stride_at + ks[None, :] * stride_ak
    b_ptrs = b_ptr + e64 * stride_be + ks[:, None] * stride_bk + cols.to(tl.int64)[None, :] * stride_bn
    as_ptrs = as_ptr + rows64 * stride_ast                                   # blockwise only
    bs_ptrs = bs_ptr + e64 * stride_bse + (cols // BLOCK_K) * stride_bsn     # blockwise only
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if USE_TMA:  # rows past the group and columns past N feed masked outputs only; K tail zero-filled
            a = a_desc.load([row0, k0])
            if B_K_INNER:
                b = tl.reshape(b_desc.load([e, col0, k0]), (BLOCK_N, BLOCK_K)).T
            else:
                b = tl.reshape(b_desc.load([e, k0, col0]), (BLOCK_K, BLOCK_N))
        else:
            a = tl.load(a_ptrs, mask=rows_ok[:, None] & (ks[None, :] < K - k0), other=0.0)
            b = tl.load(b_ptrs, mask=(ks[:, None] < K - k0) & cols_ok[None, :], other=0.0)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        a_s = None
        b_s = None
        if BLOCKWISE:
            kb = k0 // BLOCK_K
            a_s = tl.load(as_ptrs + kb * stride_ask, mask=rows_ok, other=0.0)
            b_s = tl.load(bs_ptrs + kb * stride_bsk, mask=cols_ok, other=0.0)
        acc = _scaled_dot(a, b, acc, a_s, b_s, BLOCKWISE, BLOCK_K, UPCAST, SPLIT_ACC)
    if not BLOCKWISE:
        acc = acc * tl.load(as_ptr) * tl.load(bs_ptr + e64 * stride_bse)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + e64 * stride_biase + cols * stride_biasn, mask=cols_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    o_ptrs = out_ptr + rows64[:, None] * stride_ot + cols[None, :] * stride_on
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=rows_ok[:, None] & cols_ok[None, :])


@triton.jit
def _wgrad_fp8_chunk(a_ptr, b_ptr, as_ptrs, bs_ptrs, t0, lo, hi, rows_m, cols_n, N, K, acc,
                     stride_an, stride_at, stride_bk, stride_bt, stride_asc, stride_bsc,
                     BLOCKWISE: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                     SPLIT_ACC: tl.constexpr):
    """Tokens [t0, t0 + BLOCK_K) of one L-aligned chunk, those outside [lo, hi) masked to zero."""
    ts = t0 + tl.arange(0, BLOCK_K)
    t_ok = (ts >= lo) & (ts < hi)
    a = tl.load(a_ptr + rows_m.to(tl.int64)[:, None] * stride_an + ts[None, :] * stride_at,
                mask=(rows_m < N)[:, None] & t_ok[None, :], other=0.0)
    b = tl.load(b_ptr + cols_n.to(tl.int64)[:, None] * stride_bk + ts[None, :] * stride_bt,
                mask=(cols_n < K)[:, None] & t_ok[None, :], other=0.0)
    return _wgrad_fp8_scaled(a, b.T, acc, as_ptrs, bs_ptrs, t0 // BLOCK_K, rows_m, cols_n, N, K,
                             stride_asc, stride_bsc, BLOCKWISE, BLOCK_K, UPCAST, SPLIT_ACC)


@triton.jit
def _wgrad_fp8_tma_chunk(a_desc, b_desc, as_ptrs, bs_ptrs, t0, lo, hi, row0, col0, rows_m, cols_n, N, K, acc,
                         stride_asc, stride_bsc, MASKED: tl.constexpr, BLOCKWISE: tl.constexpr,
                         BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, SPLIT_ACC: tl.constexpr):
    """The same chunk by TMA (out-of-range rows and tokens arrive as zeros; masked pointer loads spilled on sm_90);
    MASKED zeroes tokens outside [lo, hi) in registers: other groups' data, which may be NaN."""
    a = a_desc.load([row0, t0])
    b = b_desc.load([col0, t0])
    if MASKED:
        ts = t0 + tl.arange(0, BLOCK_K)
        t_ok = (ts >= lo) & (ts < hi)
        a = tl.where(t_ok[None, :], a, tl.zeros_like(a))
        b = tl.where(t_ok[None, :], b, tl.zeros_like(b))
    return _wgrad_fp8_scaled(a, b.T, acc, as_ptrs, bs_ptrs, t0 // BLOCK_K, rows_m, cols_n, N, K,
                             stride_asc, stride_bsc, BLOCKWISE, BLOCK_K, UPCAST, SPLIT_ACC)


@triton.jit
def _wgrad_fp8_scaled(a, b, acc, as_ptrs, bs_ptrs, c, rows_m, cols_n, N, K, stride_asc, stride_bsc,
                      BLOCKWISE: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                      SPLIT_ACC: tl.constexpr):
    a_s = None
    b_s = None
    if BLOCKWISE:  # token tile c: one scale per row of dy^T (out-feature) and per row of x^T (in-feature)
        a_s = tl.load(as_ptrs + c * stride_asc, mask=rows_m < N, other=0.0)
        b_s = tl.load(bs_ptrs + c * stride_bsc, mask=cols_n < K, other=0.0)
    return _scaled_dot(a, b, acc, a_s, b_s, BLOCKWISE, BLOCK_K, UPCAST, SPLIT_ACC)


@triton.jit(do_not_specialize=["T"])
def _wgrad_fp8_kernel(a_desc, b_desc, a_ptr, b_ptr, as_ptr, bs_ptr, out_ptr, offs_ptr, first_ptr,
                      T, N, K,
                      stride_an, stride_at, stride_bk, stride_bt,
                      stride_asn, stride_asc, stride_bsk, stride_bsc,
                      stride_oe, stride_on, stride_ok, stride_o,
                      BLOCKWISE: tl.constexpr, ADD_MODE: tl.constexpr, PTR_TABLE: tl.constexpr,
                      USE_TMA: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      SPLIT_ACC: tl.constexpr, L2_PREFETCH: tl.constexpr = False, FIRST: tl.constexpr = False):
    """dW_e[:N, :K] (+)= dy^T[:N, g] @ x^T[:K, g]^T over group e's tokens g; a = dy^T [N, T], b = x^T [K, T].
    ADD_MODE 0 fresh, 1 load-add-store, 3 fp32 atomics (one addend per element: deterministic). PTR_TABLE:
    ``out_ptr`` is a table of per-group bases. L2_PREFETCH: [Note: L2 prefetch of the accumulated tile]. FIRST:
    a nonzero int32 at ``first_ptr`` means ``out`` holds nothing yet ([Note: an unwritten accumulator])."""
    e, pid_m, pid_n, start, end = _wgrad_tile(offs_ptr, stride_o, N, K, T, BLOCK_M, BLOCK_N, GROUP_M)
    if ADD_MODE != 0:
        if _skips(end, start, first_ptr, FIRST):
            return
    base = _wgrad_out_base(out_ptr, e, stride_oe, PTR_TABLE)
    if L2_PREFETCH and ADD_MODE != 0:
        if _reads_out(first_ptr, FIRST):
            _prefetch_out_tile(base, pid_m * BLOCK_M, pid_n * BLOCK_N, N, K, stride_on, stride_ok, BLOCK_M,
                               BLOCK_N)
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    as_ptrs = as_ptr + rows_m.to(tl.int64) * stride_asn      # blockwise only
    bs_ptrs = bs_ptr + cols_n.to(tl.int64) * stride_bsk      # blockwise only
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Chunks on the global BLOCK_K (= L) grid, added in order ([Note: fp8 wgrad chunks]); an empty group
    # visits none (a masked chunk would still multiply zeros by its tile's scales, and a NaN scale of
    # another group's tile would leak in).
    first = tl.where(end > start, (start // BLOCK_K) * BLOCK_K, end)
    if USE_TMA:  # every chunk by TMA; the group's partial first and last chunks are masked in registers
        # ([Note: fp8 wgrad edges])
        body_lo = tl.cdiv(start, BLOCK_K) * BLOCK_K   # full chunks [body_lo, body_hi)
        body_hi = (end // BLOCK_K) * BLOCK_K
        if first < start:                            # head: the group starts mid-chunk
            acc = _wgrad_fp8_tma_chunk(a_desc, b_desc, as_ptrs, bs_ptrs, first, start, end, pid_m * BLOCK_M,
                                       pid_n * BLOCK_N, rows_m, cols_n, N, K, acc, stride_asc, stride_bsc,
                                       True, BLOCKWISE, BLOCK_K, UPCAST, SPLIT_ACC)
        for t0 in range(body_lo, body_hi, BLOCK_K):
            acc = _wgrad_fp8_tma_chunk(a_desc, b_desc, as_ptrs, bs_ptrs, t0, start, end, pid_m * BLOCK_M,
                                       pid_n * BLOCK_N, rows_m, cols_n, N, K, acc, stride_asc, stride_bsc,
                                       False, BLOCKWISE, BLOCK_K, UPCAST, SPLIT_ACC)
        if (body_hi < end) & (body_hi >= body_lo):   # tail, unless the head chunk already held it
            acc = _wgrad_fp8_tma_chunk(a_desc, b_desc, as_ptrs, bs_ptrs, body_hi, start, end, pid_m * BLOCK_M,
                                       pid_n * BLOCK_N, rows_m, cols_n, N, K, acc, stride_asc, stride_bsc,
                                       True, BLOCKWISE, BLOCK_K, UPCAST, SPLIT_ACC)
    else:
        for t0 in range(first, end, BLOCK_K):
            acc = _wgrad_fp8_chunk(a_ptr, b_ptr, as_ptrs, bs_ptrs, t0, start, end, rows_m, cols_n, N, K,
                                   acc, stride_an, stride_at, stride_bk, stride_bt, stride_asc, stride_bsc,
                                   BLOCKWISE, BLOCK_K, UPCAST, SPLIT_ACC)
    if not BLOCKWISE:  # an empty group keeps its zeros even under a NaN per-tensor scale
        acc = acc * tl.where(end > start, tl.load(as_ptr), 1.0) * tl.where(end > start, tl.load(bs_ptr), 1.0)
    _wgrad_write(acc, None, base, e, pid_m * BLOCK_M, pid_n * BLOCK_N, N, K, stride_on, stride_ok, first_ptr,
                 ADD_MODE, BLOCK_M, BLOCK_N, FIRST)
