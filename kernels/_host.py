"""Host values onto the device without a sync: the one helper the launchers and the runtime's offsets share."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["to_device"]


def to_device(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device`` without waiting for the device: staged in pinned memory and
    copied asynchronously on the current stream (a plain ``torch.tensor(..., device="cuda")`` copies from
    pageable memory, which waits for the stream's queued work: a sync per call)."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
