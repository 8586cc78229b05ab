"""FP8 fprop / dgrad over ragged token groups in Gluon, for the accumulations that promote every 128
products (per-tensor ``split_accumulator=True``, blockwise): ``grouped_gemm_fp8._fp8_ragged_kernel``'s partials in
its order (the same bits), each added to the fp32 accumulator while the next step's MMAs run.

[Note: promotion under the next MMA]
Triton waits for each 128-deep step's MMAs (``wgmma.wait_group 0``) before ``acc += partial``, so the tensor cores
idle through the add. Here, per K step ``k``:

    cur = wgmma(a[k], b[k], use_acc=False)      # async: step k's partial, fresh registers
    wgmma.wait_group 1                          # `prev` (step k-1) is final; refill its stage
    acc += prev (* a_s[k-1] b_s[k-1])           # fp32, on the CUDA cores, while `cur` runs
    prev = cur

Three fp32 tiles per thread (192 registers at 128x128 over two warpgroups) set the tile size. ptxas serializes
every wgmma (warning C7514) once it cannot prove a register read outside the MMAs is not written by one in
flight, so the loop is shaped for it: step 0 peeled, two steps per iteration (partials alternate between two
register sets), the last partial added inside each branch of the tail, and each MMA takes ``acc`` as its ignored
input so LLVM cannot sink the previous add below the issue (``test_gluon_kernel_keeps_the_mma_pipeline``).
``ragged_kernel`` is warp-specialized (a TMA warp fills the ring) and persistent: both partitions walk one group
cursor forward and the ring's steps run on across tiles, so the next tile's stages load under this one's tail.

[Note: the next tile's first step under the epilogue]
Each tile's epilogue (scale, bias, store) runs after the next tile's step 0 is issued, so the tensor cores do not
idle through it. The tile loop's head is where nothing is in flight (else C7514): an iteration issues its step 0,
runs the previous tile's epilogue (the first covers no rows), then its other steps. The per-tensor scales load
when a tile starts and are carried to its epilogue (``_tile_scales``): loaded there, their L2 trip stalled it.

[Note: blockwise scales two steps ahead]
Scales loaded one step before use still stalled the promotion's multiply, so each step loads step k+1's, used at
step k+2 (``_step``, after its add, into the registers step k-1's free; ``_begin`` loads steps 0 and 1).

[Note: the epilogue's wide stores]
An MMA-layout thread holds pairs of adjacent columns, so direct stores write 4 bytes each and fill the store
queue; the epilogue converts the tile through shared memory and stores 16-byte rows, as Triton's epilogues do.

Preconditions (``grouped_gemm_fp8._gluon_ragged`` checks them): Hopper, Gluon, TMA-aligned operands, B with the
contraction innermost and experts stacked so ``[E * N, K]`` is a 2-D view (tile rows past an expert's N feed only
masked columns), blockwise tiles of 128 = BLOCK_N = BLOCK_K (one weight scale per step). T tokens, K the
contraction, N output features, E groups."""

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
from . import WS_PAIRS as _WS_PAIRS
from . import tma_load as _tma_load
from .tiles import Ring
from .tiles import cursor as _cursor
from .tiles import origin as _origin
from .tiles import store_rows as _store_rows
from .tiles import tile as _tile
from .tiles import total_tiles as _total_tiles
from .tiles import zero_edges as _zero_edges

__all__ = ["AVAILABLE", "BLOCK", "Chunks", "Scales", "ragged_kernel", "descriptor"]

BLOCK = 128  # BLOCK_N = BLOCK_K; BLOCK_M is 128 or 64, one warpgroup (4 warps) per 64 rows
_Scalar = gl.tensor | gl.constexpr  # an int argument: a constexpr where the JIT specializes it (a 1), or unused (0)


@aggregate
class Scales:
    """Scale pointers and strides: blockwise a_s[t, kb], b_s[e, kb, nb]; per-tensor ``as_ptr``, ``bs_ptr`` [e]. COLS
    (blockwise wgrad): b_s per output column, read by the wgrad's loop ([Note: blockwise wgrad scales])."""

    as_ptr: gl.tensor
    bs_ptr: gl.tensor
    stride_ast: _Scalar
    stride_ask: _Scalar
    stride_bse: _Scalar
    stride_bsk: _Scalar
    stride_bsn: _Scalar
    BLOCKWISE: gl.constexpr
    COLS: gl.constexpr

    @constexpr_function
    def __init__(self, as_ptr, bs_ptr, stride_ast, stride_ask, stride_bse, stride_bsk, stride_bsn, BLOCKWISE,
                 COLS=False):
        self.as_ptr = field(as_ptr)
        self.bs_ptr = field(bs_ptr)
        self.stride_ast = field(stride_ast)
        self.stride_ask = field(stride_ask)
        self.stride_bse = field(stride_bse)
        self.stride_bsk = field(stride_bsk)
        self.stride_bsn = field(stride_bsn)
        self.BLOCKWISE = field(BLOCKWISE)
        self.COLS = field(COLS)


