"""The Gluon kernels (Hopper, sm_90a) and what they share: the Gluon imports and the portability shims
between the Triton releases we support (>= 3.4), and ``descriptor``.

Gluon is experimental: a Triton without it still imports every module here. ``AVAILABLE`` is then False,
``gluon.jit`` makes each kernel function None, ``aggregate`` leaves each struct a plain class and ``gl``
answers every name with ``object`` (the annotations' types), so that the dispatchers, which check
``AVAILABLE`` first, send every call to the Triton kernels.

Modules: ``tiles`` (a persistent program's tiles over ragged groups, the operand ring, the epilogue's
stores and the edge chunks' zeroing), ``grouped_gemm_fp8`` (fprop/dgrad and the promoting loop),
``grouped_wgrad_fp8`` (the FP8 wgrad; its epilogue partition in ``wgrad_epilogue``),
``grouped_wgrad_fp8_launch`` (the wgrad's host launcher), ``quantize_rowcol`` (rows + columns FP8
quantization). State that several helpers share travels in ``@aggregate`` structs (the Triton Gluon
tutorial on persistent kernels); they hold no ``from __future__ import annotations``, because Triton
before 3.9 reads a struct's field types from its annotations as they are.
"""

import functools
import inspect
from types import SimpleNamespace

import torch
import triton.language as tl

from .._context import ensure_context

try:  # Gluon is experimental (triton >= 3.4); without it the Triton kernels serve every call
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed triton
    gluon = gl = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None
try:  # cp.async, for the blockwise wgrad's column scales
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as _async_copy
except ImportError:  # pragma: no cover - depends on the installed triton
    _async_copy = None

AVAILABLE = gluon is not None
# TMA global -> shared: ``async_load`` in newer Tritons, ``async_copy_global_to_shared`` before (same arguments)
tma_load = getattr(tma, "async_load", None) or getattr(tma, "async_copy_global_to_shared", None)
# cp.async global -> shared (no registers): ``async_load`` in newer Tritons, ``async_copy_global_to_shared``
# before; and the arrival on an mbarrier once the thread's copies have landed
async_load = getattr(_async_copy, "async_load", None) or getattr(_async_copy, "async_copy_global_to_shared", None)
async_mbarrier_arrive = getattr(_async_copy, "mbarrier_arrive", None)
# CTA-wide (in a warp-specialized partition: partition-wide) barrier: ``gl.barrier`` in newer Tritons
thread_barrier = getattr(gl, "thread_barrier", None) or getattr(gl, "barrier", None)
# a shared-memory view in another shape / layout: ``reinterpret`` in newer Tritons, ``_reinterpret`` before
REINTERPRET = tl.constexpr(gl is not None and hasattr(gl.shared_memory_descriptor, "reinterpret"))
# ``gl.warp_specialize``: a list of (function, args) pairs in newer Tritons; before, (default_args,
# default_partition, worker_args, worker_partitions, ...)
WS_PAIRS = tl.constexpr(gl is not None and hasattr(gl, "warp_specialize") and next(
    iter(inspect.signature(gl.warp_specialize).parameters)) == "functions_and_args")
_GL_DTYPES = {"torch.float8_e4m3fn": "float8e4nv", "torch.float8_e5m2": "float8e5"}  # descriptor(): FP8 operands

if AVAILABLE:
    # structs of tensors, shared-memory views and constexprs (``triton.experimental.gluon.aggregate`` since
    # Triton 3.9; ``triton.language.core._aggregate`` before, as the 3.4-3.6 tutorials import it). Each
    # struct writes its ``__init__`` out: Triton before 3.9 makes none
    aggregate = getattr(gluon, "aggregate", None) or tl.core._aggregate
    # a struct's ``__init__`` runs at compile time on its arguments, the constexprs among them unwrapped
    constexpr_function = getattr(gluon, "constexpr_function", None) or (lambda fn: fn)
else:  # pragma: no cover - depends on the installed triton
    class _Names:
        """``gl``, ``mbarrier``, ``tma`` without Gluon: ``object`` for every name (annotations only)."""

        def __getattr__(self, name):
            return object

    def _no_kernel(fn=None, **_):
        """``gluon.jit`` without Gluon: the function becomes None (``@gluon.jit(...)`` as well)."""
        return _no_kernel if fn is None else None

    gl = mbarrier = tma = _Names()
    gluon = SimpleNamespace(jit=_no_kernel)
    aggregate = constexpr_function = lambda cls: cls  # noqa: E731

__all__ = ["AVAILABLE", "REINTERPRET", "WS_PAIRS", "TensorDescriptor", "aggregate", "constexpr_function", "descriptor",
           "field",
           "fence_async_shared", "gl", "gluon", "mbarrier", "thread_barrier", "tma", "tma_load", "async_load",
           "async_mbarrier_arrive", "warpgroup_mma",
           "warpgroup_mma_wait"]


@constexpr_function
def field(value):
    """A struct field as ``__init__`` receives it: a tensor or shared-memory view as it is, anything else (a
    constexpr's value: an int the JIT specialized, a flag, a layout) as a constexpr again."""
    return value if isinstance(value, tl.core.base_value) else tl.constexpr(value)


def descriptor(t, block_shape):
    """A Gluon TMA descriptor of 2-D ``t`` (unit inner stride) with the default swizzle for its tiles."""
    ensure_context(t.device)  # [Note: a current context on any thread]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block_shape), _layout(tuple(block_shape), t.dtype))


@functools.lru_cache(maxsize=256)
def _layout(block_shape: tuple[int, ...], dtype: torch.dtype):
    """The default swizzled layout of ``block_shape`` tiles of ``dtype``: a frozen value, made once (it takes most of a
    descriptor's host time, which every launch pays)."""
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), getattr(gl, _GL_DTYPES[str(dtype)]))
