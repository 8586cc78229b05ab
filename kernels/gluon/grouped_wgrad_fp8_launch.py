"""Host launchers of the Gluon wgrad kernel (``grouped_wgrad_fp8.wgrad_kernel``).

``launch``: the FP8 wgrad, per-tensor or blockwise recipe, from dy^T [N, T] and x^T [K, T] (tokens innermost).
``launch_tokens_outer``: the bf16 / fp16 wgrad from dy [T, N] and x [T, K] as the caller holds them
([Note: the bf16 wgrad in the fp8 kernel], below). Both run one program per SM (at most one per tile) and check
only their own settings; the dispatchers (``grouped_gemm_fp8._launch_gluon_wgrad``,
``grouped_gemm._launch_gluon_wgrad``) checked the preconditions in the kernel module's docstring. The
kernel, its descriptor helper and the Triton it was built with are looked up on the kernel module at
each call, so a test that replaces one there replaces it for the launchers too.

[Note: the bf16 wgrad in the fp8 kernel]
The same kernel serves the accumulating bf16 / fp16 wgrad (``TOKENS_OUTER``,
``grouped_wgrad_fp8_launch.launch_tokens_outer``; ``GroupedGemmTuning.wgrad_gluon``, where groups average
256 tokens or more): dy [T, N] and x [T, K] as the caller holds them, tokens outer. A stage is a [64 tokens,
128 rows] box of each (128 bytes per token row: the swizzle's line; 32 KB per stage as in FP8), and the MMA
reads both transposed (bf16 wgmma takes MN-major operands; fp8 does not, hence dy^T and x^T there). The
token is the box's outer coordinate, which TMA takes anywhere, so a group's chunks start at its first token
and only its last chunk can hold another group's tokens: those token rows of both stages are zeroed
(``tiles.zero_rows``), fenced and synchronized as for FP8, or never loaded ([Note: a group's tail
zero-filled by TMA]). The persistent schedule and the epilogue partition are the FP8 kernel's, the loop
chained ([Note: chained bf16 accumulation]); the scales are ones. bf16 MMAs run at half the fp8 rate, so at
E=64 a tile's MMAs take about twice as long while its fp32 epilogue stays, for the partition to hide.

[Note: a group's tail zero-filled by TMA]
In the bf16 wgrad a group's last chunk may run past the group's end, into the next group's tokens or
unrouted rows (which may be NaN). With GROUP_DESC (``launch_tokens_outer(tail="tma")``, the default) the TMA
warp builds descriptors of dy and x whose base is the group's first token and whose row extent is the
group's size, whenever its next tile belongs to another group than the last (``tma.make_tensor_descriptor``:
128 bytes each in Triton's global scratch, published to the TMA unit through the tensormap proxy's fences),
so TMA fills the rows past the end with zeros and the MMA warps zero nothing. A base at any token is 16-byte
aligned because the row stride is (a TMA requirement of the whole tensor already), which is why this serves
the tokens-outer bf16 stages and not the fp8 ones: there the token is the inner coordinate, and a group
starting off a 16-token boundary cannot be the base of a descriptor ([Note: fp8 wgrad chunks] in
``grouped_gemm_fp8``). With tail="zero" the whole-tensor descriptors load the chunk and the MMA warps zero
the rows past the end (``tiles.zero_rows``); a Triton whose allocator setting cannot be reached runs that.

[Note: chained bf16 accumulation]
The promoting loop keeps each chunk's partial in its own registers and adds it to the tile's sum under the
next chunk's MMAs: fp8 needs that (its wgmma accumulates at reduced precision), bf16 does not. With CHAIN
(what ``launch_tokens_outer`` launches) a bf16 tile's chunks after the first accumulate into the registers
of the first (``use_acc=True``): no adds, no second register set, one wait per chunk for the chunk before
it, as a plain Hopper matmul's loop. The sums are fp32 either way, in another order.
"""

from __future__ import annotations

import functools

import torch

from .._context import ensure_context
from . import grouped_wgrad_fp8 as _k

__all__ = ["launch", "launch_tokens_outer", "trace_shape", "TAILS"]

TAILS = ("tma", "zero")  # how a group's last chunk loses the next group's tokens ([Note: a group's tail
#                          zero-filled by TMA])
_ONES: dict = {}   # a device's fp32 one: the bf16 wgrad's "scales"


