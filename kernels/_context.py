"""A current CUDA context on the calling thread before a kernel builds TMA descriptors.

[Note: a current context on any thread]
The CUDA runtime binds a device's primary context to a thread lazily, at the first runtime call that needs
one; torch's device guard skips ``cudaSetDevice`` when ``cudaGetDevice`` already names the device, and on
a fresh thread ``cudaGetDevice`` answers device 0 with no context bound. Triton encodes host-side TMA
descriptors (``cuTensorMapEncodeTiled``, driver API) before its launcher makes sure of a context, so the
first launch on such a thread (the autograd engine's worker, a user's thread) can fail with "Failed to
create tensor map descriptor: invalid device context". :func:`ensure_context` binds the primary context
of the tensor's device when the thread's current context is missing or belongs to another device, as
TransformerEngine does before its own TMA descriptors. Its cost is one ``cuCtxGetCurrent`` per launch
once the thread is set up (a context pointer compared with the one already checked on this thread).
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

__all__ = ["ensure_context"]

_local = threading.local()


@functools.cache
def _libcuda() -> ctypes.CDLL | None:
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"distwgrad kernels: {what} failed with CUDA driver error {rc}")


def _current() -> int:
    lib = _libcuda()
    assert lib is not None
    ctx = ctypes.c_void_p()
    _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    return ctx.value or 0


def _bind_primary(index: int) -> int:
    lib = _libcuda()
    assert lib is not None
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    _check(lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx.value or 0


def _context_device() -> int:
    lib = _libcuda()
    assert lib is not None
    dev = ctypes.c_int()
    _check(lib.cuCtxGetDevice(ctypes.byref(dev)), "cuCtxGetDevice")
    return dev.value


def ensure_context(device: torch.device) -> None:
    """Makes ``device``'s primary context current on this thread if it is not; see the Note above."""
    if device.type != "cuda" or _libcuda() is None:
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    checked = getattr(_local, "checked", None)
    current = _current()
    if checked is not None and checked == (current, index):
        return
    if current == 0 or _context_device() != index:
        current = _bind_primary(index)
    _local.checked = (current, index)
