"""The Gluon wgrad kernel's epilogue: the MMA warps hand each scaled tile over in shared memory or write it, and
the epilogue warps write handed-off tiles ([Note: an epilogue partition], [Note: a 16-bit handoff]).
"""

from .._grouped_wgrad import _wgrad_out_base  # (a scalar Triton helper: Gluon calls it as it is)
from . import aggregate, constexpr_function, field, gl, gluon, mbarrier
from .tiles import wgrad_tile as _tile

__all__ = ["Handoff", "Out", "epilogue", "flush", "unwritten"]

_Scalar = gl.tensor | gl.constexpr  # an int argument: a constexpr where the JIT specializes it (a 1)


@aggregate
class Out:
    """dW stacked [e, n, k] at ``out_ptr``, or with PTR_TABLE a table of per-group bases (``stride_oe`` 0). ADD_MODE:
    0 fresh, 1 load-add-store, 3 fp32 reductions, -1 nothing (a traced dry run). FIRST: a nonzero int32 at
    ``first_ptr`` means ``out`` holds nothing yet, so tiles are written fresh ([Note: an unwritten accumulator])."""

    out_ptr: gl.tensor
    stride_oe: _Scalar
    stride_on: _Scalar
    stride_ok: _Scalar
    first_ptr: gl.tensor
    ADD_MODE: gl.constexpr
    PTR_TABLE: gl.constexpr
    FIRST: gl.constexpr

    @constexpr_function
    def __init__(self, out_ptr, stride_oe, stride_on, stride_ok, first_ptr, ADD_MODE, PTR_TABLE, FIRST):
        self.out_ptr = field(out_ptr)
        self.stride_oe = field(stride_oe)
        self.stride_on = field(stride_on)
        self.stride_ok = field(stride_ok)
        self.first_ptr = field(first_ptr)
        self.ADD_MODE = field(ADD_MODE)
        self.PTR_TABLE = field(PTR_TABLE)
        self.FIRST = field(FIRST)


@aggregate
class Handoff:
    """Handed-off tile ``c_smem``; mbarriers ``c_ready`` (MMA warps stored it), ``c_free`` (epilogue warps read it)."""

    c_smem: gl.shared_memory_descriptor
    c_ready: gl.shared_memory_descriptor
    c_free: gl.shared_memory_descriptor

    @constexpr_function
    def __init__(self, c_smem, c_ready, c_free):
        self.c_smem = field(c_smem)
        self.c_ready = field(c_ready)
        self.c_free = field(c_free)


@gluon.jit
def _write(acc, out, e, row0, col0, n_rows, K, a_scale, b_scale, mma: gl.constexpr):
    """Scales group e's tile at (row0, col0) and puts rows < ``n_rows`` (0: none), columns < K, per ADD_MODE."""
    BLOCK_M: gl.constexpr = acc.type.shape[0]
    BLOCK_N: gl.constexpr = acc.type.shape[1]
    WARPS: gl.constexpr = mma.warps_per_cta[0]
    TN: gl.constexpr = BLOCK_N // 8
    st: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TN, TN], [WARPS, 1], [1, 0])
    val = gl.convert_layout(acc * a_scale * b_scale, st)
    rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st))
    cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, st))
    base = _wgrad_out_base(out.out_ptr, e, out.stride_oe, out.PTR_TABLE)
    ptrs = base + rows.to(gl.int64)[:, None] * out.stride_on + cols[None, :] * out.stride_ok
    mask = (rows < n_rows)[:, None] & (cols < K)[None, :]
    if unwritten(out):
        gl.store(ptrs, val.to(ptrs.dtype.element_ty), mask=mask)
    else:
        _put(ptrs, val, mask, out.ADD_MODE)


@gluon.jit
def _put(ptrs, val, mask, ADD_MODE: gl.constexpr):
    """Store (ADD_MODE 0), load-add-store (1) or fp32 reductions (3) of ``val``."""
    if ADD_MODE == 3:  # one addend per element: deterministic
        gl.atomic_add(ptrs, val, mask=mask, sem="relaxed")
    else:
        if ADD_MODE == 1:
            val = val + gl.load(ptrs, mask=mask, other=0.0)
        gl.store(ptrs, val.to(ptrs.dtype.element_ty), mask=mask)


@gluon.jit
def unwritten(out):
    """Whether ``out`` holds nothing yet: FIRST and its flag set (a runtime bool), else the constant False."""
    if out.FIRST:
        flag = gl.load(out.first_ptr) != 0
    else:
        flag = False
    return flag


