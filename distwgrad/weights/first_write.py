"""A graphed weight's first contribution of a step written into ``main_grad``, not added into zeros.

[Note: an unwritten accumulator]
A weight of a group of one accumulates in its own ``main_grad`` ([Note: a group of one] in
``weights/base.py``). Eagerly, the step's first contribution arrives as a fresh tensor that becomes
``main_grad`` ([Note: a fresh first contribution] in ``wgrad/accumulate.py``): no zeros are written or
read. A CUDA graph cannot do that: it bakes ``main_grad``'s address in, and the same graphs replay for
every microbatch, so the host cannot choose between writing (a step's first microbatch) and adding (the
others). Zeroing ``main_grad`` when each step opens costs a memset of 4 bytes per parameter, and the first
wgrad then reads those zeros back. So a weight that graphed callables captured carries a flag, one int32 on
its device (set by ``distwgrad.make_graphed_callables`` through ``weights/capture.py``):

* A step that opens sets the flag (``fill_(1)``) and leaves ``main_grad`` as it is; what it holds is stale
  until the first contribution.
* A wgrad kernel given the flag (``first=`` of ``grouped_wgrad`` and ``grouped_wgrad_fp8``: the Triton and
  Gluon kernels, bf16 and FP8) reads it on the device: set, every tile of the output is written where it
  would be added into (an empty group's as zeros); the caller clears the flag after the launch
  (``first.zero_()``, ordered after the kernel on the stream). ``run_wgrad(..., unwritten=)`` is that path,
  taken for a lone weight while its flag may be set (``DistributedParameter.take_unwritten``).
* Any other first contribution (cuBLAS's dense wgrad, a bias, a list of weights, the reference routes)
  settles first (``settle``): eagerly ``main_grad.zero_()``; under capture a kernel that reads the flag and
  returns at once when it is clear (``zero_where_flagged``), so the graph's later microbatches pay one launch,
  not a memset; then the flag is cleared.
* The host mirrors the flag (``_armed``: set when the step opens, cleared by the first contribution), so
  eager code settles only where it must; the graphed callables replay its changes with the rest of the
  accounting ([Note: captured distributed weights] in ``distwgrad/graphs.py``). A step that ends, or is
  discarded, before any contribution settles too, so ``main_grad`` reads as zeros then, as before.

The bits are those of the adds into zeros (the kernels' fp32 accumulator, stored), except that a -0.0
product stays -0.0, as with a fresh first contribution. ``main_grad`` is read after the step's last
contribution (finalize, the optimizer), as always; in between it is the step's partial sum, and before the
first contribution of a step, the previous step's values.
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
    """Zeroes ``out`` (a tensor or a list of them) iff the flag ``first`` is set, reading it on the device
    only: on CUDA a kernel whose programs return at once when it is clear, elsewhere ``masked_fill_``."""
    for t in [out] if isinstance(out, torch.Tensor) else out:
        kernel = _kernel() if t.is_cuda and t.dtype == torch.float32 and t.is_contiguous() else None
        if kernel is not None:
            kernel(t, first)
        else:
            t.masked_fill_(first.bool(), 0.0)


def settle(out: torch.Tensor, first: torch.Tensor, *, capturing: bool) -> None:
    """Makes ``out`` hold zeros where the flag says it holds nothing, then clears the flag: under capture
    conditionally on the device (``zero_where_flagged``), eagerly (where the host knows the flag is set)
    with a plain ``zero_()``."""
    if capturing:
        zero_where_flagged(out, first)
    else:
        out.zero_()
    first.zero_()