@aggregate
class StepScales:
    """A tile's blockwise scale pointers at step 0 (rows masked by ``rows_ok``); step k adds k K strides."""

    as_ptrs: gl.tensor
    bs_base: gl.tensor
    rows_ok: gl.tensor

    @constexpr_function
    def __init__(self, as_ptrs, bs_base, rows_ok):
        self.as_ptrs = field(as_ptrs)
        self.bs_base = field(bs_base)
        self.rows_ok = field(rows_ok)


@aggregate
class Chunks:
    """A tile's ``n_k`` K steps from ring step ``base``; step k holds tokens t_first + BLOCK_K k ... EDGES
    (wgrad): those outside [t_lo, t_hi) are zeroed first ([Note: a group's edge chunks in shared memory])."""

    base: gl.tensor
    n_k: _Scalar
    t_first: _Scalar
    t_lo: _Scalar
    t_hi: _Scalar
    EDGES: gl.constexpr

    @constexpr_function
    def __init__(self, base, n_k, t_first, t_lo, t_hi, EDGES):
        self.base = field(base)
        self.n_k = field(n_k)
        self.t_first = field(t_first)
        self.t_lo = field(t_lo)
        self.t_hi = field(t_hi)
        self.EDGES = field(EDGES)


@aggregate
class Schedule:
    """A persistent program's tiles pid, pid + nprog, ... < total over the groups of ``offs_ptr``;
    group e's B rows start at e * W_ROWS."""

    offs_ptr: gl.tensor
    stride_o: _Scalar
    T: _Scalar
    N: _Scalar
    W_ROWS: _Scalar
    n_k: _Scalar
    pid: gl.tensor
    total: gl.tensor
    nprog: gl.tensor
    GROUP_M: gl.constexpr

    @constexpr_function
    def __init__(self, offs_ptr, stride_o, T, N, W_ROWS, n_k, pid, total, nprog, GROUP_M):
        self.offs_ptr = field(offs_ptr)
        self.stride_o = field(stride_o)
        self.T = field(T)
        self.N = field(N)
        self.W_ROWS = field(W_ROWS)
        self.n_k = field(n_k)
        self.pid = field(pid)
        self.total = field(total)
        self.nprog = field(nprog)
        self.GROUP_M = field(GROUP_M)


@aggregate
class Out:
    """The output [t, n] and, with HAS_BIAS, the bias [e, n]."""

    out_ptr: gl.tensor
    bias_ptr: _Scalar
    stride_ot: _Scalar
    stride_on: _Scalar
    stride_biase: _Scalar
    stride_biasn: _Scalar
    HAS_BIAS: gl.constexpr

    @constexpr_function
    def __init__(self, out_ptr, bias_ptr, stride_ot, stride_on, stride_biase, stride_biasn, HAS_BIAS):
        self.out_ptr = field(out_ptr)
        self.bias_ptr = field(bias_ptr)
        self.stride_ot = field(stride_ot)
        self.stride_on = field(stride_on)
        self.stride_biase = field(stride_biase)
        self.stride_biasn = field(stride_biasn)
        self.HAS_BIAS = field(HAS_BIAS)


@gluon.jit
def _issue(ring, step, g, row0, brow0, pred):
    """TMA loads of K step ``step`` into ring step ``g``'s stage (nothing unless ``pred``)."""
    s = g % ring.NUM_STAGES
    k0 = step * ring.a_desc.block_type.shape[1]
    bar = ring.ready.index(s)
    mbarrier.expect(bar, ring.a_desc.block_type.nbytes + ring.b_desc.block_type.nbytes, pred=pred)
    _tma_load(ring.a_desc, [row0, k0], bar, ring.a_bufs.index(s), pred=pred)
    _tma_load(ring.b_desc, [brow0, k0], bar, ring.b_bufs.index(s), pred=pred)