@gluon.jit
def _writes(n_k, out, fresh):
    """Whether a tile writes: every tile of a fresh or unwritten (``fresh``) output, else only tiles with tokens."""
    if out.ADD_MODE == 0:
        w = n_k >= 0
    else:
        w = n_k > 0
        if out.FIRST:
            w = w | fresh
    return w


@gluon.jit
def _hand_off(acc, a_scale, b_scale, hand, h):
    """The MMA warps' side of [Note: an epilogue partition]: waits until handoff h - 1 was read (a fresh
    mbarrier counts as released), stores the scaled tile and signals it."""
    mbarrier.wait(hand.c_free, (h & 1) ^ 1)
    hand.c_smem.store((acc * a_scale * b_scale).to(hand.c_smem.dtype))  # a fresh 16-bit output rounds here
    mbarrier.arrive(hand.c_ready, count=1)


@gluon.jit
def epilogue(hand, out, sched, EPI_WARPS: gl.constexpr, EPI_ROWS: gl.constexpr):
    """The epilogue warps ([Note: an epilogue partition]): each handed-off tile read EPI_ROWS rows at a time and
    put into ``out`` per ADD_MODE, 16 bytes per thread and instruction (4 fp32 or 8 bf16/fp16 columns)."""
    BLOCK_M: gl.constexpr = hand.c_smem.type.shape[0]
    BLOCK_N: gl.constexpr = hand.c_smem.type.shape[1]
    ADD_MODE: gl.constexpr = out.ADD_MODE
    N = sched.N
    K = sched.K
    tiles_m = gl.cdiv(N, BLOCK_M)
    tiles_n = gl.cdiv(K, BLOCK_N)
    VEC: gl.constexpr = 8 if out.out_ptr.dtype.element_ty.primitive_bitwidth == 16 else 4
    TN: gl.constexpr = BLOCK_N // VEC
    lay: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // TN, TN], [EPI_WARPS, 1], [1, 0])
    h = sched.pid * 0
    fresh = unwritten(out)
    keep = gl.zeros([EPI_ROWS, BLOCK_N], gl.float32, lay)  # a dry run's reads (ADD_MODE -1), kept live
    for tile in range(sched.pid, sched.total, sched.nprog):
        e, row0, col0, start, end, first, n_k = _tile(tile, sched, tiles_m, tiles_n, BLOCK_M, BLOCK_N,
                                                      BLOCK_M)  # the chunk: BLOCK_M tokens
        if _writes(n_k, out, fresh):
            base = _wgrad_out_base(out.out_ptr, e, out.stride_oe, out.PTR_TABLE)
            cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, lay))
            mbarrier.wait(hand.c_ready, h & 1)
            for r in gl.static_range(0, BLOCK_M, EPI_ROWS):
                val = hand.c_smem.slice(r, EPI_ROWS, dim=0).load(lay)
                rows = row0 + r + gl.arange(0, EPI_ROWS, layout=gl.SliceLayout(1, lay))
                ptrs = base + rows.to(gl.int64)[:, None] * out.stride_on + cols[None, :] * out.stride_ok
                mask = (rows < N)[:, None] & (cols < K)[None, :]
                if ADD_MODE < 0:
                    keep += val.to(gl.float32)
                elif fresh:
                    gl.store(ptrs, val.to(ptrs.dtype.element_ty), mask=mask)
                else:
                    _put(ptrs, val, mask, ADD_MODE)  # a fresh output: bf16/fp16 or fp32
            mbarrier.arrive(hand.c_free, count=1)
            h += 1
    if ADD_MODE < 0:  # never true (N > 0): the reads stay in the program, nothing is written
        gl.store(out.out_ptr + gl.arange(0, EPI_ROWS, layout=gl.SliceLayout(1, lay))[:, None] * 0
                 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, lay))[None, :] * 0, keep, mask=keep * 0 + N < 0)


@gluon.jit
def flush(acc, out, e, row0, col0, n_rows, K, a_scale, b_scale, hand, h, mma: gl.constexpr,
          EPI_WARPS: gl.constexpr):
    """The previous tile's epilogue: handed off (EPI_WARPS > 0; returns the next handoff's number) or written."""
    if EPI_WARPS > 0:
        if n_rows > 0:
            _hand_off(acc, a_scale, b_scale, hand, h)
            h += 1
    elif out.ADD_MODE >= 0:  # (-1: a traced dry run writes nothing)
        _write(acc, out, e, row0, col0, n_rows, K, a_scale, b_scale, mma)
    return h
