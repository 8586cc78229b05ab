"""Calling a kernel's ``torch.library.custom_op`` or, in plain eager mode, its implementation directly.

[Note: custom op bypass]
Every kernel entry point is a ``torch.library.custom_op`` with a fake implementation, so that
torch.compile, torch.export and FakeTensorMode can trace it. In plain eager mode the dispatcher does
nothing for these ops but call the implementation, and that costs ~18 µs per call on a CI-class CPU
(docs/benchmarks/LOG.md): as much as the rest of a quantize call's host work, and of the order of
the kernel's own device time at training shapes. So the public functions call the implementation
directly when nothing could observe the difference, and go through the op otherwise:

- torch.compile / export tracing (``torch.compiler.is_compiling()``) and ``torch.jit.trace``: the op,
  so graphs keep one node;
- an active TorchDispatchMode (FakeTensorMode, FlopCounterMode, ...) or a functorch transform: the op;
- the autograd profiler on: the op, so traces name it (``distwgrad::...``);
- any argument that is not a plain ``torch.Tensor`` (FakeTensor, FunctionalTensor, DTensor, ...): the op.

A mutated argument's version counter is bumped as the op's in-place registration would do, so autograd's
saved-tensor checks see the same thing on both paths. Both paths run the same implementation, so the
results are the same bits (tests call both).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

__all__ = ["direct_call_ok", "call"]


def _plain(args: Iterable[object]) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) is not torch.Tensor:
                return False
        elif isinstance(a, (list, tuple)) and not _plain(a):
            return False
    return True


def direct_call_ok(args: Iterable[object]) -> bool:
    """True when calling a custom op's implementation directly is indistinguishable from the op."""
    if torch.compiler.is_compiling() or torch.autograd.profiler._is_profiler_enabled:
        return False
    if torch._C._get_tracing_state() is not None:  # torch.jit.trace
        return False
    if torch._C._len_torch_dispatch_stack() or torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    return _plain(args)


def call(op: Callable, impl: Callable, *args, mutated: tuple[int, ...] = ()):
    """``op(*args)``, or ``impl(*args)`` when ``direct_call_ok``; ``mutated``: indices of the arguments
    the op mutates (tensors or lists of tensors)."""
    if not direct_call_ok(args):
        return op(*args)
    out = impl(*args)
    for i in mutated:
        torch.autograd.graph.increment_version(args[i])
    return out
