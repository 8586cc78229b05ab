"""The weights a set of CUDA graphs captured: the capture's refusals, graph-owned buffers and flags, and replay.

``make_graphed_callables`` ([Note: captured distributed weights] in ``distwgrad/graphs.py``) touches weights only
here; :class:`CaptureLedger` re-applies at each replay the accounting a capture made (replays skip Python).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from distwgrad.weights.base import DistributedParameter
from distwgrad.weights.lifecycle import ReducePolicy

__all__ = ["CapturedWeights", "CaptureLedger"]


def _check(p: DistributedParameter) -> None:
    """[Note: captured distributed weights]: what is refused, before any CUDA work (testable on CPU)."""
    if p.coalesced:
        raise ValueError(f"make_graphed_callables: {p._name()} is in a distwgrad.coalesce unit, which gathers and "
                         f"reduces from Python hooks that a replay skips; graph a model that is not coalesced")
    backends = {None if group is None else dist.get_backend(group) for group in p.reduction_groups()}
    backend = next((b for b in sorted(str(b) for b in backends if b is not None) if b != "nccl"), None)
    if backend is not None:
        raise RuntimeError(f"make_graphed_callables: {p._name()} reduces over a {backend!r} process group; "
                           f"{backend} collectives cannot be captured in a CUDA graph (only NCCL's can). "
                           f"Graph the model with its weights on an NCCL group, or run it eagerly")
    if p.async_reduce:
        raise ValueError(f"make_graphed_callables: {p._name()} has async_reduce=True; its wait runs on the "
                         f"host and cannot be captured: build it with async_reduce=False")
    if p.reduce_policy is not ReducePolicy.PER_MICROBATCH:
        raise ValueError(f"make_graphed_callables: {p._name()} has reduce_policy={p.reduce_policy}; only "
                         f"ReducePolicy.PER_MICROBATCH is captured (a PER_STEP buffer outlives the graphs)")
    life = p._life
    if life.graph_buffer is not None:
        raise ValueError(f"make_graphed_callables: {p._name()} is already captured by other graphed "
                         f"callables; reset() them first")
    if life.open or life.buffer is not None or life.inflight:
        raise ValueError(f"make_graphed_callables: {p._name()} has an open step; finish it "
                         f"(finalize_model_grads) before graphing")


class CapturedWeights:
    """The distinct distributed weights of one ``make_graphed_callables`` call, from check to release."""

    def __init__(self, weights: Sequence[DistributedParameter]) -> None:
        for p in weights:
            _check(p)
        self.weights = list(weights)
        self.flagged: list[DistributedParameter] = []  # weights whose main_grad the steps flag instead of zeroing

    def prepare(self) -> None:
        """Before warm-up: each weight keeps its ``main_grad`` ([Note: main_grad lifetime]); one accumulating in place
        is flagged, not zeroed, so warm-up builds the kernels reading the flag ([Note: an unwritten accumulator])."""
        for p in self.weights:
            p.keep_main_grad()
        self.flagged = [p for p in self.weights if p.accumulates_in_place]
        for p in self.flagged:
            p._life.use_first_flag(p)

    def open_for_capture(self) -> None:
        """After warm-up: steps opened eagerly (``zero_()`` kept out of the graphs); graph buffers unless in place."""
        for p in self.weights:
            p.discard_step()
            p.expect_contribution(0)
            if not p.accumulates_in_place:
                p._life.graph_buffer = torch.zeros(p.full_shape, dtype=torch.float32, device=p.device)

    def close_capture(self) -> None:
        """After the captures, or their failure: the capture's step is gone, its flag cleared."""
        for p in self.weights:
            p.discard_step()
            if p._life.first_flag is not None:  # the capture's opening set it; the step is gone
                p._life.first_flag.zero_()

    def release(self, *, failed: bool = False) -> None:
        """``reset()``, or a failed capture (its step discarded too): drops the buffers and flags baked in."""
        for p in self.weights:
            p._life.graph_buffer = None
        for p in self.flagged:
            if failed:
                p.discard_step()
            p._life.drop_first_flag(p)
        self.weights, self.flagged = [], []

    def ledger(self) -> CaptureLedger:
        return CaptureLedger(self.weights)


class CaptureLedger:
    """One capture's accounting changes, re-applied at each replay ([Note: captured distributed weights])."""

    def __init__(self, weights: list[DistributedParameter]) -> None:
        self.weights, self.before = weights, [p._life.snapshot() for p in weights]
        self.changes: list[tuple[DistributedParameter, tuple, tuple]] = []

    def close(self) -> CaptureLedger:
        self.changes = [(p, b, p._life.snapshot()) for p, b in zip(self.weights, self.before)
                        if p._life.snapshot() != b]
        self.weights, self.before = [], []
        return self

    def apply(self, what: str) -> None:
        for p, before, after in self.changes:
            p._life.replay(p, before, after, what)
