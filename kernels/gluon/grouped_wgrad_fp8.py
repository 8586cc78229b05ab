"""FP8 wgrad over ragged token groups in Gluon: the products of ``grouped_gemm_fp8._wgrad_fp8_kernel`` (the
same bits), with each 128-token partial added to the fp32 sum while the next chunk's MMAs run.

[Note: fp8 wgrad under the next MMA]
Triton's FP8 wgrad waits for each 128-token chunk's MMAs before its promoting add, idling the tensor cores. This
kernel runs the fprop/dgrad loop ([Note: promotion under the next MMA]) over wgrad tiles: a = dy^T [N, T], b =
x^T [K, T] (fp8, tokens innermost), chunks on the global 128-token grid, so its partials and their order are the
Triton kernel's. Persistent and warp-specialized: a TMA warp fills the ring; the MMA warps zero edge chunks'
foreign tokens, run the loop and scale; two epilogue warps write the tile ([Note: an epilogue partition];
EPI_WARPS = 0: the MMA warps), after the next tile's first chunk ([Note: the next tile's first step under the
epilogue]).

[Note: a group's edge chunks in shared memory]
A chunk straddling a group edge holds other groups' tokens, which must count as zeros (they may be NaN). A TMA
box cannot stop at the edge, so the MMA warps zero those tokens of both operands in shared memory after the
chunk lands (``tiles.zero_edges``), fence for the async proxy and sync before its MMAs. Only a group's first and
last chunks can be edge chunks. Why the MMA warps do it: docs/benchmarks/LOG.md.

[Note: an epilogue partition]
A tile's fp32 epilogue takes about as long as its MMAs, so with EPI_WARPS = 2 the MMA warps hand the scaled tile
over in a shared-memory buffer and two epilogue warps (in the TMA warp's warpgroup: the MMA warps keep 232
registers) write it, EPI_ROWS rows at a time, under the next tile's MMAs; handing off tile i + 1 waits until tile
i has been read. The buffer's swizzle makes both sides bank-conflict-free. Both partitions agree on which tiles
write (``_writes``), so every handoff has its reader.

[Note: a 16-bit handoff]
A fresh bf16 / fp16 output is rounded before the handoff, not after (the same conversion: the same bits), so
the tile handed off is 32 KB, not 64, and a sixth ring stage fits (``wgrad_gluon_stages_16``).

[Note: blockwise wgrad scales]
Blockwise (1x128 along the tokens: dy^T's scales [N, chunks], x^T's [K, chunks]), each partial is scaled before
its add, ``acc + part * (a_s[:, None] * b_s[None, :])``: the Triton kernel's bits. Row scales load a step ahead,
as in fprop. A thread's 32 column scales would spill the loop's registers, so the TMA warp copies each chunk's
into a ring of shared-memory slots (``cp.async``, counted by the stage's ``ready`` barrier); the launcher pads
x^T's to [chunks, K rounded up to 128] so each copy is one aligned 16-byte unit. One slot more than stages: a
step hands its stage back before reading the previous chunk's scales (one barrier a step), and the refill
overwrites an already-read slot. The slots cost a stage: four stages (``wgrad_gluon_stages_blockwise``).

[Note: tracing the MMA warps' tile phases]
TRACE (``launch(..., trace=)``) has the MMA warps store ``%clock64`` at four points of each tile (loop top, first
chunk issued, previous tile flushed, last chunk done) and its chunk count; off, none of it is built. A traced
dry run (ADD_MODE -1) writes nothing and may skip the edge zeroing (ZERO_EDGES = False) to time it.

Preconditions (``grouped_gemm_fp8._gluon_wgrad`` checks them): Hopper, Gluon, T a multiple of 16, per-tensor
split accumulator or blockwise 1x128, a stacked [E, N, K] output (fp32; 16-bit when fresh) or a table of fp32
bases (PTR_TABLE). T tokens, N out-, K in-features, E groups."""

