"""Weight quantization a CUDA graph replay may skip ([Note: gated weight quantization]).

[Note: gated weight quantization]
Inside :func:`gated`, the weight quantize kernels (per tensor with a given amax, square blocks, a packed weight's
experts) write nothing while the gate's flag (one int32 on the device) is nonzero, and :func:`gate` records their
outputs, which the gate's owner must hold past the capture ([Note: fp8 weights kept in CUDA graphs] in
``distwgrad/fp8/graph_kept.py``). A module global: a captured backward runs on the autograd engine's thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["gated", "gate"]

_open: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # (flag, outputs recorded), innermost last


@contextlib.contextmanager
def gated(flag: torch.Tensor) -> Iterator[list[torch.Tensor]]:
    # gates the weight quantize launches inside on flag; yields the list of their outputs
    if flag.dtype != torch.int32 or flag.numel() != 1:
        raise ValueError(f"a gate's flag is one int32 element, got {flag.dtype} {tuple(flag.shape)}")
    outputs: list[torch.Tensor] = []
    _open.append((flag, outputs))
    try:
        yield outputs
    finally:
        _open.pop()


def gate(*outputs: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
    """``(skip_ptr, SKIP)`` for a launch writing ``outputs`` (recorded): the open gate's, else ``(None, False)``."""
    if not _open or not outputs:
        return None, False
    flag, recorded = _open[-1]
    if flag.device != outputs[0].device:
        return None, False
    recorded.extend(outputs)
    return flag, True
