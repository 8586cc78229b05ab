"""Weight quantization a CUDA graph replay may skip ([Note: gated weight quantization]).

[Note: gated weight quantization]
Inside :func:`gated`, the weight quantize kernels (per tensor with a given amax, square blocks, a packed weight's
experts) write nothing while the gate's flag (one int32 on the device) is nonzero. :func:`gate_outputs` allocates
and records their outputs, outside the graph pool; the gate's owner holds them for the graphs' life ([Note: fp8
weights kept in CUDA graphs] in ``distwgrad/fp8/graph_kept.py``). A global: a backward captures on autograd's thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["gated", "gate_outputs"]

_open: list[tuple[torch.Tensor, Any, list[torch.Tensor]]] = []  # (flag, side stream, outputs), innermost last


@contextlib.contextmanager
def gated(flag: torch.Tensor, stream: Any = None) -> Iterator[list[torch.Tensor]]:
    # gates the weight quantize launches inside on flag; yields the list of their outputs. stream: a CUDA flag's
    # side stream, made before any capture (the outputs' allocation stream while capturing)
    if flag.dtype != torch.int32 or flag.numel() != 1:
        raise ValueError(f"a gate's flag is one int32 element, got {flag.dtype} {tuple(flag.shape)}")
    outputs: list[torch.Tensor] = []
    _open.append((flag, stream, outputs))
    try:
        yield outputs
    finally:
        _open.pop()


def gate_outputs(device: torch.device, *specs: tuple[tuple[int, ...], torch.dtype]
                 ) -> tuple[list[torch.Tensor], torch.Tensor | None, bool]:
    """A launch's outputs (one ``(shape, dtype)`` each) and its ``(skip_ptr, SKIP)``: inside an open gate on
    ``device``, recorded, and while capturing allocated on the gate's side stream, which no capture watches: outside
    the graph pool, whose memory a later capture may take again and its replays overwrite; else ``torch.empty``'s
    and ``(None, False)``."""
    if not _open or _open[-1][0].device != device:
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs], None, False
    flag, stream, recorded = _open[-1]
    side = stream is not None and device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    with torch.cuda.stream(stream) if side else contextlib.nullcontext():
        outputs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
    recorded.extend(outputs)
    return outputs, flag, True
