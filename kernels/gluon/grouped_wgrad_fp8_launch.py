"""Host launcher of ``grouped_wgrad_fp8.wgrad_kernel``: ``launch`` (FP8, from dy^T [N, T] and x^T [K, T]). It
checks only its own settings (the dispatcher checked the kernel module's preconditions), and looks the kernel up
on its module at each call, so a test that replaces it there replaces it here."""

from __future__ import annotations

import torch

from .._context import ensure_context
from .._launch import launch as launch_kernel
from . import grouped_wgrad_fp8 as _k

__all__ = ["launch", "trace_shape"]


def _tiles_and_strides(epilogue_warps: int, E: int, N: int, K: int, out, table, add_mode: int) -> tuple[int, tuple]:
    """(output tiles, out's (group, row, column) strides, group 0 with a ``table``), after checking
    the epilogue setting and that only a fresh output (``add_mode`` 0) is not fp32."""
    if epilogue_warps not in (0, 2):
        raise ValueError(f"grouped_wgrad_fp8: epilogue_warps must be 0 or 2, got {epilogue_warps!r}")
    if out.dtype != torch.float32 and add_mode != 0:
        raise ValueError(f"grouped_wgrad_fp8: only a fresh output (add_mode 0) may be {out.dtype}; one added into "
                         f"(add_mode {add_mode}) is fp32")
    tiles = E * -(-N // _k.BLOCK) * -(-K // _k.BLOCK)
    return tiles, (0,) + tuple(out.stride()) if table is not None else tuple(out.stride())


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
    tiles, so = _tiles_and_strides(epilogue_warps, E, N, K, out, table, add_mode)
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
    launch_kernel(
        _k.wgrad_kernel, (grid,),
        _k.descriptor(a_NT, (_k.BLOCK, _k.BLOCK)), _k.descriptor(b_KT, (_k.BLOCK, _k.BLOCK)), T,
        (offs_E, offs_E.stride(0), E, N, K), (out if table is None else table, *so, offs_E if first is None else first),
        (as_, bs, *scale_strides), (offs_E, 0) if trace is None else (trace, trace.shape[1]),
        TRACE=trace is not None, ZERO_EDGES=zero_edges, ADD_MODE=add_mode, PTR_TABLE=table is not None,
        FIRST=first is not None and add_mode > 0, BLOCKWISE=block != 0, GROUP_M=8, NUM_STAGES=stages,
        # no epilogue partition in a Triton without warp_specialize pairs
        EPI_WARPS=epilogue_warps if _k._WS_PAIRS else 0, EPI_ROWS=_k.EPI_ROWS, EPI_REGS=_k.EPI_REGS, num_warps=8)


def trace_shape(tiles: int, programs: int) -> tuple[int, int, int]:
    """The trace ``launch`` fills: per program, per tile it ran, (four clocks, chunks)."""
    return (programs, -(-tiles // programs), 5)
