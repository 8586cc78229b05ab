"""Tile placement over ragged token groups whose offsets stay on the device, the TMA operand ring, the
epilogue's wide stores and the zeroing of a chunk's foreign tokens, shared by ``grouped_gemm_fp8.py`` and
``grouped_wgrad_fp8.py``.

Tiles are group-major (group e owns cdiv(tokens_e, BLOCK_M) * cdiv(N, BLOCK_N) consecutive numbers, swizzled
inside the group by ``_grouped_wgrad._swizzle``). A persistent program's tiles only grow, so it walks a cursor
forward (``cursor``) instead of searching every group per tile. Offsets are clamped into [0, T] and a decreasing
offset gives an empty group, as in ``_grouped_ragged._find_group``."""

from .._grouped_wgrad import _swizzle  # (a scalar Triton helper: Gluon calls it as it is)
from . import (
    REINTERPRET,
    aggregate,
    constexpr_function,
    fence_async_shared,
    field,
    gl,
    gluon,
    mbarrier,
    thread_barrier,
    tma,
)

__all__ = ["Ring", "WgradSchedule", "cursor", "group", "origin", "store_rows", "tile", "total_tiles", "wgrad_tile",
           "zero_edges"]

_Scalar = gl.tensor | gl.constexpr  # an int argument: a constexpr where the JIT specializes it (a 1)


