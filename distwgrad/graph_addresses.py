"""The addresses a graphed module's replays read and write, held to what its capture baked in.

[Note: a graph reads captured addresses]
A replay reads the addresses of its capture. A parameter or buffer replaced since (``p.data = t``, ``module.to``,
``load_state_dict(..., assign=True)``) would be read at its old storage, which may hold another tensor by then: a
silently wrong step. In-place writes keep the address (an optimizer step, ``p.data.copy_(t)``). So a forward replay
checks each parameter and buffer of its module (the tensor, address, shape, strides, dtype) and refuses a change by
name; a backward replay does the same for a fused ``main_grad`` ([Note: graphed deferred wgrads] in ``graphs.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from distwgrad.protocol import is_distributed_weight
from distwgrad.wgrad.accumulate import hands_fused_dummy

__all__ = ["CapturedTensors", "MainGrads"]


def _layout(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


def _describe(t: torch.Tensor | None) -> str:
    return "None" if t is None else f"{tuple(t.shape)} {t.dtype} at 0x{t.data_ptr():x}"


class CapturedTensors:
    # a graphed module's parameters and buffers as its capture read them: [Note: a graph reads captured addresses]

    def __init__(self, module: nn.Module) -> None:
        # (qualified name, its module's _parameters or _buffers, attribute, tensor, layout at the capture)
        self.entries = [(f"{prefix}{'.' if prefix else ''}{attr}", table, attr, t, _layout(t))
                        for prefix, sub in module.named_modules(remove_duplicate=False)
                        for table in (sub._parameters, sub._buffers)
                        for attr, t in table.items() if t is not None]

    def check(self, what: str) -> None:
        for name, table, attr, captured, layout in self.entries:
            now = table.get(attr)
            if now is not captured or _layout(captured) != layout:
                got = "another tensor, " + _describe(now) if now is not captured and now is not None else \
                    _describe(now)
                raise RuntimeError(
                    f"{what}: {name} was replaced after the capture (captured: {layout[1]} {layout[3]} at "
                    f"0x{layout[0]:x}; now: {got}); a replay reads the captured address. Write weights in place "
                    f"(p.data.copy_(t), load_state_dict without assign=True), or reset() and graph again. "
                    f"[Note: a graph reads captured addresses]")


class MainGrads:
    # the main_grad tensors a set of graphs writes, checked before each replay

    def __init__(self, params: list[tuple[str, torch.Tensor]]) -> None:
        self.entries = [(n, p, p.main_grad) for n, p in params if getattr(p, "main_grad", None) is not None]

    def check(self, what: str) -> None:
        for name, p, captured in self.entries:
            now = getattr(p, "main_grad", None)
            if now is None or _layout(now) != _layout(captured):
                raise RuntimeError(
                    f"{what}: {name}.main_grad was replaced (captured: {tuple(captured.shape)} {captured.dtype} at "
                    f"0x{captured.data_ptr():x}; now: {_describe(now)}); the graph accumulates into the captured "
                    f"address. Zero main_grad in place (main_grad.zero_()) or graph again. "
                    f"[Note: graphed deferred wgrads]")

    def mark_added(self) -> None:
        """Sets a fused plain weight's flag as its main backward would ([Note: the fused .grad contract])."""
        for _, p, _ in self.entries:
            if hands_fused_dummy(p) and not is_distributed_weight(p):
                p.grad_added_to_main_grad = True
