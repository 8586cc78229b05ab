"""A graphed weight's first contribution of a step written into ``main_grad``, not added into zeros.

[Note: an unwritten accumulator]
Eagerly, a group of one's first contribution becomes its ``main_grad`` ([Note: a fresh first contribution]
in ``wgrad/accumulate.py``). A CUDA graph bakes in the address and replays the same work every microbatch,
so it cannot choose between writing and adding; rather than a memset per step and the first add's read
(two passes over every ``main_grad``: about 3% of the graphed ``large`` step, the "first-write flag A/B" rows
of ``docs/benchmarks/results.jsonl``), a captured weight carries a flag, one int32 on its device
(``weights/capture.py``):
* A step that opens sets the flag, leaving ``main_grad`` stale until the first contribution.
* A wgrad kernel given the flag (``first=`` of ``grouped_wgrad`` / ``grouped_wgrad_fp8``, through
  ``take_unwritten``) writes where it would add while it is set; the caller clears it after the launch.
* Any other first contribution settles first (``settle``): eagerly ``zero_()``, under capture a kernel that
  zeroes only if flagged. A step that ends with no contribution settles too: ``main_grad`` reads as zeros.
* The host mirrors the flag (``Lifecycle.armed``); graphed replays apply its changes ([Note: captured
  distributed weights] in ``distwgrad/graphs.py``).
The bits are those of adds into zeros, except that a -0.0 product stays -0.0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["new_flag", "zero_where_flagged", "settle"]


def new_flag(device: torch.device) -> torch.Tensor:
    """A clear flag: one int32 zero on ``device``."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def _kernel():
    """``distwgrad.kernels.flagged_zero.zero_if_flagged``, or None where Triton does not import."""
    try:
        from distwgrad.kernels.flagged_zero import zero_if_flagged
    except ImportError:
        return None
    return zero_if_flagged


def zero_where_flagged(out: torch.Tensor | Sequence[torch.Tensor], first: torch.Tensor) -> None:
    """Zeroes ``out`` (a tensor or a list) iff the flag ``first`` is set, reading it on the device only."""
    for t in [out] if isinstance(out, torch.Tensor) else out:
        kernel = _kernel() if t.is_cuda and t.dtype == torch.float32 and t.is_contiguous() else None
        if kernel is not None:
            kernel(t, first)
        else:
            t.masked_fill_(first.bool(), 0.0)


def settle(out: torch.Tensor, first: torch.Tensor, *, capturing: bool) -> None:
    """Zeroes ``out`` if flagged, then clears the flag; eagerly (the host knows it is set) a plain ``zero_()``."""
    if capturing:
        zero_where_flagged(out, first)
    else:
        out.zero_()
    first.zero_()