from . import (
    AVAILABLE,
    aggregate,
    constexpr_function,
    descriptor,
    field,
    gl,
    gluon,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from . import REINTERPRET as _REINTERPRET
from . import WS_PAIRS as _WS_PAIRS
from . import async_load as _async_load
from . import async_mbarrier_arrive as _async_arrive
from . import thread_barrier as _thread_barrier
from . import tma_load as _tma_load
from .grouped_gemm_fp8 import Chunks, Scales, _accumulate, _begin
from .tiles import Ring, WgradSchedule
from .tiles import wgrad_tile as _tile
from .tiles import zero_edges as _zero_edges
from .wgrad_epilogue import Handoff, Out
from .wgrad_epilogue import epilogue as _epilogue
from .wgrad_epilogue import flush as _flush
from .wgrad_epilogue import unwritten as _unwritten

__all__ = ["AVAILABLE", "BLOCK", "wgrad_kernel", "descriptor"]

BLOCK = 128  # BLOCK_M = BLOCK_N = BLOCK_K (the token chunk: the promotion interval)
EPI_ROWS = 8   # rows of the handed-off tile the epilogue warps write per step ([Note: an epilogue partition])
EPI_REGS = 40  # registers per epilogue thread: what the MMA warps' 232 leave in 64K (it shares the TMA warp's
#                warpgroup)
_Scalar = gl.tensor | gl.constexpr  # an int argument: a constexpr where the JIT specializes it (a 1)


@aggregate
class BlockScales:
    """With BLOCKWISE, the scales of [Note: blockwise wgrad scales]: dy^T's [N, chunks], x^T's [K, chunks]."""

    as_ptr: gl.tensor
    bs_ptr: gl.tensor
    stride_asn: _Scalar
    stride_asc: _Scalar
    stride_bsk: _Scalar
    stride_bsc: _Scalar
    BLOCKWISE: gl.constexpr

    @constexpr_function
    def __init__(self, as_ptr, bs_ptr, stride_asn, stride_asc, stride_bsk, stride_bsc, BLOCKWISE):
        self.as_ptr = field(as_ptr)
        self.bs_ptr = field(bs_ptr)
        self.stride_asn = field(stride_asn)
        self.stride_asc = field(stride_asc)
        self.stride_bsk = field(stride_bsk)
        self.stride_bsc = field(stride_bsc)
        self.BLOCKWISE = field(BLOCKWISE)


@aggregate
class ColumnScaleSlots:
    """The ring of chunks' column scales, ``bufs`` [slots, BLOCK_N] fp32 ([Note: blockwise wgrad scales]);
    MMA_ORDER where registers allow it (with epilogue warps, no load-add-store), else the columns' own order."""

    bufs: gl.shared_memory_descriptor
    MMA_ORDER: gl.constexpr

    @constexpr_function
    def __init__(self, bufs, MMA_ORDER):
        self.bufs = field(bufs)
        self.MMA_ORDER = field(MMA_ORDER)

    @gluon.jit
    def slot(self, g):
        """Ring step ``g``'s slot. MMA_ORDER permutes offset bits (0, 3, 1, 2, ...) so that an MMA
        thread's columns 8j + 2q + {0, 1} of n8 blocks 2J and 2J + 1 are 16 contiguous bytes: 8 loads, not 16."""
        BLOCK_N: gl.constexpr = self.bufs.type.shape[1]
        view = self.bufs.index(g % self.bufs.type.shape[0])
        if self.MMA_ORDER:
            gl.static_assert(BLOCK_N == 128, "the order is that of a 128-column wgmma tile")
            order: gl.constexpr = gl.SharedLinearLayout([[1], [8], [2], [4], [16], [32], [64]])
            if _REINTERPRET:
                view = view.reinterpret(gl.float32, [BLOCK_N], order)
            else:
                view = view._reinterpret(gl.float32, [BLOCK_N], order)
        return view


@aggregate
class Trace:
    """With TRACE, ``trace_ptr`` [programs, TRACE_TILES, 5] ([Note: tracing the MMA warps' tile phases])."""

    trace_ptr: gl.tensor
    TRACE_TILES: _Scalar
    TRACE: gl.constexpr

    @constexpr_function
    def __init__(self, trace_ptr, TRACE_TILES, TRACE):
        self.trace_ptr = field(trace_ptr)
        self.TRACE_TILES = field(TRACE_TILES)
        self.TRACE = field(TRACE)


@gluon.jit
def _col_step(k, ring, ch, sc, sp, acc, prev, prev_as, cur_as, col_scales, mma: gl.constexpr):
    """Blockwise step ``k``: issue its MMAs, add step k-1's scaled partial under them, load step k+1's row
    scales. Returns (acc, this step's in-flight partial, its row scales, step k+1's)."""
    g = ch.base + k
    s = ring.wait_ready(g)
    if ch.EDGES:
        _zero_edges(ring.a_bufs, ring.b_bufs, s, ch.t_first + k * ring.a_bufs.type.shape[2], ch.t_lo, ch.t_hi,
                    mma.warps_per_cta[0])
    # use_acc=False ignores the input's values; passing ``acc`` orders the previous step's add before this issue
    cur = warpgroup_mma(ring.a_bufs.index(s), ring.b_bufs.index(s).permute((1, 0)), acc, use_acc=False,
                        is_async=True)
    cur, prev = warpgroup_mma_wait(num_outstanding=1, deps=(cur, prev))
    ring.release(g - 1)  # before the column scales' read: their slot outlives the stage
    b_s = col_scales.slot(g - 1).load(gl.SliceLayout(0, mma))
    acc = acc + prev * (prev_as[:, None] * b_s[None, :])
    nxt_as = gl.load(sp.as_ptrs + (k + 1) * sc.stride_ask, mask=sp.rows_ok & (k + 1 < ch.n_k), other=0.0)
    return acc, cur, cur_as, nxt_as


@gluon.jit
def _col_last(acc, prev, prev_as, col_scales, g, mma: gl.constexpr):
    """acc plus the tile's last partial (ring step ``g``), once its MMAs are done."""
    prev = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
    b_s = col_scales.slot(g).load(gl.SliceLayout(0, mma))
    return acc + prev * (prev_as[:, None] * b_s[None, :])


@gluon.jit
def _promote_cols(ring, ch, sc, sp, prev, prev_as, nxt_as, col_scales, mma: gl.constexpr):
    """``grouped_gemm_fp8._accumulate`` for a blockwise wgrad tile, with per-column scales ([Note:
    blockwise wgrad scales])."""
    BLOCK_M: gl.constexpr = ring.a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = ring.b_desc.block_type.shape[0]
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    for k in range(1, ch.n_k - 1, 2):
        acc, cur, cur_as, nxt_as = _col_step(k, ring, ch, sc, sp, acc, prev, prev_as, nxt_as, col_scales, mma)
        acc, prev, prev_as, nxt_as = _col_step(k + 1, ring, ch, sc, sp, acc, cur, cur_as, nxt_as, col_scales, mma)
    if ch.n_k % 2 == 0:  # one step left
        acc, prev, prev_as, nxt_as = _col_step(ch.n_k - 1, ring, ch, sc, sp, acc, prev, prev_as, nxt_as, col_scales,
                                               mma)
        acc = _col_last(acc, prev, prev_as, col_scales, ch.base + ch.n_k - 1, mma)
    else:
        acc = _col_last(acc, prev, prev_as, col_scales, ch.base + ch.n_k - 1, mma)
    return acc


@gluon.jit
def _produce(ring, sched, bw, col_scales):
    """The TMA warp: ring step g waits for its stage, then loads it (with BLOCKWISE also the chunk's column
    scales)."""
    a_desc = ring.a_desc
    b_desc = ring.b_desc
    NUM_STAGES: gl.constexpr = ring.NUM_STAGES
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    N = sched.N
    K = sched.K
    tiles_m = gl.cdiv(N, BLOCK_M)
    tiles_n = gl.cdiv(K, BLOCK_N)
    g = sched.pid * 0
    for tile in range(sched.pid, sched.total, sched.nprog):
        e, row0, col0, start, end, first, n_k = _tile(tile, sched, tiles_m, tiles_n, BLOCK_M, BLOCK_N, BLOCK_K)
        if bw.BLOCKWISE:
            cols_n = gl.arange(0, BLOCK_N, layout=gl.BlockedLayout([4], [32], [1], [0]))
            bs_tile = bw.bs_ptr + (col0 + cols_n) * bw.stride_bsk + (first // BLOCK_K).to(gl.int64) * bw.stride_bsc
        for k in range(n_k):
            s = g % NUM_STAGES
            mbarrier.wait(ring.empty.index(s), ((g // NUM_STAGES) & 1) ^ 1)
            bar = ring.ready.index(s)
            # the chunk's column scales into their slot, an arrival on the stage's barrier once they land
            if bw.BLOCKWISE:
                _async_load(col_scales.slot(g), bs_tile + k * bw.stride_bsc)
                _async_arrive(bar)
                _thread_barrier()
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            _tma_load(a_desc, [row0, first + k * BLOCK_K], bar, ring.a_bufs.index(s))
            _tma_load(b_desc, [col0, first + k * BLOCK_K], bar, ring.b_bufs.index(s))
            g += 1


@gluon.jit
def _clock(like):
    """The SM's ``%clock64`` (``like``: any scalar of the partition, for the shape)."""
    return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [like], dtype=gl.int64, is_pure=False,
                                     pack=1)


@gluon.jit
def _trace(trace, pid, j, t_top, t_begun, t_flushed, t_done, n_k):
    """Record j of program pid ([Note: tracing the MMA warps' tile phases]): its four clocks and chunks."""
    if j < trace.TRACE_TILES:
        rec = trace.trace_ptr + (pid.to(gl.int64) * trace.TRACE_TILES + j) * 5
        gl.store(rec, t_top)
        gl.store(rec + 1, t_begun)
        gl.store(rec + 2, t_flushed)
        gl.store(rec + 3, t_done)
        gl.store(rec + 4, n_k.to(gl.int64))


@gluon.jit
def _tile_scales(bw, row0, col0, first, N, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 BLOCK_K: gl.constexpr, mma: gl.constexpr):
    """A blockwise tile's (Scales over its chunks, its rows of dy^T, which of them exist)."""
    c0 = (first // BLOCK_K).to(gl.int64)
    rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
    bs_base = bw.bs_ptr + col0.to(gl.int64) * bw.stride_bsk + c0 * bw.stride_bsc
    sc = Scales(bw.as_ptr + c0 * bw.stride_asc, bs_base, bw.stride_asn, bw.stride_asc, 0, bw.stride_bsc,
                bw.stride_bsk, True, True)
    return sc, rows, rows < N


@gluon.jit
def _consume(ring, sched, as_ptr, bs_ptr, out, hand, trace, bw, col_scales, mma: gl.constexpr, EPI_WARPS: gl.constexpr,
             ZERO_EDGES: gl.constexpr):
    """The MMA warps over ``_produce``'s tiles: each through the promoting loop, its epilogue after the next
    tile's first chunk is issued (the first iteration's writes nothing)."""
    BLOCK_M: gl.constexpr = ring.a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = ring.a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = ring.b_desc.block_type.shape[0]
    TRACE: gl.constexpr = trace.TRACE
    pid = sched.pid
    nprog = sched.nprog
    total = sched.total
    N = sched.N
    K = sched.K
    tiles_m = gl.cdiv(N, BLOCK_M)
    tiles_n = gl.cdiv(K, BLOCK_N)
    BLOCKWISE: gl.constexpr = bw.BLOCKWISE
    if BLOCKWISE:  # scaled per chunk in the loop: the epilogue's scales are ones
        a_scale = gl.load(as_ptr, mask=False, other=1.0)
        b_scale = gl.load(bs_ptr, mask=False, other=1.0)
    else:
        a_scale = gl.load(as_ptr)
        b_scale = gl.load(bs_ptr)
    zero = pid * 0
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))  # the loop's blockwise scale rows: unused
    rows_ok = rows < 0
    sc = Scales(as_ptr, bs_ptr, 0, 0, 0, 0, 0, False)  # per-tensor: applied in the epilogue
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    base = zero
    p_e = zero
    p_row0 = zero
    p_col0 = zero
    p_rows = zero      # rows the previous tile writes (0: nothing)
    p_as = a_scale
    p_bs = b_scale
    h = zero           # handoffs to the epilogue warps so far
    fresh = _unwritten(out)  # an output that holds nothing yet gets every tile, as a fresh one
    # each tile's place is read one tile ahead: its offsets' loads run under the tile before, not
    # between the two tiles' MMAs (the last tile reads its own again)
    e, row0, col0, start, end, first, n_k = _tile(pid, sched, tiles_m, tiles_n, BLOCK_M, BLOCK_N, BLOCK_K)
    for tile in range(pid, total, nprog):
        e1, row1, col1, start1, end1, first1, n_k1 = _tile(gl.minimum(tile + nprog, total - 1), sched, tiles_m,
                                                           tiles_n, BLOCK_M, BLOCK_N, BLOCK_K)
        if TRACE:
            t_top = _clock(pid)
        if n_k > 0:
            ch = Chunks(base, n_k, first, start, end, ZERO_EDGES)
            if BLOCKWISE:
                tsc, t_rows, t_rows_ok = _tile_scales(bw, row0, col0, first, N, K, BLOCK_M, BLOCK_N, BLOCK_K, mma)
                prev, prev_as, prev_bs, nxt_as, nxt_bs, sp = _begin(ring, ch, tsc, zero.to(gl.int64), zero, t_rows,
                                                                    t_rows_ok, mma)
            else:
                prev, prev_as, prev_bs, nxt_as, nxt_bs, sp = _begin(ring, ch, sc, zero.to(gl.int64), zero, rows,
                                                                    rows_ok, mma)
            if TRACE:
                t_begun = _clock(pid)
            h = _flush(acc, out, p_e, p_row0, p_col0, p_rows, K, p_as, p_bs, hand, h, mma, EPI_WARPS)
            if TRACE:
                t_flushed = _clock(pid)
            if BLOCKWISE:
                acc = _promote_cols(ring, ch, tsc, sp, prev, prev_as, nxt_as, col_scales, mma)
            else:
                acc = _accumulate(ring, ch, sc, sp, prev, prev_as, prev_bs, nxt_as, nxt_bs, mma)
            mbarrier.arrive(ring.empty.index((base + n_k - 1) % ring.NUM_STAGES), count=1)
            if TRACE:
                _trace(trace, pid, (tile - pid) // nprog, t_top, t_begun, t_flushed, _clock(pid), n_k)
        else:  # an empty group: zeros for a fresh output (scales 1, even NaN ones), nothing to add
            h = _flush(acc, out, p_e, p_row0, p_col0, p_rows, K, p_as, p_bs, hand, h, mma, EPI_WARPS)
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
        base += n_k
        p_e = e
        p_row0 = row0
        p_col0 = col0
        p_rows = gl.where(n_k > 0, N, 0)
        if out.FIRST:
            p_rows = gl.where(fresh, N, p_rows)
        if out.ADD_MODE == 0:  # a fresh output gets every tile, an empty group's too
            p_rows = N + zero
        p_as = gl.where(n_k > 0, a_scale, 1.0)
        p_bs = gl.where(n_k > 0, b_scale, 1.0)
        e = e1
        row0 = row1
        col0 = col1
        start = start1
        end = end1
        first = first1
        n_k = n_k1
    _flush(acc, out, p_e, p_row0, p_col0, p_rows, K, p_as, p_bs, hand, h, mma, EPI_WARPS)


@gluon.jit(do_not_specialize=["T"])
def wgrad_kernel(a_desc, b_desc, T, groups, output, scales, tracing, ADD_MODE: gl.constexpr,
                 PTR_TABLE: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr, EPI_WARPS: gl.constexpr,
                 EPI_ROWS: gl.constexpr, EPI_REGS: gl.constexpr, num_warps: gl.constexpr,
                 TRACE: gl.constexpr = False, ZERO_EDGES: gl.constexpr = True, FIRST: gl.constexpr = False,
                 BLOCKWISE: gl.constexpr = False):
    """dW_e[:N, :K] (+)= dy^T[:N, g] @ x^T[:K, g]^T over group e's tokens g ([Note: fp8 wgrad under the next
    MMA]). The runtime arguments come in tuples (``grouped_wgrad_fp8_launch`` builds them): ``groups`` (offs_ptr,
    stride_o, E, N, K), ``output`` (out_ptr, stride_oe, stride_on, stride_ok: the stacked output or, with
    PTR_TABLE, a table of per-group bases; first_ptr, FIRST's flag: [Note: an unwritten accumulator]), ``scales``
    (as_ptr, bs_ptr and the blockwise strides stride_asn, stride_asc, stride_bsk, stride_bsc), ``tracing``
    (trace_ptr, TRACE_TILES). ADD_MODE: as ``grouped_wgrad_fp8_launch.launch``'s ``add_mode``."""
    offs_ptr, stride_o, E, N, K = groups
    out_ptr, stride_oe, stride_on, stride_ok, first_ptr = output
    as_ptr, bs_ptr, stride_asn, stride_asc, stride_bsk, stride_bsc = scales
    trace_ptr, TRACE_TILES = tracing
    gl.static_assert(NUM_STAGES >= 2, "a ring of at least two stages")
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                 instr_shape=[16, BLOCK_N, 32])
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    total = E * gl.cdiv(N, BLOCK_M) * gl.cdiv(K, BLOCK_N)
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    # the handed-off tile ([Note: an epilogue partition]; one row without the epilogue warps): units of 8
    # elements swizzled over 8 rows, so the MMA layout's stores and the row-wise loads are both conflict-free
    C_ROWS: gl.constexpr = BLOCK_M if EPI_WARPS > 0 else 1
    # a fresh 16-bit output is handed off rounded ([Note: a 16-bit handoff]); every other in fp32
    if ADD_MODE == 0 and not PTR_TABLE and out_ptr.dtype.element_ty.primitive_bitwidth == 16:
        c_smem = gl.allocate_shared_memory(out_ptr.dtype.element_ty, [C_ROWS, BLOCK_N],
                                           gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]))
    else:
        c_smem = gl.allocate_shared_memory(gl.float32, [C_ROWS, BLOCK_N],
                                           gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]))
    c_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    c_ready = c_bars.index(0)
    c_free = c_bars.index(1)
    mbarrier.init(c_ready, count=1)
    mbarrier.init(c_free, count=1)
    ring = Ring(a_desc, b_desc, ready, empty, a_bufs, b_bufs, NUM_STAGES)
    sched = WgradSchedule(offs_ptr, stride_o, T, N, K, pid, total, nprog, GROUP_M)
    out = Out(out_ptr, stride_oe, stride_on, stride_ok, first_ptr, ADD_MODE, PTR_TABLE, FIRST)
    hand = Handoff(c_smem, c_ready, c_free)
    trace = Trace(trace_ptr, TRACE_TILES, TRACE)
    bw = BlockScales(as_ptr, bs_ptr, stride_asn, stride_asc, stride_bsk, stride_bsc, BLOCKWISE)
    # the chunks' column scales, a slot more than the stages ([Note: blockwise wgrad scales]); one unused
    # element otherwise
    BS_SLOTS: gl.constexpr = NUM_STAGES + 1 if BLOCKWISE else 1
    bs_bufs = gl.allocate_shared_memory(gl.float32, [BS_SLOTS, BLOCK_N if BLOCKWISE else 1],
                                        gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    # in the MMA layout's order where the MMA warps' registers allow its 16-byte loads: with them writing the
    # tile themselves (no epilogue warps), or loading it for a load-add-store, the sm_90a build spills
    col_scales = ColumnScaleSlots(bs_bufs, BLOCKWISE and EPI_WARPS > 0 and ADD_MODE != 1)
    if EPI_WARPS > 0:
        gl.static_assert(_WS_PAIRS, "the epilogue partition needs a Triton whose warp_specialize takes "
                                    "(function, args) pairs")
        gl.warp_specialize([
            (_consume, (ring, sched, as_ptr, bs_ptr, out, hand, trace, bw, col_scales, mma, EPI_WARPS, ZERO_EDGES)),
            (_produce, (ring, sched, bw, col_scales)),
            (_epilogue, (hand, out, sched, EPI_WARPS, EPI_ROWS)),
        ], [1, EPI_WARPS], [40, EPI_REGS])
    elif _WS_PAIRS:
        gl.warp_specialize([
            (_consume, (ring, sched, as_ptr, bs_ptr, out, hand, trace, bw, col_scales, mma, EPI_WARPS, ZERO_EDGES)),
            (_produce, (ring, sched, bw, col_scales)),
        ], [1], [40])
    else:
        gl.warp_specialize((ring, sched, as_ptr, bs_ptr, out, hand, trace, bw, col_scales, mma, EPI_WARPS, ZERO_EDGES),
                           _consume, (ring, sched, bw, col_scales), [_produce], [1], [40])
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
    mbarrier.invalidate(c_ready)
    mbarrier.invalidate(c_free)
