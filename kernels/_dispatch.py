"""Calling a kernel's ``torch.library.custom_op`` or, in plain eager mode, its implementation directly.

[Note: custom op bypass]
Kernel entry points are custom ops with fake implementations, so torch.compile, export and FakeTensorMode can
trace them; in plain eager mode the dispatcher only calls the implementation, at a cost (~18 us a call) as large
as the rest of a quantize call's host work. So the public functions call the implementation directly unless
something could observe it: compile/export or ``torch.jit.trace`` tracing, an active TorchDispatchMode or
functorch transform, the autograd profiler (traces name the op), or an argument that is not a plain
``torch.Tensor``. A mutated argument's version counter is bumped as the op would, so autograd's saved-tensor
checks agree; both paths run the same implementation, so the bits are the same.
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
    """``op(*args)``, or ``impl(*args)`` when ``direct_call_ok``; ``mutated``: indices of mutated arguments."""
    if not direct_call_ok(args):
        return op(*args)
    out = impl(*args)
    for i in mutated:
        torch.autograd.graph.increment_version(args[i])
    return out