@aggregate
class Ring:
    """NUM_STAGES shared-memory stages of A and B filled by TMA, each with a ``ready`` (loads landed) and an ``empty``
    mbarrier (MMAs done: refill allowed); ring step g uses stage g % NUM_STAGES in round g // NUM_STAGES."""

    a_desc: tma.tensor_descriptor
    b_desc: tma.tensor_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    a_bufs: gl.shared_memory_descriptor
    b_bufs: gl.shared_memory_descriptor
    NUM_STAGES: gl.constexpr

    @constexpr_function
    def __init__(self, a_desc, b_desc, ready, empty, a_bufs, b_bufs, NUM_STAGES):
        self.a_desc = field(a_desc)
        self.b_desc = field(b_desc)
        self.ready = field(ready)
        self.empty = field(empty)
        self.a_bufs = field(a_bufs)
        self.b_bufs = field(b_bufs)
        self.NUM_STAGES = field(NUM_STAGES)

    @gluon.jit
    def wait_ready(self, g):
        """Ring step g's stage, once its loads have landed."""
        s = g % self.NUM_STAGES
        mbarrier.wait(self.ready.index(s), (g // self.NUM_STAGES) & 1)
        return s

    @gluon.jit
    def wait_empty(self, g):
        """Until ring step g's stage is handed back (a fresh mbarrier counts as released in round 0)."""
        mbarrier.wait(self.empty.index(g % self.NUM_STAGES), ((g // self.NUM_STAGES) & 1) ^ 1)

    @gluon.jit
    def release(self, g):
        """Ring step g's stage back to the TMA warp (its MMAs are done)."""
        mbarrier.arrive(self.empty.index(g % self.NUM_STAGES), count=1)


@aggregate
class WgradSchedule:
    """A persistent wgrad program's tiles pid, pid + nprog, ... < total, group-major over each group's [N, K] tiles."""

    offs_ptr: gl.tensor
    stride_o: _Scalar
    T: _Scalar
    N: _Scalar
    K: _Scalar
    pid: gl.tensor
    total: gl.tensor
    nprog: gl.tensor
    GROUP_M: gl.constexpr

    @constexpr_function
    def __init__(self, offs_ptr, stride_o, T, N, K, pid, total, nprog, GROUP_M):
        self.offs_ptr = field(offs_ptr)
        self.stride_o = field(stride_o)
        self.T = field(T)
        self.N = field(N)
        self.K = field(K)
        self.pid = field(pid)
        self.total = field(total)
        self.nprog = field(nprog)
        self.GROUP_M = field(GROUP_M)


@gluon.jit
def total_tiles(offs_ptr, stride_o, E, T, tiles_n, BLOCK_M: gl.constexpr, BLOCK_E: gl.constexpr,
                num_warps: gl.constexpr):
    """The tiles of all groups (``_grouped_ragged._find_group``'s total, without the search)."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    eidx = gl.arange(0, BLOCK_E, layout=lay)
    ends = gl.minimum(gl.maximum(gl.load(offs_ptr + eidx * stride_o, mask=eidx < E, other=0), 0), T)
    starts = gl.load(offs_ptr + (eidx - 1) * stride_o, mask=(eidx > 0) & (eidx < E), other=0)
    starts = gl.minimum(gl.maximum(starts, 0), T)
    return gl.sum(gl.cdiv(gl.maximum(ends - starts, 0), BLOCK_M) * tiles_n, axis=0)


@gluon.jit
def group(offs_ptr, stride_o, T, e):
    """Group e's first token and token count."""
    end = gl.minimum(gl.maximum(gl.load(offs_ptr + e * stride_o), 0), T)
    start = gl.minimum(gl.maximum(gl.load(offs_ptr + (e - 1) * stride_o, mask=e > 0, other=0), 0), T)
    return start, gl.maximum(end - start, 0)


@gluon.jit
def cursor(offs_ptr, stride_o, T, e, first, tile, tiles_n, BLOCK_M: gl.constexpr):
    """(group, its first tile, first token, tokens) of ``tile``, walking forward from group e's first tile ``first``."""
    start, size = group(offs_ptr, stride_o, T, e)
    n = gl.cdiv(size, BLOCK_M) * tiles_n
    while first + n <= tile:
        first += n
        e += 1
        start, size = group(offs_ptr, stride_o, T, e)
        n = gl.cdiv(size, BLOCK_M) * tiles_n
    return e, first, start, size


@gluon.jit
def origin(e, local, start, size, N, W_ROWS, GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr,
           BLOCK_N: gl.constexpr):
    """Group e's tile ``local``: its first row, first column and first row of B (``e * W_ROWS`` + column)."""
    pid_m, pid_n = _swizzle(local, gl.cdiv(size, BLOCK_M), gl.cdiv(N, BLOCK_N), GROUP_M)
    col0 = pid_n * BLOCK_N
    return start + pid_m * BLOCK_M, col0, e * W_ROWS + col0


@gluon.jit
def tile(e, local, start, size, N, W_ROWS, mma: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr,
         BLOCK_N: gl.constexpr):
    """``origin`` plus (rows, columns, their masks, e as int64), vectors in the slices of ``mma``."""
    row0, col0, brow0 = origin(e, local, start, size, N, W_ROWS, GROUP_M, BLOCK_M, BLOCK_N)
    rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
    cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    return row0, col0, brow0, rows, cols, rows < start + size, cols < N, e.to(gl.int64)


@gluon.jit
def store_rows(out_ptr, acc, row0, col0, row_end, N, stride_ot, stride_on, mma: gl.constexpr):
    """Store the fp32 tile ``acc`` at (row0, col0) in the output's dtype, masked to rows below
    ``row_end`` and columns below N, as 16-byte rows ([Note: the epilogue's wide stores])."""
    BLOCK_M: gl.constexpr = acc.type.shape[0]
    BLOCK_N: gl.constexpr = acc.type.shape[1]
    WARPS: gl.constexpr = mma.warps_per_cta[0]
    TN: gl.constexpr = 32 if BLOCK_N >= 256 else BLOCK_N // 8  # threads of a warp along one row
    st: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TN, TN], [WARPS, 1], [1, 0])
    out = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), st)
    rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st))
    cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, st))
    o_ptrs = out_ptr + rows.to(gl.int64)[:, None] * stride_ot + cols[None, :] * stride_on
    gl.store(o_ptrs, out, mask=(rows < row_end)[:, None] & (cols < N)[None, :])


