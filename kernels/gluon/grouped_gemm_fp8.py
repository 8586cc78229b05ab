"""FP8 fprop / dgrad over ragged token groups in Gluon, for the accumulations that promote every 128
products (the per-tensor recipe with ``split_accumulator=True`` and the blockwise recipe): the same
products as ``grouped_gemm_fp8._fp8_ragged_kernel``, with the tensor cores' partial sums added to the
fp32 accumulator while the next step's MMAs run.

[Note: promotion under the next MMA]
Each 128-deep step ends in ``acc += partial`` (times the step's scales, blockwise). Triton lowers that
add right after the step's wgmma, so every step waits for its MMAs to finish (``wgmma.wait_group 0``;
with ``max_num_imprecise_acc`` ptxas reports "wgmma.mma_async instructions are serialized", C7514):
the tensor cores idle through the add and the next step's issue. On an H200 that kept the promoting
per-tensor kernels at 1.40-1.48x of our bf16 kernels and the blockwise ones at ~1.0x, against 1.76-1.98x
for the per-tensor kernel that accumulates inside the tensor cores ([Note: fp8 split accumulator]).
Here, per K step ``k``:

    cur = wgmma(a[k], b[k], use_acc=False)      # async: step k's 128-deep partial, fresh registers
    wgmma.wait_group 1                          # every MMA but `cur` done: `prev` (step k-1) is final
    refill the stage step k-1 read              # its MMA is done, so TMA may overwrite it
    acc += prev (* a_s[k-1] b_s[k-1])           # fp32, on the CUDA cores, while `cur` runs
    prev = cur

Three fp32 tiles live per thread (acc, prev, cur): 192 registers at 128x128 over two warpgroups (64 x
128 each), which is why the tile is 128x128 (a 256-wide tile would need 384); 64x128 over one warpgroup
(two programs per SM) is the other choice (``GroupedGemmFp8Tuning.ragged_gluon_block_m``), measured slower.
Operands come through a ring of NUM_STAGES shared-memory stages filled by TMA (one mbarrier per
stage). The numbers are those of the Triton kernel: the same 128-deep partial sums, added in the same
order, scaled the same way (bit-identical in every GPU test, both recipes).
ptxas serializes all wgmmas of a kernel (C7514) as soon as it cannot prove that a register read by a
non-wgmma instruction is not being written by an MMA in flight, so the loop is shaped for its analysis:
step 0 is peeled (one step is in flight at the loop head on every path), two steps per iteration (the
partials alternate between two register sets: no phi copy of an in-flight tile at the back edge), the
last partial is added inside each branch of the odd/even tail, and each step's MMA takes ``acc`` as its
(ignored, ``use_acc=False``) input so that LLVM cannot sink the previous add below the issue.
``test_gluon_kernel_keeps_the_mma_pipeline`` builds it for sm_90a and fails on any of those messages.
``ragged_kernel`` runs this loop warp-specialized: one extra warp issues the TMA loads, so the MMA
warps only wait on the stages' ``ready`` mbarriers and hand each finished stage back through an
``empty`` one (one partition barrier per step); the MMA warps get the registers (``setmaxnreg`` 240, the
TMA warp 24). It is persistent: one program per SM over tiles pid, pid + grid, ...; both partitions walk
the same group cursor forward (``_cursor``), the ring's step count runs on across tiles (``base``), and
the MMA warps hand the last step's stage back before their epilogue, so the next tile's first stages load
under this tile's last steps and epilogue instead of after a fresh program's launch. Measured (H200,
docs/benchmarks.md), fprop/dgrad at the two large MoE shapes vs our bf16 kernels: 1.44-1.76x per-tensor
and 1.40-1.69x blockwise, the Triton kernel 1.36-1.43x and 0.93-1.04x (one run,
fp8_gemm_gluon_persistent_h200.json; the variants this kernel replaced: docs/benchmarks/LOG.md).

[Note: the next tile's first step under the epilogue]
Each tile's epilogue runs after the next tile's step 0 is issued: otherwise the MMA warps would leave
the tensor cores idle from the tile's last MMA (drained by the final ``wait_group 0``) through the
scale, bias and store instructions until the next step 0 is issued, a fixed cost per tile that weighs
most where tiles have few K steps (16 in the 2048-deep dgrad). The loop
over tiles has its head between a tile's last MMA and the next one's first, where nothing is in flight
(an in-flight step 0 carried across the back edge made ptxas serialize every wgmma, C7514): each
iteration issues its tile's step 0, runs the previous tile's epilogue (the first iteration's covers no
rows), then the rest of its steps; the epilogue after the loop is the last tile's. Only the epilogue's
scalars (first row, first column, the group's end row, the group; per-tensor, its two scales) cross the
loop; the row and column vectors are rebuilt. At the boundary the registers hold the finished sum and
the new step's partial, two of the loop's three tiles. The per-tensor scales are loaded when a tile
starts and carried to its epilogue (``_tile_scales``): loaded in the epilogue, their L2 round trip
stalled the MMA warps between the next tile's step 0 and step 1 (Nsight Compute on an H200: the scale
multiplies among the MMA warps' most-sampled stalls); carried, per-tensor fprop/dgrad ran 1.015-1.035x
(one interleaved A/B run, docs/benchmarks/LOG.md).

[Note: blockwise scales two steps ahead]
The blockwise promotion multiplies step k's partial by its rows' activation scales and its weight
block's scale. Loaded at step k and used at step k+1 (one MMA step, ~0.5 us, to arrive), they still
stalled the promotion's multiply (the most-sampled stall of the MMA warps in the blockwise fprop,
Nsight Compute on an H200). Each step now loads step k+1's scales, used at step k+2 (``_step``, after
its add, into the registers that step k-1's scales leave; step 0 and step 1's in ``_begin``): three
more registers, no spill at 168 (Triton 3.6), and 1.02-1.06x on the blockwise fprop/dgrad at the two
large MoE shapes in one A/B run (loaded before the add, which left a register copy at the loop's back
edge waiting on the load: 1.00-1.02x less). Values and order of the arithmetic are unchanged, so are
the bits.

[Note: the epilogue's wide stores]
In the MMA layout a thread holds pairs of adjacent columns, so a direct store writes 4 bytes (two
bf16) per instruction: 32 store instructions per thread per 128x128 tile, which filled the store
queue (Nsight Compute: "lg_throttle" among the MMA warps' top stalls in the 2048-deep dgrad). The
epilogue converts the tile to a layout of 8 consecutive columns per thread (``gl.convert_layout``,
through shared memory) and stores 16-byte rows: 8 instructions per thread, as the Triton kernels'
epilogues do. One A/B run on an H200, interleaved in one process (docs/benchmarks/LOG.md):
1.04-1.20x at the two large MoE shapes, most in the 2048-deep dgrad (per-tensor 1046 vs
871 TFLOP/s). The staging buffer (32 KB in bf16) fits beside the four 32 KB stages.

Preconditions (checked by ``grouped_gemm_fp8._gluon_ragged`` before it launches this): a Hopper GPU
(wgmma is sm_90a only), this Triton has Gluon, TMA-aligned operands, B with the contraction innermost
and its experts stacked so that ``[E * N, K]`` is a 2-D view (B's tile rows past an expert's N read the
next expert or TMA's zero fill, and only feed output columns that the store masks), blockwise tiles of
128 with BLOCK_N = BLOCK_K = 128 (one weight scale per step).
Legend as in ``grouped_gemm_fp8``: T tokens, K the contraction, N output features, E groups.
"""

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
from .tiles import zero_rows as _zero_rows

