"""``launch(kernel, grid, *args, **kwargs)``: ``kernel[grid](*args, **kwargs)`` at a fraction of the host time.

[Note: cached launches]
Triton's ``JITFunction.run`` binds and specializes every argument, reads its knobs, looks the compiled kernel up
and checks the kernel's globals on every launch: about 11 µs of host time for a four-argument kernel on an H100
host, against 6 µs for the compiled kernel's own launcher (docs/benchmarks/LOG.md). An FP8 step launches about
300 of them a microbatch, where the host can be the bound (docs/fp8.md). So ``launch`` keeps, per kernel, the
compiled kernel each argument key ran, and calls its launcher directly.

The key decides which compiled kernel runs, so it holds everything Triton specializes on, and more: each tensor's
dtype and address modulo 16 (Triton: divisible by 16 or not); each int, bool, float and string by value (Triton: an
int's width, divisibility by 16 and equality to 1; constexprs by value); a tuple's elements, each as above; a host
tensor descriptor's (Triton's or Gluon's) base tensor as above and every other field (shape, strides, block shape,
layout, ...) by value; ``None``; the keywords' names (constexprs, launch options); and the current device, where
Triton launches. Anything else, more than ``_MAX_KEYS`` keys for one kernel, a launch or pre-run hook (a
profiler's), the interpreter or a stand-in kernel take ``kernel[grid]`` itself: the same kernel, never a guess. A
key's first launch goes through ``kernel[grid]`` too, which compiles; what it returns is kept. Triton's refusal of a
kernel whose globals changed after it compiled is not repeated: the kernels are fixed at import.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["launch"]

_MAX_KEYS = 256  # per kernel: a training run sees few shapes, dtypes and alignments

_DESCRIPTORS: tuple[type, ...] = ()
try:
    from triton import knobs as _knobs
    from triton.runtime.jit import JITFunction as _JITFunction
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
    _DESCRIPTORS = (_TensorDescriptor,)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDescriptor
    _DESCRIPTORS = (_TensorDescriptor, _GluonDescriptor)
except ImportError:  # a Triton without knobs (before 3.4) or Gluon, or none
    if not _DESCRIPTORS:
        _knobs = _JITFunction = None

_CACHES: dict[int, tuple[Any, dict]] = {}  # id(kernel) -> (kernel, {key: (compiled, the parameters after args)})
_PLAIN = (int, bool, float, str, type(None))


def _key(values) -> tuple | None:
    """What selects the compiled kernel, or None for a value it cannot say."""
    key: list = []
    for a in values:
        t = type(a)
        if isinstance(a, torch.Tensor):
            key.append(a.dtype)
            key.append(a.data_ptr() & 15)
        elif t in _PLAIN:
            key.append(t)
            key.append(a)
        elif t in _DESCRIPTORS:
            key.append(t)
            for name, v in vars(a).items():  # its fields, as this Triton has them
                key.append(name)
                if name == "base":
                    key.append(v.dtype)
                    key.append(v.data_ptr() & 15)
                else:
                    key.append(tuple(v) if type(v) is list else v)
        elif t is torch.dtype or t.__module__.startswith("triton.language"):  # a dtype given as a constexpr
            key.append(t)
            key.append(a)
        elif t is tuple:  # Triton binds a tuple argument's elements as it binds arguments
            inner = _key(a)
            if inner is None:
                return None
            key.append(tuple)
            key.append(inner)
        else:
            return None
    return tuple(key)


def _hooked() -> bool:
    """Whether a launch hook is set (Triton 3.4-3.6: a callable or None; later: a chain of callables)."""
    rt = _knobs.runtime
    return any(h is not None and getattr(h, "calls", True) for h in (rt.launch_enter_hook, rt.launch_exit_hook))


def launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` ([Note: cached launches]); ``grid``: a tuple of one to three ints."""
    if (_JITFunction is None or not isinstance(kernel, _JITFunction) or getattr(kernel, "pre_run_hooks", None)
            or _hooked()):
        kernel[grid](*args, **kwargs)
        return
    entry = _CACHES.get(id(kernel))
    if entry is None or entry[0] is not kernel:
        entry = _CACHES[id(kernel)] = (kernel, {})
    cache = entry[1]
    device = torch.cuda.current_device()  # where Triton launches; a compiled kernel is loaded on one device
    key = _key(args)
    if key is not None:
        kw = _key(kwargs.values())
        key = None if kw is None else (device, key, tuple(kwargs), kw)
    try:
        hit = cache.get(key) if key is not None else None
    except TypeError:  # an unhashable layout object
        hit = key = None
    if hit is None:
        compiled = kernel[grid](*args, **kwargs)
        if (key is not None and len(cache) < _MAX_KEYS and hasattr(compiled, "packed_metadata")
                and hasattr(compiled, "function")):  # the launcher's form since Triton 3.2 (inductor's too)
            cache[key] = (compiled, _tail(kernel, len(args), kwargs))
        return
    compiled, tail = hit
    stream = torch._C._cuda_getCurrentRawStream(device)
    n = len(grid)
    compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, compiled.function,
                 compiled.packed_metadata, None, None, None, *args,
                 *[kwargs[name] if name in kwargs else default for name, default in tail])


def _tail(kernel, positional: int, kwargs: dict) -> tuple[tuple[str, Any], ...]:
    """The parameters after the positional arguments, in the kernel's order, each with its default: the launcher
    takes every parameter (constexprs too) by position; keywords that name no parameter are launch options."""
    return tuple((p.name, p.default if p.has_default else None) for p in kernel.params[positional:])