@gluon.jit
def _step(k, ring, ch, sc, sp, acc, prev, prev_as, prev_bs, cur_as, cur_bs, mma: gl.constexpr):
    """K step ``k``: issue its MMAs, then add step k-1's partial ``prev`` (scales ``prev_as``/``prev_bs``)
    into ``acc`` under them, hand step k-1's stage back and load step k+1's blockwise scales. Returns (acc, this
    step's partial, its scales ``cur_as``/``cur_bs``, step k+1's); the partial is in flight until the next wait."""
    g = ch.base + k
    s = ring.wait_ready(g)
    if ch.EDGES:
        _zero_edges(ring.a_bufs, ring.b_bufs, s, ch.t_first + k * ring.a_bufs.type.shape[2], ch.t_lo, ch.t_hi,
                    mma.warps_per_cta[0])
    # use_acc=False ignores the input's values; passing ``acc`` orders the previous step's add before
    # this issue (else LLVM may sink the add below it, and copy the in-flight partial at the back edge)
    cur = warpgroup_mma(ring.a_bufs.index(s), ring.b_bufs.index(s).permute((1, 0)), acc, use_acc=False, is_async=True)
    cur, prev = warpgroup_mma_wait(num_outstanding=1, deps=(cur, prev))
    # step k-1's MMAs are done: its stage takes step k + NUM_STAGES - 1
    ring.release(g - 1)
    if sc.BLOCKWISE:
        acc = acc + prev * (prev_as[:, None] * prev_bs)
        # [Note: blockwise scales two steps ahead]: after the add, into the registers of step k-1's
        # scales (no copy at the loop's back edge, which would wait for the load)
        nxt_ok = k + 1 < ch.n_k
        nxt_as = gl.load(sp.as_ptrs + (k + 1) * sc.stride_ask, mask=sp.rows_ok & nxt_ok, other=0.0)
        nxt_bs = gl.load(sp.bs_base + (k + 1) * sc.stride_bsk, mask=nxt_ok, other=0.0)
    else:
        acc = acc + prev
        nxt_as = cur_as
        nxt_bs = cur_bs
    return acc, cur, cur_as, cur_bs, nxt_as, nxt_bs


@gluon.jit
def _last(acc, prev, prev_as, prev_bs, BLOCKWISE: gl.constexpr):
    """acc plus the last step's partial, once its MMAs are done."""
    prev = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
    if BLOCKWISE:
        return acc + prev * (prev_as[:, None] * prev_bs)
    return acc + prev


@gluon.jit
def _begin(ring, ch, sc, e64, col0, rows, rows_ok, mma: gl.constexpr):
    """Step 0 of tile ``ch``: wait for its stage, issue its MMAs. Returns (the in-flight partial, its scales,
    step 1's, the tile's ``StepScales``)."""
    BLOCK_M: gl.constexpr = ring.a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = ring.a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = ring.b_bufs.type.shape[1]
    row_lay: gl.constexpr = gl.SliceLayout(1, mma)
    # blockwise: row scales of the step (a_s[rows, kb]) and the weight block's scale (one per step:
    # the tile's 128 columns are one block, BLOCK_N == BLOCK_K == L)
    as_ptrs = sc.as_ptr + rows.to(gl.int64) * sc.stride_ast
    bs_base = sc.bs_ptr + e64 * sc.stride_bse + (col0 // BLOCK_K) * sc.stride_bsn
    if sc.COLS:  # the column scales come through shared memory ([Note: blockwise wgrad scales])
        prev_as = gl.load(as_ptrs, mask=rows_ok, other=0.0)
        prev_bs = gl.load(bs_base, mask=False, other=0.0)
        nxt_as = gl.load(as_ptrs + sc.stride_ask, mask=rows_ok & (ch.n_k > 1), other=0.0)
        nxt_bs = prev_bs
    elif sc.BLOCKWISE:
        prev_as = gl.load(as_ptrs, mask=rows_ok, other=0.0)
        prev_bs = gl.load(bs_base)
        nxt_as = gl.load(as_ptrs + sc.stride_ask, mask=rows_ok & (ch.n_k > 1), other=0.0)
        nxt_bs = gl.load(bs_base + sc.stride_bsk, mask=ch.n_k > 1, other=0.0)
    else:
        prev_as = gl.zeros([BLOCK_M], gl.float32, row_lay)
        prev_bs = gl.load(bs_base, mask=False, other=0.0)
        nxt_as = prev_as
        nxt_bs = prev_bs
    s0 = ring.wait_ready(ch.base)
    if ch.EDGES:
        _zero_edges(ring.a_bufs, ring.b_bufs, s0, ch.t_first, ch.t_lo, ch.t_hi, mma.warps_per_cta[0])
    prev = warpgroup_mma(ring.a_bufs.index(s0), ring.b_bufs.index(s0).permute((1, 0)),
                         gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma), use_acc=False, is_async=True)
    prev = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))  # still in flight: a type change only
    return prev, prev_as, prev_bs, nxt_as, nxt_bs, StepScales(as_ptrs, bs_base, rows_ok)


