"""Host values onto the device without a sync: the helpers the launchers and the runtime's offsets share."""

from __future__ import annotations

import collections
from collections.abc import Sequence

import torch

__all__ = ["to_device", "device_table", "cdiv", "next_pow2"]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of host ints for grids and shapes. Triton's ``triton.cdiv`` and ``next_power_of_2``
    are ``constexpr_function`` objects in recent releases: about 3 µs a call from Python, and the launchers
    take several a launch."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` for ``n >= 1`` (0 for 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def to_device(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device`` without waiting for the device: staged in pinned memory and
    copied asynchronously on the current stream (a plain ``torch.tensor(..., device="cuda")`` copies from
    pageable memory, which waits for the stream's queued work: a sync per call)."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


# [Note: device tables]
# A launch that reads a table of host values (the addresses of a list of outputs or weights, an index map)
# gets it from here, keyed by the values and the device: parameters keep their addresses across steps, so
# a table is copied once, and a CUDA graph that captured a launch keeps reading the same table, so a table
# and its pinned host copy live for the process (up to _TABLES_MAX, least recently used first: 2 KB each
# at 256 entries). A first use inside a capture is refused: its copy would be captured from a host buffer
# the graph does not own. make_graphed_callables' warm-up makes every table the capture needs.
_TABLES: collections.OrderedDict = collections.OrderedDict()
_TABLES_MAX = 4096


def device_table(values: tuple[int, ...], device: torch.device, op: str, dtype: torch.dtype = torch.int64
                 ) -> torch.Tensor:
    """``values`` as a ``dtype`` (int64) tensor on ``device``, made once and kept ([Note: device tables]);
    ``op`` names the caller in the error a first use inside a CUDA graph capture raises."""
    key = (str(device), dtype, values)
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
        return hit[1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{op}: first use of this table of {len(values)} values inside a CUDA graph capture; "
                           f"call once before capturing (a warm-up, as Triton's compile needs)")
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    _TABLES[key] = (host, host.to(device, non_blocking=True))
    while len(_TABLES) > _TABLES_MAX:
        _TABLES.popitem(last=False)
    return _TABLES[key][1]