@gluon.jit
def token_mask(t0, lo, hi, WARPS: gl.constexpr):
    """Byte masks keeping tokens [lo, hi) of a chunk (tokens t0 .. t0 + 127) of [rows, 128] fp8,
    128-byte swizzled, seen as [rows * 8, 4] int32: unit u holds row u // 8's tokens ((u % 8) ^ (u // 8 % 8)) * 16
    .. + 15, little-endian. One unit per thread; a pass of 32 * WARPS units is whole swizzle periods, so one mask
    serves every pass over both operands ([Note: a group's edge chunks in shared memory])."""
    CH: gl.constexpr = 32 * WARPS
    gl.static_assert(CH % 64 == 0, "a pass covers whole periods of the 128-byte swizzle")
    lay: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [WARPS, 1], [1, 0])
    u = gl.arange(0, CH, layout=gl.SliceLayout(1, lay))
    w = gl.arange(0, 4, layout=gl.SliceLayout(0, lay))
    tok = t0 + ((u % 8) ^ (u // 8 % 8))[:, None] * 16 + w[None, :] * 4  # each word's first token
    d = lo - tok  # leading bytes outside (<= 0: none, >= 4: all)
    c = hi - tok  # bytes inside from the word's start (>= 4: all, <= 0: none)
    head = gl.where(d <= 0, -1, gl.where(d >= 4, 0, -1 << (gl.minimum(gl.maximum(d, 1), 3) * 8)))
    tail = gl.where(c >= 4, -1, gl.where(c <= 0, 0, (1 << (gl.minimum(gl.maximum(c, 1), 3) * 8)) - 1))
    return head & tail


@gluon.jit
def mask_tokens(bufs, s, mask, WARPS: gl.constexpr):
    """And stage ``s`` of [rows, 128] fp8 chunks with ``mask`` (``token_mask``), 32 * WARPS units a pass."""
    ROWS: gl.constexpr = bufs.type.shape[1]
    gl.static_assert(bufs.type.shape[2] == 128, "one 128-byte line per row (the swizzle's unit)")
    UNITS: gl.constexpr = ROWS * 8
    CH: gl.constexpr = 32 * WARPS
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    lay: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [WARPS, 1], [1, 0])
    if REINTERPRET:
        raw = bufs.index(s).reinterpret(gl.int32, [UNITS, 4], plain)
    else:
        raw = bufs.index(s)._reinterpret(gl.int32, [UNITS, 4], plain)
    for u0 in gl.static_range(0, UNITS, CH):
        view = raw.slice(u0, CH)
        view.store(view.load(lay) & mask)


@gluon.jit
def zero_edges(a_bufs, b_bufs, s, t0, lo, hi, WARPS: gl.constexpr):
    """If stage ``s``'s chunk (tokens t0 .. t0 + 127) straddles the group's [lo, hi), zero both operands'
    other tokens, fence for the MMA (async proxy) and sync the partition's warps."""
    if (t0 < lo) | (t0 + a_bufs.type.shape[2] > hi):
        mask = token_mask(t0, lo, hi, WARPS)
        mask_tokens(a_bufs, s, mask, WARPS)
        mask_tokens(b_bufs, s, mask, WARPS)
        fence_async_shared()
        thread_barrier()


@gluon.jit
def wgrad_tile(tile, sched, tiles_m, tiles_n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """Wgrad tile ``tile``: (group, first row of N, first column of K, the group's first and end token,
    the first chunk's token on the BLOCK_K grid, the chunks)."""
    per_group = tiles_m * tiles_n
    e = tile // per_group
    pid_m, pid_n = _swizzle(tile % per_group, tiles_m, tiles_n, sched.GROUP_M)
    start, size = group(sched.offs_ptr, sched.stride_o, sched.T, e)
    end = start + size
    first = (start // BLOCK_K) * BLOCK_K
    n_k = gl.where(size > 0, gl.cdiv(end - first, BLOCK_K), 0)
    return e, pid_m * BLOCK_M, pid_n * BLOCK_N, start, end, first, n_k