def _tiles_and_strides(what: str, epilogue_warps: int, E: int, N: int, K: int, out, table,
                       add_mode: int) -> tuple[int, tuple]:
    """(output tiles, the output's (group, row, column) strides: group 0 with a ``table``) after checking
    what both launchers share: the epilogue setting, and an fp32 ``out`` unless fresh (``add_mode`` 0)."""
    if epilogue_warps not in (0, 2):
        raise ValueError(f"{what}: epilogue_warps must be 0 or 2, got {epilogue_warps!r}")
    if out.dtype != torch.float32 and add_mode != 0:
        raise ValueError(f"{what}: only a fresh output (add_mode 0) may be {out.dtype}; one added into "
                         f"(add_mode {add_mode}) is fp32")
    tiles = E * -(-N // _k.BLOCK) * -(-K // _k.BLOCK)
    return tiles, (0,) + tuple(out.stride()) if table is not None else tuple(out.stride())


def _epilogue_meta(epilogue_warps: int, stages: int) -> dict:
    """The launch options both launchers pass: the ring depth, the epilogue partition (a Triton whose
    warp_specialize takes no (function, args) pairs runs without it: the same bits) and its shape."""
    return dict(GROUP_M=8, NUM_STAGES=stages, EPI_WARPS=epilogue_warps if _k._WS_PAIRS else 0,
                EPI_ROWS=_k.EPI_ROWS, EPI_REGS=_k.EPI_REGS, num_warps=8)


def _columns_major(bs, K: int):
    """x^T's blockwise scales [K, chunks] as the kernel reads them: [chunks, K rounded up to the tile], columns
    contiguous, the padding zeros ([Note: blockwise wgrad scales])."""
    C = bs.shape[1]
    cols = torch.zeros(C, -(-K // _k.BLOCK) * _k.BLOCK, dtype=torch.float32, device=bs.device)
    cols[:, :K].copy_(bs.t())
    return cols


def launch(a_NT, as_, b_KT, bs, offs_E, out, table, *, add_mode: int, stages: int, epilogue_warps: int,
           num_sms: int, trace=None, zero_edges: bool = True, first=None, block: int = 0) -> None:
    """``wgrad_kernel`` on one program per SM (at most one per tile): dW_e into the stacked ``out`` ([E, N, K];
    fp32, or bf16/fp16 for a fresh one) or, with ``table`` (int64 bases), into the per-group buffers shaped and
    strided like ``out``; ``add_mode`` 0 fresh, 1 load-add-store, 3 fp32 reductions, -1 nothing (a traced dry
    run: the epilogue warps still read each handed-off tile); ``epilogue_warps`` 0 (the MMA warps write each
    tile) or 2 ([Note: an epilogue partition]; a Triton whose warp_specialize takes (function, args) pairs:
    older ones run 0, the same bits). ``trace``: None, or an int64 tensor [programs, tiles, 5] that receives the
    MMA warps' tile phases ([Note: tracing the MMA warps' tile phases]; ``trace_shape`` gives its shape).
    ``zero_edges`` False skips zeroing the edge chunks' foreign tokens: a traced dry run's diagnostic only (what
    the zeroing costs), refused otherwise. ``first``: None, or an int32 flag on the device that, when not 0, says
    ``out`` holds nothing yet (an accumulating launch then writes every tile: [Note: an unwritten
    accumulator] in ``distwgrad/weights/first_write.py``). ``block``: 0 for per-tensor scales (``as_``, ``bs``
    one element each), else the blockwise recipe's tile along the tokens, which must be the kernel's chunk
    (``BLOCK``): ``as_`` [N, chunks] and ``bs`` [K, chunks] ([Note: blockwise wgrad scales])."""
    ensure_context(a_NT.device)  # [Note: a current context on any thread] in kernels/_context.py
    N, T = a_NT.shape
    K = b_KT.shape[0]
    E = offs_E.shape[0]
    if block not in (0, _k.BLOCK):
        raise ValueError(f"grouped_wgrad_fp8: the Gluon kernel's chunk is {_k.BLOCK} tokens; blockwise scales of "
                         f"1x{block} tiles go to the Triton kernel")
    tiles, so = _tiles_and_strides("grouped_wgrad_fp8", epilogue_warps, E, N, K, out, table, add_mode)
    if block:
        bs = _columns_major(bs, K)
        scale_strides = (as_.stride(0), as_.stride(1), 1, bs.stride(0))
    else:
        scale_strides = (0, 0, 0, 0)
    grid = min(tiles, num_sms)
    if add_mode == -1 and trace is None:
        raise ValueError("grouped_wgrad_fp8: add_mode -1 writes nothing: it is a traced dry run, pass trace=")
    if not zero_edges and add_mode != -1:
        raise ValueError(f"grouped_wgrad_fp8: zero_edges=False would add other groups' tokens: only a traced dry "
                         f"run (add_mode -1) may skip it, got add_mode {add_mode}")
    if trace is not None and tuple(trace.shape) != trace_shape(tiles, grid):
        raise ValueError(f"grouped_wgrad_fp8: trace must be shaped {trace_shape(tiles, grid)}, got "
                         f"{tuple(trace.shape)}")
    _k.wgrad_kernel[(grid,)](
        _k.descriptor(a_NT, (_k.BLOCK, _k.BLOCK)), _k.descriptor(b_KT, (_k.BLOCK, _k.BLOCK)), as_, bs,
        out if table is None else table, offs_E, T, E, N, K, so[0], so[1], so[2], offs_E.stride(0),
        offs_E if trace is None else trace, 0 if trace is None else trace.shape[1], a_NT, b_KT, 0, 0,
        offs_E if first is None else first, *scale_strides, TRACE=trace is not None, ZERO_EDGES=zero_edges,
        ADD_MODE=add_mode, PTR_TABLE=table is not None, FIRST=first is not None and add_mode > 0,
        BLOCKWISE=block != 0, **_epilogue_meta(epilogue_warps, stages))


@functools.cache
def _allocator():
    """Triton's allocator setting for a launch's global scratch (a ContextVar), or None in a Triton without
    one: the per-group descriptors then cannot be built, and the tail is zeroed instead. Looked up once:
    every bf16 wgrad launch asks."""
    from contextvars import ContextVar

    from triton.runtime import _allocation
    var = getattr(_allocation, "_allocator", None)
    return var if isinstance(var, ContextVar) else None


def launch_tokens_outer(dy_TN, x_TK, offs_E, out, table, *, add_mode: int, stages: int, epilogue_warps: int,
                        num_sms: int, tail: str = "tma", first=None) -> None:
    """The bf16 / fp16 wgrad in ``wgrad_kernel`` (TOKENS_OUTER, [Note: the bf16 wgrad in the fp8 kernel]): dW_e =
    dy[g]^T @ x[g] over the tokens g of group e from dy [T, N] and x [T, K] as they are, into the stacked
    ``out`` ([E, N, K]; fp32, or dy's dtype for a fresh one) or the per-group buffers of ``table`` (int64 bases,
    each shaped and strided like ``out``); ``add_mode`` 0 fresh, 1 load-add-store, 3 fp32 reductions. ``tail``:
    "tma" loads each group through descriptors of its own tokens, so TMA fills a last chunk's rows past the
    group with zeros; "zero" loads through whole-tensor descriptors and the MMA warps zero those rows ([Note: a
    group's tail zero-filled by TMA]). Each chunk's MMAs accumulate into the tile's registers ([Note: chained
    bf16 accumulation]). ``first``: as in ``launch``."""
    if tail not in TAILS:
        raise ValueError(f"grouped_wgrad: tail must be one of {TAILS}, got {tail!r}")
    ensure_context(dy_TN.device)  # [Note: a current context on any thread] in kernels/_context.py
    T, N = dy_TN.shape
    K = x_TK.shape[1]
    E = offs_E.shape[0]
    tiles, so = _tiles_and_strides("grouped_wgrad", epilogue_warps, E, N, K, out, table, add_mode)
    ones = _ONES.get(dy_TN.device)
    if ones is None:
        ones = _ONES[dy_TN.device] = torch.ones((), dtype=torch.float32, device=dy_TN.device)
    var = _allocator() if tail == "tma" else None
    group_desc = var is not None
    # the kernel's descriptors live in Triton's global scratch: torch's caching allocator for this launch
    # (a caller's own allocator is restored after it)
    dev = dy_TN.device
    token = var.set(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=dev)) \
        if group_desc else None
    block = (_k.BLOCK_K_16, _k.BLOCK)
    try:
        _k.wgrad_kernel[(min(tiles, num_sms),)](
            _k.descriptor(dy_TN, block), _k.descriptor(x_TK, block), ones, ones,
            out if table is None else table, offs_E, T, E, N, K, so[0], so[1], so[2], offs_E.stride(0), offs_E, 0,
            dy_TN, x_TK, dy_TN.stride(0), x_TK.stride(0), offs_E if first is None else first, 0, 0, 0, 0, TRACE=False,
            ZERO_EDGES=not group_desc, TOKENS_OUTER=True, GROUP_DESC=group_desc, CHAIN=True, ADD_MODE=add_mode,
            PTR_TABLE=table is not None, FIRST=first is not None and add_mode > 0,
            **_epilogue_meta(epilogue_warps, stages))
    finally:
        if token is not None:
            var.reset(token)


def trace_shape(tiles: int, programs: int) -> tuple[int, int, int]:
    """The trace ``launch`` fills: per program, per tile it ran, (four clocks, chunks)."""
    return (programs, -(-tiles // programs), 5)
