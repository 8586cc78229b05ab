"""The fprop/dgrad Triton kernels of ``grouped_gemm`` (ragged M): ``out[g] = a[g] @ B_e`` for the tokens g of
every group e, one program per output tile, tiles ordered group-major; the launcher (``grouped_gemm
._launch_ragged``), the legend and the scheduling are in ``grouped_gemm``'s docstring. ``_find_group`` (a
tile's group by a prefix sum over the offsets) serves the FP8 fprop/dgrad kernel too.
"""

import triton
import triton.language as tl

from ._grouped_wgrad import _mma, _swizzle


@triton.jit
def _tiles_m(size, BLOCK_M: tl.constexpr, WIDE_TAIL: tl.constexpr):
    """M tiles of a group of ``size`` rows; ``WIDE_TAIL``: a last remainder of BLOCK_M / 2 rows or fewer
    joins the tile before it ([Note: wide tail tiles])."""
    if WIDE_TAIL:
        return tl.where(size > 0, tl.maximum(tl.cdiv(size - BLOCK_M // 2, BLOCK_M), 1), 0)
    return tl.cdiv(size, BLOCK_M)


@triton.jit
def _find_group(offs_ptr, stride_o, E, T, pid, tiles_n, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                WIDE_TAIL: tl.constexpr = False):
    """(group, tile within it, first token, tokens, total tiles) for tile ``pid``; offsets clamped."""
    eidx = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + eidx * stride_o, mask=eidx < E, other=0)
    starts = tl.load(offs_ptr + (eidx - 1) * stride_o, mask=(eidx > 0) & (eidx < E), other=0)
    ends = tl.minimum(tl.maximum(ends, 0), T)
    starts = tl.minimum(tl.maximum(starts, 0), T)
    sizes = tl.maximum(ends - starts, 0)
    tiles = _tiles_m(sizes, BLOCK_M, WIDE_TAIL) * tiles_n
    done = tl.cumsum(tiles, 0) <= pid
    this = eidx == tl.sum(done.to(tl.int32), 0)
    e = tl.sum(done.to(tl.int32), 0)
    local = pid - tl.sum(tl.where(done, tiles, 0), 0)
    start = tl.sum(tl.where(this, starts, 0), 0)
    size = tl.sum(tl.where(this, sizes, 0), 0)
    return e, local, start, size, tl.sum(tiles, 0)


# [Note: half tail tiles]
# A group's tokens rarely fill its last M tile. At ~128 tokens per expert (E=128 of the benchmark: 128 +- 11
# under random routing) every other group spills a few rows into a second 128-row tile, and that tile costs
# as many MMAs as a full one: a third of the launch's tiles compute mostly rows that are masked at the
# store. With ``TileConfig.half_tail`` a tile with BLOCK_M / 2 rows or fewer runs the same loop at half
# height (its own TMA descriptor of [BLOCK_M / 2, BLOCK_K] x rows; the weight tile is unchanged), so it
# issues half the MMAs (m64n128 per warpgroup instead of m64n256 at 128x256x64/w8). Both loops are
# compiled into one kernel and the branch is uniform per program; they share one shared-memory ring
# (sm_90a: 196,640 bytes with or without the half loop) and neither spills. The products and their K order
# are the same, so the bits match full-height tiles (GPU test). The grid is unchanged: a half tile is still
# one program. H200, one process, medians of three interleaved rounds (docs/benchmarks.md): E=128 fprop
# 331 vs 319 TFLOP/s, dgrad 331 vs 312; at 1024 and 4096 tokens per group the few half tiles change
# nothing measurable (E=64 fprop 630 vs 634, dgrad 591 vs 586). No tile beat the default with it (round 9
# of docs/benchmarks/LOG.md).


# [Note: wide tail tiles]
# Half tail tiles still cost a program and a full read of the weight tile for at most BLOCK_M / 2 rows, and at
# ~128 tokens per expert a third of the launch's tiles are such tails. The E=128 shape is bound by its memory
# streams (Nsight Compute, H200: DRAM 70% and L2 84-89% of peak; docs/benchmarks.md), so the weight read
# matters more than the MMAs. With ``TileConfig.wide_tail`` a remainder of BLOCK_M / 2 rows or fewer joins
# the group's tile before it (``_tiles_m``): that program runs 1.5 BLOCK_M rows, a BLOCK_M-row and a
# BLOCK_M / 2-row product against each weight stage it loads once (``_ragged_wide_tile``; the second through
# the half-height descriptor). A group of one such remainder only (<= BLOCK_M / 2 tokens) keeps its half tile.
# At E=128 the launch loses its 195 tail tiles (579 -> 384 programs), the weight tiles cross L2 once per
# (expert, column) instead of up to twice, and the wave count drops from 4.4 to 2.9. The products and their
# K order are those of full-height tiles, so the bits match (GPU test). The wide loop lifts the kernel's
# registers (sm_90a, 128x256x64/w8: 218 against 154, no spills) and its ring (229,408 bytes at s4), and the
# build that has it runs every full tile slower (H200: 0.61-0.95x at 256-4096 tokens per group). Triton 3.6's
# ptxas serializes that build's wgmma pipeline (C7515), but that is not the whole cause: a build that ran a
# wide tile as the full tile's loop and then the half tile's had no C7515 and ran full tiles as slowly (and
# E=128 at 270 TFLOP/s; docs/benchmarks.md). So ``pick_ragged`` turns it on only where the groups average
# GroupedGemmTuning.wide_tail_max_tokens tokens or fewer. H200, one process, medians of three interleaved rounds
# (docs/benchmarks.md, "Wide tail tiles"): E=128 fprop 347 vs 324 TFLOP/s, dgrad 351 vs 324.


@triton.jit
def _ragged_tile(a_desc, w_desc, a_ptr, w_ptr, out_ptr, bias_ptr, e, row0, row_end, col0, N, K, W_ROWS,
                 stride_at, stride_ak, stride_we, stride_bk, stride_bn, stride_ot, stride_on, stride_be, stride_bn_bias,
                 W_TRANS: tl.constexpr, HAS_BIAS: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr,
                 PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One output tile: out[row0 : row0 + BLOCK_M (rows < row_end), col0 : col0 + BLOCK_N] of group e."""
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    rows_ok = rows < row_end
    rows64 = rows.to(tl.int64)
    e64 = e.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        # Rows past the group (next group's tokens) and columns past N only feed outputs that are
        # masked at the store; K past the end is zero-filled by the descriptor.
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([row0, k0])
            if W_TRANS:
                b = w_desc.load([e * W_ROWS + col0, k0]).T
            else:
                b = w_desc.load([e * W_ROWS + k0, col0])
            acc = _mma(a, b, acc, UPCAST, PRECISION)
    else:
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows64[:, None] * stride_at + ks[None, :] * stride_ak
        b_ptrs = w_ptr + e64 * stride_we + ks[:, None] * stride_bk + cols.to(tl.int64)[None, :] * stride_bn
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs, mask=rows_ok[:, None] & (ks[None, :] < K - k0), other=0.0)
            b = tl.load(b_ptrs, mask=(ks[:, None] < K - k0) & (cols[None, :] < N), other=0.0)
            acc = _mma(a, b, acc, UPCAST, PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        bias = tl.load(bias_ptr + e64 * stride_be + cols * stride_bn_bias, mask=cols < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    o_ptrs = out_ptr + rows64[:, None] * stride_ot + cols[None, :] * stride_on
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=rows_ok[:, None] & (cols[None, :] < N))


@triton.jit
def _ragged_store(acc, out_ptr, bias_ptr, e64, row0, row_end, col0, N, stride_ot, stride_on, stride_be, stride_bn_bias,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A wide tile's epilogue for one of its two products: bias, cast, store of rows row0 .. row0 + BLOCK_M
    below row_end, columns below N. (``_ragged_tile`` keeps the same lines inline: called from there, this
    helper made ptxas serialize the full tile's wgmma pipeline under Triton 3.6; [Note: wide tail tiles].)"""
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + e64 * stride_be + cols * stride_bn_bias, mask=cols < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + cols[None, :] * stride_on
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < row_end)[:, None] & (cols[None, :] < N))


@triton.jit
def _ragged_wide_tile(a_desc, a_half_desc, w_desc, a_ptr, w_ptr, out_ptr, bias_ptr, e, row0, row_end, col0, N, K,
                      W_ROWS, stride_at, stride_ak, stride_we, stride_bk, stride_bn, stride_ot, stride_on, stride_be,
                      stride_bn_bias, W_TRANS: tl.constexpr, HAS_BIAS: tl.constexpr, USE_TMA: tl.constexpr,
                      UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """A group's last tile with the remainder it absorbed: rows row0 .. row0 + 1.5 BLOCK_M (below row_end)
    as a BLOCK_M-row and a BLOCK_M / 2-row product that share each weight stage ([Note: wide tail tiles])."""
    HALF: tl.constexpr = BLOCK_M // 2
    e64 = e.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((HALF, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([row0, k0])
            a2 = a_half_desc.load([row0 + BLOCK_M, k0])
            if W_TRANS:
                b = w_desc.load([e * W_ROWS + col0, k0]).T
            else:
                b = w_desc.load([e * W_ROWS + k0, col0])
            acc = _mma(a, b, acc, UPCAST, PRECISION)
            acc2 = _mma(a2, b, acc2, UPCAST, PRECISION)
    else:
        rows = row0 + tl.arange(0, BLOCK_M)
        rows2 = row0 + BLOCK_M + tl.arange(0, HALF)
        cols = col0 + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_at + ks[None, :] * stride_ak
        a2_ptrs = a_ptr + rows2.to(tl.int64)[:, None] * stride_at + ks[None, :] * stride_ak
        b_ptrs = w_ptr + e64 * stride_we + ks[:, None] * stride_bk + cols.to(tl.int64)[None, :] * stride_bn
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=(rows < row_end)[:, None] & k_ok[None, :], other=0.0)
            a2 = tl.load(a2_ptrs, mask=(rows2 < row_end)[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & (cols[None, :] < N), other=0.0)
            acc = _mma(a, b, acc, UPCAST, PRECISION)
            acc2 = _mma(a2, b, acc2, UPCAST, PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            a2_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    _ragged_store(acc, out_ptr, bias_ptr, e64, row0, row_end, col0, N, stride_ot, stride_on, stride_be,
                  stride_bn_bias, HAS_BIAS, BLOCK_M, BLOCK_N)
    _ragged_store(acc2, out_ptr, bias_ptr, e64, row0 + BLOCK_M, row_end, col0, N, stride_ot, stride_on, stride_be,
                  stride_bn_bias, HAS_BIAS, HALF, BLOCK_N)


@triton.jit(do_not_specialize=["T", "E"])  # token and group counts change per step: one compile
def _ragged_m_kernel(a_desc, a_half_desc, w_desc, a_ptr, w_ptr, out_ptr, bias_ptr, offs_ptr,
                     T, E, N, K, W_ROWS,
                     stride_at, stride_ak, stride_we, stride_bk, stride_bn,
                     stride_ot, stride_on, stride_be, stride_bn_bias, stride_o,
                     W_TRANS: tl.constexpr, HAS_BIAS: tl.constexpr, USE_TMA: tl.constexpr,
                     UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr, HALF_TAIL: tl.constexpr,
                     WIDE_TAIL: tl.constexpr = False):
    """out[t, :N] = a[t, :K] @ B_e for the tokens t of group e; B_e = W_e^T (fprop) or W_e (dgrad).
    ``HALF_TAIL``: a group's last M tile with BLOCK_M / 2 rows or fewer runs at half height ([Note: half
    tail tiles]); ``WIDE_TAIL``: such a remainder joins the tile before it, where there is one ([Note:
    wide tail tiles])."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    e, local, start, size, total = _find_group(offs_ptr, stride_o, E, T, pid, tiles_n, BLOCK_M, BLOCK_E, WIDE_TAIL)
    if pid >= total:
        return
    pid_m, pid_n = _swizzle(local, _tiles_m(size, BLOCK_M, WIDE_TAIL), tiles_n, GROUP_M)
    row0 = start + pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N
    if WIDE_TAIL and size - pid_m * BLOCK_M > BLOCK_M:
        _ragged_wide_tile(a_desc, a_half_desc, w_desc, a_ptr, w_ptr, out_ptr, bias_ptr, e, row0, start + size, col0,
                          N, K, W_ROWS, stride_at, stride_ak, stride_we, stride_bk, stride_bn, stride_ot, stride_on,
                          stride_be, stride_bn_bias, W_TRANS, HAS_BIAS, USE_TMA, UPCAST, PRECISION, BLOCK_M, BLOCK_N,
                          BLOCK_K)
    elif HALF_TAIL and size - pid_m * BLOCK_M <= BLOCK_M // 2:
        _ragged_tile(a_half_desc, w_desc, a_ptr, w_ptr, out_ptr, bias_ptr, e, row0, start + size, col0, N, K, W_ROWS,
                     stride_at, stride_ak, stride_we, stride_bk, stride_bn, stride_ot, stride_on, stride_be,
                     stride_bn_bias, W_TRANS, HAS_BIAS, USE_TMA, UPCAST, PRECISION, BLOCK_M // 2, BLOCK_N, BLOCK_K)
    else:
        _ragged_tile(a_desc, w_desc, a_ptr, w_ptr, out_ptr, bias_ptr, e, row0, start + size, col0, N, K, W_ROWS,
                     stride_at, stride_ak, stride_we, stride_bk, stride_bn, stride_ot, stride_on, stride_be,
                     stride_bn_bias, W_TRANS, HAS_BIAS, USE_TMA, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