@gluon.jit
def _accumulate(ring, ch, sc, sp, prev, prev_as, prev_bs, nxt_as, nxt_bs, mma: gl.constexpr):
    """Steps 1 .. n_k - 1 of a tile whose step 0 is in flight as ``prev``: the fp32 sum, every MMA
    done ([Note: promotion under the next MMA])."""
    BLOCK_M: gl.constexpr = ring.a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = ring.b_desc.block_type.shape[0]
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    # Step 0 is outside the loop, so that one step's MMAs are in flight at the loop's head on every
    # path (ptxas serializes every wgmma if it cannot tell which accumulators are in flight there);
    # then two steps per iteration, so that the partials alternate between two register sets
    # without a copy ([Note: promotion under the next MMA]).
    for k in range(1, ch.n_k - 1, 2):
        acc, cur, cur_as, cur_bs, nxt_as, nxt_bs = _step(k, ring, ch, sc, sp, acc, prev, prev_as, prev_bs, nxt_as,
                                                         nxt_bs, mma)
        acc, prev, prev_as, prev_bs, nxt_as, nxt_bs = _step(k + 1, ring, ch, sc, sp, acc, cur, cur_as, cur_bs,
                                                            nxt_as, nxt_bs, mma)
    # the last partial is added in each branch: no in-flight accumulator may cross the merge
    if ch.n_k % 2 == 0:  # one step left
        acc, prev, prev_as, prev_bs, nxt_as, nxt_bs = _step(ch.n_k - 1, ring, ch, sc, sp, acc, prev, prev_as,
                                                            prev_bs, nxt_as, nxt_bs, mma)
        acc = _last(acc, prev, prev_as, prev_bs, sc.BLOCKWISE)
    else:
        acc = _last(acc, prev, prev_as, prev_bs, sc.BLOCKWISE)
    return acc


@gluon.jit
def _tile_scales(sc, e64, BLOCKWISE: gl.constexpr):
    """Per-tensor: the activation's and group e's weight scale, loaded as the tile starts; blockwise: ones."""
    if BLOCKWISE:
        return gl.load(sc.as_ptr, mask=False, other=1.0), gl.load(sc.bs_ptr, mask=False, other=1.0)
    return gl.load(sc.as_ptr), gl.load(sc.bs_ptr + e64 * sc.stride_bse)


@gluon.jit
def _finish(acc, out, e64, row0, col0, row_end, N, a_scale, b_scale, mma: gl.constexpr, BLOCKWISE: gl.constexpr):
    """The epilogue of the tile at (row0, col0): per-tensor scales, bias, and the store masked to rows
    below ``row_end`` and columns below N ([Note: the epilogue's wide stores])."""
    BLOCK_N: gl.constexpr = acc.type.shape[1]
    # (the bias stays here: live across the MMA loop, it made the blockwise kernel spill)
    if not BLOCKWISE:
        acc = acc * a_scale * b_scale
    if out.HAS_BIAS:
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
        bias = gl.load(out.bias_ptr + e64 * out.stride_biase + cols * out.stride_biasn, mask=cols < N, other=0.0)
        acc = acc + bias.to(gl.float32)[None, :]
    _store_rows(out.out_ptr, acc, row0, col0, row_end, N, out.stride_ot, out.stride_on, mma)


@gluon.jit
def _produce(ring, sched, e, first):
    """The TMA warp: ring step g waits for its stage, then loads it."""
    BLOCK_M: gl.constexpr = ring.a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = ring.b_desc.block_type.shape[0]
    base = sched.pid * 0
    for tile in range(sched.pid, sched.total, sched.nprog):
        e, first, start, size = _cursor(sched.offs_ptr, sched.stride_o, sched.T, e, first, tile,
                                        gl.cdiv(sched.N, BLOCK_N), BLOCK_M)
        row0, col0, brow0 = _origin(e, tile - first, start, size, sched.N, sched.W_ROWS, sched.GROUP_M, BLOCK_M,
                                    BLOCK_N)
        for k in range(sched.n_k):
            g = base + k
            ring.wait_empty(g)
            _issue(ring, k, g, row0, brow0, True)
        base += sched.n_k


