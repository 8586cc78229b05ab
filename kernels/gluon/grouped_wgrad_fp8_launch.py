"""Host launchers of ``grouped_wgrad_fp8.wgrad_kernel``: ``launch`` (FP8, from dy^T [N, T] and x^T [K, T]) and
``launch_tokens_outer`` (bf16 / fp16, from dy [T, N] and x [T, K]). They check only their own settings (the
dispatchers checked the kernel module's preconditions), and look the kernel up on its module at each call, so a
test that replaces it there replaces it here.

[Note: the bf16 wgrad in the fp8 kernel]
The same kernel (TOKENS_OUTER) serves the accumulating bf16 / fp16 wgrad (``GroupedGemmTuning.wgrad_gluon``)
from dy and x as held, tokens outer: a stage is a [64 tokens, 128 rows] box of each (128-byte rows, the swizzle's
line), read transposed by the MMA (bf16 wgmma takes MN-major operands; fp8 does not, hence dy^T, x^T there). TMA
takes the outer coordinate anywhere, so a group's chunks start at its first token and only its last chunk can
hold other tokens ([Note: a group's tail zero-filled by TMA]). The loop is chained ([Note: chained bf16
accumulation]), the scales ones; schedule and epilogue are the FP8 kernel's.

[Note: a group's tail zero-filled by TMA]
A bf16 group's last chunk may run into the next group's tokens (possibly NaN). With GROUP_DESC (``tail="tma"``)
the TMA warp builds descriptors of dy and x covering the group alone whenever its tiles change group
(``tma.make_tensor_descriptor``, in Triton's global scratch), so TMA zero-fills past the end. The scratch is one
slot per call site, rewritten in place: the TMA warp first waits until every load it issued has landed, else a
load still in flight reads the next group's descriptor (a wrong tile, no error). Any token is a
16-byte-aligned base because the row stride is; not so fp8's inner token coordinate ([Note: fp8 wgrad chunks] in
``grouped_gemm_fp8``). ``tail="zero"`` (a Triton without the allocator setting): the MMA warps zero those rows.

[Note: chained bf16 accumulation]
fp8 needs each chunk's partial apart (its wgmma accumulates at reduced precision); bf16 does not. With CHAIN a
tile's chunks accumulate into one register set (``use_acc=True``): no adds. Still fp32 sums, in another order."""

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
    """(output tiles, out's (group, row, column) strides, group 0 with a ``table``), after checking
    the epilogue setting and that only a fresh output (``add_mode`` 0) is not fp32."""
    if epilogue_warps not in (0, 2):
        raise ValueError(f"{what}: epilogue_warps must be 0 or 2, got {epilogue_warps!r}")
    if out.dtype != torch.float32 and add_mode != 0:
        raise ValueError(f"{what}: only a fresh output (add_mode 0) may be {out.dtype}; one added into "
                         f"(add_mode {add_mode}) is fp32")
    tiles = E * -(-N // _k.BLOCK) * -(-K // _k.BLOCK)
    return tiles, (0,) + tuple(out.stride()) if table is not None else tuple(out.stride())


def _epilogue_meta(epilogue_warps: int, stages: int) -> dict:
    """The launch options both launchers pass (no epilogue partition in a Triton without warp_specialize pairs)."""
    return dict(GROUP_M=8, NUM_STAGES=stages, EPI_WARPS=epilogue_warps if _k._WS_PAIRS else 0,
                EPI_ROWS=_k.EPI_ROWS, EPI_REGS=_k.EPI_REGS, num_warps=8)


def _columns_major(bs, K: int):
    """x^T's blockwise scales [K, chunks] as the kernel reads them: [chunks, K rounded up to BLOCK], zero-padded."""
    C = bs.shape[1]
    cols = torch.zeros(C, -(-K // _k.BLOCK) * _k.BLOCK, dtype=torch.float32, device=bs.device)
    cols[:, :K].copy_(bs.t())
    return cols


def launch(a_NT, as_, b_KT, bs, offs_E, out, table, *, add_mode: int, stages: int, epilogue_warps: int,
           num_sms: int, trace=None, zero_edges: bool = True, first=None, block: int = 0) -> None:
    """The FP8 wgrad, one program per SM: dW_e into the stacked ``out`` [E, N, K] (fp32; bf16 / fp16 when
    fresh) or, with ``table`` (int64 bases), into per-group buffers shaped and strided like ``out``. ``add_mode``: 0
    fresh, 1 load-add-store, 3 fp32 reductions, -1 nothing (a traced dry run, where alone ``zero_edges=False`` is
    allowed). ``epilogue_warps``: 0 or 2 ([Note: an epilogue partition]). ``trace``: None or an int64 tensor shaped
    ``trace_shape(tiles, programs)`` ([Note: tracing the MMA warps' tile phases]). ``first``: None or a device int32
    flag, non-zero while ``out`` holds nothing ([Note: an unwritten accumulator] in ``distwgrad/weights``).
    ``block``: 0 per-tensor (``as_``, ``bs`` one element each), or ``BLOCK`` with ``as_`` [N, chunks] and ``bs`` [K,
    chunks]. Raises ValueError on any other ``block`` or a setting these rules refuse."""
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
        _k.descriptor(a_NT, (_k.BLOCK, _k.BLOCK)), _k.descriptor(b_KT, (_k.BLOCK, _k.BLOCK)), T,
        (offs_E, offs_E.stride(0), E, N, K), (out if table is None else table, *so, offs_E if first is None else first),
        (as_, bs, *scale_strides), (a_NT, b_KT, 0, 0), (offs_E, 0) if trace is None else (trace, trace.shape[1]),
        TRACE=trace is not None, ZERO_EDGES=zero_edges, ADD_MODE=add_mode, PTR_TABLE=table is not None,
        FIRST=first is not None and add_mode > 0, BLOCKWISE=block != 0, **_epilogue_meta(epilogue_warps, stages))


@functools.cache
def _allocator():
    """Triton's allocator ContextVar for global scratch, or None (a Triton without one: the tail is zeroed instead)."""
    from contextvars import ContextVar

    from triton.runtime import _allocation
    var = getattr(_allocation, "_allocator", None)
    return var if isinstance(var, ContextVar) else None


def launch_tokens_outer(dy_TN, x_TK, offs_E, out, table, *, add_mode: int, stages: int, epilogue_warps: int,
                        num_sms: int, tail: str = "tma", first=None) -> None:
    """The bf16 / fp16 wgrad ([Note: the bf16 wgrad in the fp8 kernel]): dW_e = dy[g]^T @ x[g]
    over group e's tokens, from dy [T, N] and x [T, K] as they are; ``out``, ``table``, ``add_mode`` (not -1),
    ``first`` as in ``launch``, a fresh ``out`` in dy's dtype. ``tail``: one of TAILS ([Note: a group's tail
    zero-filled by TMA]); a ValueError otherwise."""
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
            _k.descriptor(dy_TN, block), _k.descriptor(x_TK, block), T, (offs_E, offs_E.stride(0), E, N, K),
            (out if table is None else table, *so, offs_E if first is None else first), (ones, ones, 0, 0, 0, 0),
            (dy_TN, x_TK, dy_TN.stride(0), x_TK.stride(0)), (offs_E, 0), TRACE=False,
            ZERO_EDGES=not group_desc, TOKENS_OUTER=True, GROUP_DESC=group_desc, CHAIN=True, ADD_MODE=add_mode,
            PTR_TABLE=table is not None, FIRST=first is not None and add_mode > 0,
            **_epilogue_meta(epilogue_warps, stages))
    finally:
        if token is not None:
            var.reset(token)


def trace_shape(tiles: int, programs: int) -> tuple[int, int, int]:
    """The trace ``launch`` fills: per program, per tile it ran, (four clocks, chunks)."""
    return (programs, -(-tiles // programs), 5)
