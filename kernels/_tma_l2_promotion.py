"""The L2 fetch size of Triton's host-side TMA descriptors.

[Note: TMA L2 promotion]
A TMA descriptor carries an "L2 promotion": the granularity at which a load that misses L2 is filled
from HBM (64, 128 or 256 bytes). Triton encodes every host-side descriptor with 128 bytes; CUTLASS's
TMA copies ask for 256. A [rows, 64] bf16 box reads 128 contiguous bytes of each row, and the next
K step reads the next 128: with 256-byte fills one HBM access serves two steps, so a kernel that
streams a matrix too large for L2 (the ~128-token experts of E=128, bound by reading every expert's
weights once) opens half as many DRAM pages for the same bytes. The value changes no result: it is a
hint about fetch size, never about which bytes land in shared memory.

Triton does not expose the field, so ``l2_promotion`` wraps the driver's descriptor fill: it lets
Triton encode the descriptor, encodes the same arguments itself through ``cuTensorMapEncodeTiled``
with Triton's 128 bytes and checks that the two agree byte for byte (so the arguments and the
descriptor's place in Triton's object are understood), then rewrites it with the requested size. If
anything differs (another Triton version, a driver without the entry point) it leaves Triton's
descriptor alone and says so once.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import warnings
from collections.abc import Iterator

__all__ = ["PROMOTIONS", "l2_promotion", "encode_tiled"]

# CUtensorMapL2promotion
PROMOTIONS = {0: 0, 64: 1, 128: 2, 256: 3}
_TRITON_DEFAULT = 128
_FILL_NAMES = ("fill_tma_descriptor_tiled", "fill_tma_descriptor")  # Triton >= 3.7, Triton 3.4-3.6
_MAP_OFFSET = 128  # PyCUtensorMapObject: PyObject_HEAD, then an _Alignas(128) CUtensorMap


@functools.cache
def _encoder():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def encode_tiled(address: int, swizzle: int, elem_size: int, elem_type: int, block: list[int], shape: list[int],
                 strides: list[int], padding: int, promotion_bytes: int) -> bytes:
    """The 128-byte CUtensorMap for Triton's fill arguments (outermost dimension first, strides in
    elements), with ``promotion_bytes`` of L2 promotion."""
    rank = len(block)
    dims = (ctypes.c_uint64 * 5)(*reversed([int(s) for s in shape]))
    byte_strides = (ctypes.c_uint64 * 5)(*reversed([elem_size * int(s) for s in strides[:-1]]))
    box = (ctypes.c_uint32 * 5)(*reversed([int(b) for b in block]))
    ones = (ctypes.c_uint32 * 5)(1, 1, 1, 1, 1)
    raw = ctypes.create_string_buffer(256)
    at = (ctypes.addressof(raw) + 127) & ~127
    res = _encoder()(at, elem_type, rank, address, dims, byte_strides, box, ones, 0, swizzle,
                     PROMOTIONS[promotion_bytes], 1 if padding == 1 else 0)
    if res != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled returned {res} for shape={shape} strides={strides} "
                           f"block={block} elem_type={elem_type} swizzle={swizzle}")
    return ctypes.string_at(at, 128)


def _utils():
    import triton

    return triton.runtime.driver.active.utils


def _fill_name(utils) -> str | None:
    return next((n for n in _FILL_NAMES if hasattr(utils, n)), None)


def _wrap(fill, promotion_bytes: int):
    warned = []

    def promoted_fill(address, swizzle, elem_size, elem_type, block, shape, strides, padding, *rest):
        desc = fill(address, swizzle, elem_size, elem_type, block, shape, strides, padding, *rest)
        try:
            args = (address, swizzle, elem_size, elem_type, list(block), list(shape), list(strides), padding)
            here = id(desc) + _MAP_OFFSET
            if type(desc).__basicsize__ < _MAP_OFFSET + 128 or rest:
                raise RuntimeError(f"unexpected descriptor object {type(desc).__name__}")
            if ctypes.string_at(here, 128) != encode_tiled(*args, _TRITON_DEFAULT):
                raise RuntimeError("Triton's descriptor differs from the one encoded here")
            ctypes.memmove(here, encode_tiled(*args, promotion_bytes), 128)
        except (OSError, AttributeError, RuntimeError) as exc:
            if not warned:
                warned.append(exc)
                warnings.warn(f"distwgrad: TMA descriptors keep Triton's L2 promotion ({exc})", stacklevel=2)
        return desc

    promoted_fill.__wrapped__ = fill
    return promoted_fill


@contextlib.contextmanager
def l2_promotion(promotion_bytes: int | None) -> Iterator[None]:
    """Host-side TMA descriptors filled inside the block get ``promotion_bytes`` (0, 64, 128 or 256) of
    L2 promotion; ``None`` leaves Triton's. Not thread-safe: it swaps the driver's fill function."""
    if promotion_bytes is not None and promotion_bytes not in PROMOTIONS:
        raise ValueError(f"l2_promotion: promotion_bytes must be one of {sorted(PROMOTIONS)} or None, got "
                         f"{promotion_bytes!r}")
    utils = _utils()
    name = _fill_name(utils) if promotion_bytes is not None else None
    if name is None:
        yield
        return
    fill = getattr(utils, name)
    setattr(utils, name, _wrap(fill, promotion_bytes))
    try:
        yield
    finally:
        setattr(utils, name, fill)
