"""``zero_if_flagged(out, first)``: zeros an fp32 tensor where an int32 flag on the device says so.

The flag is read on the device, never on the host: every program loads it and returns at once when it is
0, so a CUDA graph keeps one launch for every replay and pays the zeroing only on the replays where the
flag is set ([Note: an unwritten accumulator] in ``distwgrad/weights/first_write.py``).
"""

import torch
import triton
import triton.language as tl

from ._context import ensure_context
from ._host import cdiv
from ._launch import launch

__all__ = ["zero_if_flagged"]

@triton.jit
def _zero_if_flagged_kernel(out_ptr, first_ptr, n, BLOCK: tl.constexpr):
    if tl.load(first_ptr) != 0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.zeros([BLOCK], tl.float32), mask=offs < n)


def zero_if_flagged(out: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """Zeroes ``out`` (a contiguous fp32 tensor) iff the int32 ``first`` (one element, same device) is not 0,
    without reading the flag on the host; returns ``out``."""
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"zero_if_flagged: out must be a contiguous float32 tensor, got {out.dtype} with strides "
                         f"{out.stride()}")
    if first.dtype != torch.int32 or first.numel() != 1 or first.device != out.device:
        raise ValueError(f"zero_if_flagged: first must be one int32 on {out.device}, got {first.dtype} of shape "
                         f"{tuple(first.shape)} on {first.device}")
    block = 8192  # fp32 elements a program zeroes: 32 KB, 16 bytes a thread and store with 8 warps
    if out.numel():
        ensure_context(out.device)  # [Note: a current context on any thread] in _context.py
        launch(_zero_if_flagged_kernel, (cdiv(out.numel(), block),), out, first, out.numel(), BLOCK=block, num_warps=8)
    return out