__all__ = ["AVAILABLE", "BLOCK", "Chunks", "Scales", "ragged_kernel", "descriptor"]

BLOCK = 128  # BLOCK_N = BLOCK_K; BLOCK_M is 128 or 64, one warpgroup (4 warps) per 64 rows
_Scalar = gl.tensor | gl.constexpr  # an int argument: a constexpr where the JIT specializes it (a 1), or unused (0)


@aggregate
class Scales:
    """The scales' pointers and strides: blockwise (BLOCKWISE), a_s[t, kb] (``as_ptr``, strides ``stride_ast``,
    ``stride_ask``) and b_s[e, kb, nb] (``bs_ptr``; ``stride_bse``, ``stride_bsk``, ``stride_bsn``), one of
    each per K step; per-tensor, ``as_ptr`` and ``bs_ptr`` [e] (stride ``stride_bse``). A stride may be a
    constexpr (a specialized 1, or the wgrad's unused 0). COLS (the blockwise wgrad, [Note: blockwise wgrad
    scales] in ``grouped_wgrad_fp8``): b_s has a scale per output column, read from shared memory by the
    wgrad's own loop; ``_begin`` loads only the row scales."""

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
    """A tile's blockwise scale pointers (``_begin``): its rows' a_s pointers at step 0 (``as_ptrs``, masked
    by ``rows_ok``) and its weight block's b_s at step 0 (``bs_base``); step k adds k times the K strides."""

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
    """A tile's K steps in the ring: step 0 is ring step ``base``, ``n_k`` steps. EDGES (the wgrad): step k
    holds tokens t_first + BLOCK_K k ..., those outside the group's [t_lo, t_hi) are zeroed first ([Note: a
    group's edge chunks in shared memory] in ``grouped_wgrad_fp8``). TOKENS_OUTER (the bf16 wgrad): the
    stages hold [tokens, rows] of dy and x, the MMA reads them transposed and as they are, and only the
    group's end can cut a step (its tokens start a step)."""

    base: gl.tensor
    n_k: _Scalar
    t_first: _Scalar
    t_lo: _Scalar
    t_hi: _Scalar
    EDGES: gl.constexpr
    TOKENS_OUTER: gl.constexpr

    @constexpr_function
    def __init__(self, base, n_k, t_first, t_lo, t_hi, EDGES, TOKENS_OUTER):
        self.base = field(base)
        self.n_k = field(n_k)
        self.t_first = field(t_first)
        self.t_lo = field(t_lo)
        self.t_hi = field(t_hi)
        self.EDGES = field(EDGES)
        self.TOKENS_OUTER = field(TOKENS_OUTER)


