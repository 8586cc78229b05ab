"""The Triton wgrad kernel of ``grouped_gemm`` (which holds its launcher, custom ops and public API) and the
tile helpers its kernels share: dW_e[:N, :K] (+)= dy[g, :N]^T @ x[g, :K] over the tokens g of group e, fp32
accumulation, one program per output tile, group-major, swizzled in bands of GROUP_M.

[Note: L2 prefetch of the accumulated tile]
Adding into fp32 ``main_grad`` reads each output tile from HBM only once its MMAs are done (a load, or an
L2 reduction that L2 must first fetch). ``TileConfig.l2_prefetch`` issues, before the main loop, one
``prefetch.global.L2::evict_last`` per 128-byte line of the tile (no registers, no reply awaited), so that
read streams while the MMAs run. The numbers are unchanged.
"""

import triton
import triton.language as tl

# ---------------------------------------------------------------------------------------------------
# Helpers shared by the fprop/dgrad, wgrad and FP8 wgrad kernels
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _swizzle(local, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Tile ``local`` of a tiles_m x tiles_n grid, in bands of GROUP_M rows (column-major per band)."""
    width = GROUP_M * tiles_n
    first_m = (local // width) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (local % width) % rows, (local % width) // rows


@triton.jit
def _wgrad_tile(offs_ptr, stride_o, N, K, T, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                GROUP_M: tl.constexpr):
    """This program's group ``e``, swizzled output tile and token range ``[start, end)`` (clamped into [0, T])."""
    tile = tl.program_id(0)
    tiles_m = tl.cdiv(N, BLOCK_M)
    tiles_n = tl.cdiv(K, BLOCK_N)
    e = tile // (tiles_m * tiles_n)
    pid_m, pid_n = _swizzle(tile % (tiles_m * tiles_n), tiles_m, tiles_n, GROUP_M)
    end = tl.minimum(tl.maximum(tl.load(offs_ptr + e * stride_o), 0), T)
    start = tl.minimum(tl.maximum(tl.load(offs_ptr + (e - 1) * stride_o, mask=e > 0, other=0), 0), T)
    return e, pid_m, pid_n, start, tl.maximum(end, start)


# ---------------------------------------------------------------------------------------------------
# Main loop and output addressing
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _wgrad_masked_step(dy_ptr, x_ptr, t0, end, rows_m, cols_n, N, K, acc,
                       stride_dt, stride_dn, stride_xt, stride_xk,
                       UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    ts = t0 + tl.arange(0, BLOCK_K)
    ts64 = ts.to(tl.int64)
    t_ok = ts < end
    g = tl.load(dy_ptr + ts64[:, None] * stride_dt + rows_m[None, :] * stride_dn,
                mask=t_ok[:, None] & (rows_m[None, :] < N), other=0.0)
    x = tl.load(x_ptr + ts64[:, None] * stride_xt + cols_n[None, :] * stride_xk,
                mask=t_ok[:, None] & (cols_n[None, :] < K), other=0.0)
    return _mma(g.T, x, acc, UPCAST, PRECISION)


@triton.jit
def _wgrad_mainloop(dy_desc, x_desc, dy_ptr, x_ptr, start, end, pid_m, pid_n, N, K,
                    stride_dt, stride_dn, stride_xt, stride_xk,
                    USE_TMA: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 tile dy[start:end, rows]^T @ x[start:end, cols]; TMA for full token blocks, the masked
    path for the last partial one (a descriptor cannot stop at a group's end)."""
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        t_tail = start + ((end - start) // BLOCK_K) * BLOCK_K
        for t0 in range(start, t_tail, BLOCK_K):
            g = dy_desc.load([t0, pid_m * BLOCK_M])
            x = x_desc.load([t0, pid_n * BLOCK_N])
            acc = _mma(g.T, x, acc, UPCAST, PRECISION)
        if t_tail < end:
            acc = _wgrad_masked_step(dy_ptr, x_ptr, t_tail, end, rows_m, cols_n, N, K, acc, stride_dt,
                                     stride_dn, stride_xt, stride_xk, UPCAST, PRECISION, BLOCK_K)
    else:
        for t0 in range(start, end, BLOCK_K):
            acc = _wgrad_masked_step(dy_ptr, x_ptr, t0, end, rows_m, cols_n, N, K, acc, stride_dt,
                                     stride_dn, stride_xt, stride_xk, UPCAST, PRECISION, BLOCK_K)
    return acc


@triton.jit
def _wgrad_out_base(out_ptr, e, stride_oe, PTR_TABLE: tl.constexpr):
    """Group e's output: the stacked ``out_ptr`` at e, or entry e of the int64 table of fp32 bases."""
    if PTR_TABLE:
        base = tl.load(out_ptr + e).to(tl.pointer_type(tl.float32))
    else:
        base = out_ptr + e.to(tl.int64) * stride_oe
    return base


@triton.jit
def _prefetch_out_tile(base, row0, col0, N, K, stride_on, stride_ok, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[Note: L2 prefetch of the accumulated tile], clamped to memory that exists. GPU only (inline PTX)."""
    LINES: tl.constexpr = BLOCK_N // 32  # 32 fp32 per line along K (the contiguous dimension)
    tl.static_assert(LINES >= 1, "the L2 prefetch needs tiles of >= 32 columns")
    rows = tl.minimum(row0 + tl.arange(0, BLOCK_M), N - 1)
    cols = tl.minimum(col0 + tl.arange(0, LINES) * 32, K - 1)
    ptrs = base + rows.to(tl.int64)[:, None] * stride_on + cols[None, :] * stride_ok
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wgrad_put(part, out_desc, base, e, row0, col0, N, K, stride_on, stride_ok,
               ADD_MODE: tl.constexpr, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """Writes (0), load-adds (1), atomically adds (3) or TMA-reduces (4) a part of group e's output tile."""
    if ADD_MODE == 4:  # rows and columns past N, K are dropped by the descriptor
        out_desc.atomic_add([e, row0, col0], tl.reshape(part, (1, BLOCK_M, WIDTH)))
    else:
        rows_m = row0 + tl.arange(0, BLOCK_M)
        cols = col0 + tl.arange(0, WIDTH)
        ptrs = base + rows_m.to(tl.int64)[:, None] * stride_on + cols[None, :] * stride_ok
        mask = (rows_m[:, None] < N) & (cols[None, :] < K)
        if ADD_MODE == 3:
            tl.atomic_add(ptrs, part, mask=mask, sem="relaxed")
        else:
            if ADD_MODE == 1:
                part += tl.load(ptrs, mask=mask, other=0.0)
            tl.store(ptrs, part.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _wgrad_write(part, out_desc, base, e, row0, col0, N, K, stride_on, stride_ok, first_ptr,
                 ADD_MODE: tl.constexpr, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr, FIRST: tl.constexpr):
    """Both Triton wgrads' epilogue: ``_wgrad_put`` in ADD_MODE, or a plain write while FIRST's flag is set."""
    if FIRST:
        if tl.load(first_ptr) != 0:
            _wgrad_put(part, out_desc, base, e, row0, col0, N, K, stride_on, stride_ok, 0, BLOCK_M, WIDTH)
        else:
            _wgrad_put(part, out_desc, base, e, row0, col0, N, K, stride_on, stride_ok, ADD_MODE, BLOCK_M, WIDTH)
    else:
        _wgrad_put(part, out_desc, base, e, row0, col0, N, K, stride_on, stride_ok, ADD_MODE, BLOCK_M, WIDTH)


@triton.jit
def _skips(end, start, first_ptr, FIRST: tl.constexpr):
    """Whether an accumulating tile writes nothing: an empty group, unless FIRST's flag says ``out`` is unwritten."""
    skips = end == start
    if FIRST:
        skips = skips & (tl.load(first_ptr) == 0)
    return skips


@triton.jit
def _reads_out(first_ptr, FIRST: tl.constexpr):
    """Whether the old tile will be read (for the L2 prefetch): not when the flag says it holds nothing."""
    reads = True
    if FIRST:
        reads = tl.load(first_ptr) == 0
    return reads


# ---------------------------------------------------------------------------------------------------
# The wgrad kernel: one program per tile
# ---------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["T"])
def _wgrad_kernel(dy_desc, x_desc, out_desc, dy_ptr, x_ptr, out_ptr, offs_ptr, first_ptr,
                  T, N, K,
                  stride_dt, stride_dn, stride_xt, stride_xk,
                  stride_oe, stride_on, stride_ok, stride_o,
                  ADD_MODE: tl.constexpr, PTR_TABLE: tl.constexpr, USE_TMA: tl.constexpr,
                  UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, L2_PREFETCH: tl.constexpr = False, FIRST: tl.constexpr = False):
    """dW_e[:N, :K] (+)= dy[g, :N]^T @ x[g, :K]; ``out_ptr`` is the stacked output or, with PTR_TABLE, an int64
    table of per-group fp32 bases. ADD_MODE: 0 writes fresh; 1 load-adds after the main loop, 3 sends fp32
    reductions to L2 (deterministic: one addend per element), 4 one TMA bulk reduction per tile (GPU only).
    L2_PREFETCH: [Note: L2 prefetch of the accumulated tile]. FIRST: while the int32 at ``first_ptr`` is not 0,
    ``out`` holds nothing and is written ([Note: an unwritten accumulator] in ``distwgrad/weights/first_write.py``)."""
    e, pid_m, pid_n, start, end = _wgrad_tile(offs_ptr, stride_o, N, K, T, BLOCK_M, BLOCK_N, GROUP_M)
    if ADD_MODE != 0:
        if _skips(end, start, first_ptr, FIRST):
            return
    base = _wgrad_out_base(out_ptr, e, stride_oe, PTR_TABLE)
    if L2_PREFETCH and ADD_MODE != 0:
        if _reads_out(first_ptr, FIRST):
            _prefetch_out_tile(base, pid_m * BLOCK_M, pid_n * BLOCK_N, N, K, stride_on, stride_ok, BLOCK_M,
                               BLOCK_N)
    acc = _wgrad_mainloop(dy_desc, x_desc, dy_ptr, x_ptr, start, end, pid_m, pid_n, N, K, stride_dt,
                          stride_dn, stride_xt, stride_xk, USE_TMA, UPCAST, PRECISION, BLOCK_M, BLOCK_N,
                          BLOCK_K)
    _wgrad_write(acc, out_desc, base, e, pid_m * BLOCK_M, pid_n * BLOCK_N, N, K, stride_on, stride_ok, first_ptr,
                 ADD_MODE, BLOCK_M, BLOCK_N, FIRST)