@gluon.jit
def _consume_tiles(ring, sched, e, first, sc, out, mma: gl.constexpr):
    """The MMA warps over ``_produce``'s tiles, each tile's epilogue after the next tile's step 0
    is issued ([Note: the next tile's first step under the epilogue])."""
    BLOCK_M: gl.constexpr = ring.a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = ring.b_desc.block_type.shape[0]
    N = sched.N
    n_k = sched.n_k
    tiles_n = gl.cdiv(N, BLOCK_N)
    base = sched.pid * 0
    # the loop's head lies between a tile's last MMA and the next tile's first, so that no MMA is in
    # flight there; the epilogue of each tile runs in the next iteration, after that tile's step 0
    # is issued (the first iteration's epilogue stores nothing: its row range is empty)
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    p_row0 = sched.pid * 0
    p_col0 = p_row0
    p_end = p_row0
    p_e64 = p_row0.to(gl.int64)
    p_as, p_bs = _tile_scales(sc, p_e64, True)  # ones: nothing stored first
    for tile in range(sched.pid, sched.total, sched.nprog):
        e, first, start, size = _cursor(sched.offs_ptr, sched.stride_o, sched.T, e, first, tile, tiles_n, BLOCK_M)
        row0, col0, brow0, rows, cols, rows_ok, cols_ok, e64 = _tile(e, tile - first, start, size, N, sched.W_ROWS,
                                                                    mma, sched.GROUP_M, BLOCK_M, BLOCK_N)
        t_as, t_bs = _tile_scales(sc, e64, sc.BLOCKWISE)
        ch = Chunks(base, n_k, 0, 0, 0, False)
        prev, prev_as, prev_bs, nxt_as, nxt_bs, sp = _begin(ring, ch, sc, e64, col0, rows, rows_ok, mma)
        _finish(acc, out, p_e64, p_row0, p_col0, p_end, N, p_as, p_bs, mma, sc.BLOCKWISE)
        acc = _accumulate(ring, ch, sc, sp, prev, prev_as, prev_bs, nxt_as, nxt_bs, mma)
        ring.release(base + n_k - 1)
        base += n_k
        p_row0, p_col0, p_end, p_e64, p_as, p_bs = row0, col0, start + size, e64, t_as, t_bs
    _finish(acc, out, p_e64, p_row0, p_col0, p_end, N, p_as, p_bs, mma, sc.BLOCKWISE)


@gluon.jit(do_not_specialize=["T", "E"])
def ragged_kernel(a_desc, b_desc, as_ptr, bs_ptr, out_ptr, bias_ptr, offs_ptr,
                  T, E, N, K, W_ROWS,
                  stride_ast, stride_ask, stride_bse, stride_bsk, stride_bsn,
                  stride_ot, stride_on, stride_biase, stride_biasn, stride_o,
                  BLOCKWISE: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr,
                  BLOCK_E: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr):
    """out[t, :N] = a[t, :K] @ B[e * W_ROWS : e * W_ROWS + N, :K]^T for group e's tokens t
    ([Note: promotion under the next MMA]); scales as ``_fp8_ragged_kernel``'s."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                 instr_shape=[16, BLOCK_N, 32])
    pid = gl.program_id(0)
    tiles_n = gl.cdiv(N, BLOCK_N)
    # tiles pid, pid + grid, ...: each program walks a group cursor forward from group 0
    total = _total_tiles(offs_ptr, stride_o, E, T, tiles_n, BLOCK_M, BLOCK_E, num_warps)
    e = pid * 0
    first = e
    if pid >= total:
        return
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
    n_k = gl.cdiv(K, BLOCK_K)  # >= 1 (the host takes this kernel only for K > 0)
    nprog = gl.num_programs(0)
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(empty.index(i), count=1)
    ring = Ring(a_desc, b_desc, ready, empty, a_bufs, b_bufs, NUM_STAGES)
    sched = Schedule(offs_ptr, stride_o, T, N, W_ROWS, n_k, pid, total, nprog, GROUP_M)
    sc = Scales(as_ptr, bs_ptr, stride_ast, stride_ask, stride_bse, stride_bsk, stride_bsn, BLOCKWISE)
    out = Out(out_ptr, bias_ptr, stride_ot, stride_on, stride_biase, stride_biasn, HAS_BIAS)
    if _WS_PAIRS:
        gl.warp_specialize([(_consume_tiles, (ring, sched, e, first, sc, out, mma)),
                            (_produce, (ring, sched, e, first))], [1], [24])
    else:
        gl.warp_specialize((ring, sched, e, first, sc, out, mma), _consume_tiles, (ring, sched, e, first),
                           [_produce], [1], [24])
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(empty.index(i))
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(i))