@aggregate
class Schedule:
    """A persistent program's tiles: pid, pid + nprog, ... < total, over the groups of ``offs_ptr`` (stride
    ``stride_o``; T tokens), N output columns, B's rows of group e from e * W_ROWS, n_k K steps per tile."""

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
    """The output ``out_ptr`` [t, n] (strides ``stride_ot``, ``stride_on``) and, with HAS_BIAS, the bias
    [e, n] (``bias_ptr``; ``stride_biase``, ``stride_biasn``)."""

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
    """TMA loads of K step ``step`` into the stage of the ring's step ``g`` (nothing if not ``pred``)."""
    s = g % ring.NUM_STAGES
    k0 = step * ring.a_desc.block_type.shape[1]
    bar = ring.ready.index(s)
    mbarrier.expect(bar, ring.a_desc.block_type.nbytes + ring.b_desc.block_type.nbytes, pred=pred)
    _tma_load(ring.a_desc, [row0, k0], bar, ring.a_bufs.index(s), pred=pred)
    _tma_load(ring.b_desc, [brow0, k0], bar, ring.b_bufs.index(s), pred=pred)


@gluon.jit
def _step(k, ring, ch, sc, sp, acc, prev, prev_as, prev_bs, cur_as, cur_bs, mma: gl.constexpr):
    """K step ``k`` of the tile ``ch``: issue its MMAs, then add step k-1's partial ``prev`` into ``acc`` while
    they run. Blockwise scales: ``prev_as``/``prev_bs`` are step k-1's, ``cur_as``/``cur_bs`` step k's (loaded
    a step ago); step k+1's are loaded here (``sp``). Returns (acc, this step's partial, its row scales, its
    weight scale, step k+1's row scales and weight scale); the partial is still in flight: only the next
    step's wait makes it readable. Step k-1's stage is then free: handed back to the TMA warp."""
    g = ch.base + k
    s = ring.wait_ready(g)
    if ch.EDGES:
        if ch.TOKENS_OUTER:
            _zero_rows(ring.a_bufs, ring.b_bufs, s, ch.t_first + k * ring.a_bufs.type.shape[1], ch.t_hi,
                       mma.warps_per_cta[0])
        else:
            _zero_edges(ring.a_bufs, ring.b_bufs, s, ch.t_first + k * ring.a_bufs.type.shape[2], ch.t_lo, ch.t_hi,
                        mma.warps_per_cta[0])
    # use_acc=False ignores the input's values; passing ``acc`` orders the previous step's add before
    # this issue (else LLVM may sink the add below it, and copy the in-flight partial at the back edge)
    if ch.TOKENS_OUTER:
        cur = warpgroup_mma(ring.a_bufs.index(s).permute((1, 0)), ring.b_bufs.index(s), acc, use_acc=False,
                            is_async=True)
    else:
        cur = warpgroup_mma(ring.a_bufs.index(s), ring.b_bufs.index(s).permute((1, 0)), acc, use_acc=False,
                            is_async=True)
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
    """Step 0 of the tile ``ch`` (in the ring's step ``ch.base``): waits for its stage and issues its MMAs into
    fresh registers. Returns (the partial, in flight; its row scales; its weight scale; step 1's row scales
    and weight scale; the blockwise scale pointers of the tile's later steps)."""
    BLOCK_M: gl.constexpr = ring.a_bufs.type.shape[2] if ch.TOKENS_OUTER else ring.a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = ring.a_bufs.type.shape[1] if ch.TOKENS_OUTER else ring.a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = ring.b_bufs.type.shape[2] if ch.TOKENS_OUTER else ring.b_bufs.type.shape[1]
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
        if ch.TOKENS_OUTER:
            _zero_rows(ring.a_bufs, ring.b_bufs, s0, ch.t_first, ch.t_hi, mma.warps_per_cta[0])
        else:
            _zero_edges(ring.a_bufs, ring.b_bufs, s0, ch.t_first, ch.t_lo, ch.t_hi, mma.warps_per_cta[0])
    if ch.TOKENS_OUTER:
        prev = warpgroup_mma(ring.a_bufs.index(s0).permute((1, 0)), ring.b_bufs.index(s0),
                             gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma), use_acc=False, is_async=True)
    else:
        prev = warpgroup_mma(ring.a_bufs.index(s0), ring.b_bufs.index(s0).permute((1, 0)),
                             gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma), use_acc=False, is_async=True)
    prev = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))  # still in flight: a type change only
    return prev, prev_as, prev_bs, nxt_as, nxt_bs, StepScales(as_ptrs, bs_base, rows_ok)


@gluon.jit
def _accumulate(ring, ch, sc, sp, prev, prev_as, prev_bs, nxt_as, nxt_bs, mma: gl.constexpr):
    """Steps 1 .. n_k - 1 of a tile whose step 0 (``_begin``) is in flight as ``prev``: the tile's fp32 sum,
    every MMA of it done ([Note: promotion under the next MMA])."""
    BLOCK_M: gl.constexpr = ring.a_desc.block_type.shape[1] if ch.TOKENS_OUTER else ring.a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = ring.b_desc.block_type.shape[1] if ch.TOKENS_OUTER else ring.b_desc.block_type.shape[0]
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
    """Per-tensor: the activation's scale and group e's weight scale, loaded when the tile starts so
    that its epilogue does not wait on them ([Note: the next tile's first step under the epilogue]);
    blockwise (scales applied per step): no loads, ones."""
    if BLOCKWISE:
        return gl.load(sc.as_ptr, mask=False, other=1.0), gl.load(sc.bs_ptr, mask=False, other=1.0)
    return gl.load(sc.as_ptr), gl.load(sc.bs_ptr + e64 * sc.stride_bse)


@gluon.jit
def _finish(acc, out, e64, row0, col0, row_end, N, a_scale, b_scale, mma: gl.constexpr, BLOCKWISE: gl.constexpr):
    """The epilogue of the tile at (row0, col0) whose group ends at row ``row_end`` (nothing stored if
    row_end <= row0): per-tensor scales (``_tile_scales``), bias, and the store, masked to the
    group's rows and N ([Note: the epilogue's wide stores])."""
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
    """The warp-specialized kernel's TMA warp, over the program's tiles (``sched``), the group cursor
    (group e, its first tile ``first``) walked forward: ring step g waits until the consumers hand its
    stage back, then loads it; the next tile's loads start as soon as stages come free, under the
    consumers' last steps and epilogue."""
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
    """The warp-specialized kernel's MMA warps over the same tiles as ``_produce``, in the same order;
    each tile's epilogue runs after the next tile's step 0 is issued ([Note: the next tile's first step
    under the epilogue])."""
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
        ch = Chunks(base, n_k, 0, 0, 0, False, False)
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
    """out[t, :N] = a[t, :K] @ B[e * W_ROWS : e * W_ROWS + N, :K]^T for the tokens t of group e
    ([Note: promotion under the next MMA]); scales as ``_fp8_ragged_kernel``'s. Warp-specialized (one
    extra warp issues the TMA loads, the MMA warps only wait on mbarriers) and persistent (programs loop
    over tiles pid, pid + grid, ...), each tile's epilogue after the next tile's step 0 ([Note: the next
    tile's first step under the epilogue])."""
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
