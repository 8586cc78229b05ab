"""FP8 weight copies CUDA graphs keep across the microbatches of a step.

[Note: fp8 weights kept in CUDA graphs]
``make_graphed_callables(..., cache_quantized_params=True)`` (TE's ``fp8_weight_caching``): a replay runs no Python,
so the eager step cache ([Note: fp8 weights kept across microbatches] in ``fp8/weights.py``) moves out of the
graphs. Each graphed callable owns a :class:`GraphKept`. In the last warm-up iteration it records each FP8 copy of a
weight held whole on this rank that its forward or backward asks for (what makes it from the weights alone, its
weights). Between the warm-up and the captures it captures those quantizations into one refresh graph whose
memory pool is its own (each weight's amax taken once): the graphs' shared pool is taken again by later captures,
whose replays would overwrite a copy that must outlive them. The captures read the refresh graph's outputs and
quantize no such weight. Before each replay the host replays the refresh graph unless the replay may reuse the
copies: a forward whose call passed ``is_first_microbatch=False`` (or ran in ``fp8.microbatch(first=False)``), or
a backward, and no weight's write token has moved since the last refresh ([Note: weight lifecycle]: every finalize
moves it). A module graphed for several forward passes (an ``_order``'s microbatches) keeps one set. So each
step's first replay refreshes, in any schedule, with amaxes and scales computed from the weights
([Note: amax under capture] in ``fp8/weights.py``), and the graphs read the bits of quantizing at every use. A
copy the warm-up did not record is quantized in the graph at every use and counted (``misses``); weights off the
GPU (CUDA modelled on a CPU) are refreshed eagerly and copied in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from distwgrad.fp8.recipe import current_first_microbatch
from distwgrad.weights.lifecycle import write_token

__all__ = ["GraphKept", "amaxes", "capture_refreshes", "capturing", "current", "fresh", "recording", "replay_first"]

T = TypeVar("T")

# (graph, capturing) innermost last; a module global: a backward runs on the autograd engine's thread
_active: list[tuple[GraphKept, bool]] = []
_fresh: list[dict[int, torch.Tensor]] = []  # while recording or refreshing: no host cache read; amaxes made so far


def _map(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` (tensors in lists, tuples and dataclasses, as a recipe's quantized weights) with ``fn`` of each."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if type(value) in (list, tuple):
        return type(value)(_map(v, fn) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _map(getattr(value, f.name), fn)
                                             for f in dataclasses.fields(value) if f.init})
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def add(t: torch.Tensor) -> torch.Tensor:
        out.append(t)
        return t
    _map(value, add)
    return out


@dataclasses.dataclass(eq=False)
class _Copy:
    """One kept copy: what makes it, its weights, the tensors the graphs read, their tokens at the last refresh."""

    weights: list[torch.Tensor]
    make: Callable[[], Any]
    value: Any
    captured: bool = False
    tokens: list[tuple[int, int]] | None = None
    in_graph: bool = False  # re-made by the refresh graph


class GraphKept:
    """A graphed callable's kept FP8 weight copies, and how often its replays refreshed them."""

    def __init__(self) -> None:
        self.copies: dict[tuple, _Copy] = {}
        self.replays = self.refreshes = self.misses = 0
        self.graph: Any = None  # the refresh graph, where the weights are on a GPU

    def kept(self, weights: list[torch.Tensor], key: tuple, make: Callable[[], T]) -> T:
        """``make()``'s value for ``weights`` while this graph records or captures ([Note: fp8 weights kept in
        CUDA graphs]): recorded, the copy it keeps (the same for a weight used twice); captured, that copy."""
        capturing = _active[-1][1]
        full = (tuple(id(w) for w in weights), *key)
        copy = self.copies.get(full)
        if not capturing:
            if copy is None:
                with fresh():
                    value = make()  # off the GPU owned (no host cache shares it); on it, replaced by capture_refresh
                value = value if _on_gpu(weights[0]) else _map(value, torch.clone)
                copy = self.copies[full] = _Copy(list(weights), make, value)
            return copy.value
        if copy is None:  # the warm-up asked for no such copy: quantized in the graph at every use
            self.misses += 1
            return make()
        copy.captured = True
        return copy.value

    def capture_refresh(self, stream: Any) -> None:
        """After the recording warm-up: the copies of weights on a GPU re-made by a graph whose pool is its own, so
        no other graph's replay reuses their memory; its outputs become the copies the captures read."""
        cuda = [c for c in self.copies.values() if _on_gpu(c.weights[0])]
        if not cuda:
            return
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream), fresh(), torch.no_grad():
            values = [c.make() for c in cuda]
        for c, value in zip(cuda, values):
            _check_layout(c.value, value)
            c.value, c.in_graph = value, True

    def before_replay(self, reuse: bool) -> None:
        """Refreshes, on the current stream, each copy the graph reads unless ``reuse`` and no weight moved: by
        replaying the refresh graph (every copy), else eagerly, copied in place."""
        stale = []
        for copy in self.copies.values():
            if copy.captured:
                tokens = [write_token(w) for w in copy.weights]
                if not reuse or tokens != copy.tokens:
                    stale.append(copy)
                copy.tokens = tokens
        self.replays += 1
        if not stale:
            return
        self.refreshes += 1
        if self.graph is not None:
            self.graph.replay()
            stale = [c for c in stale if not c.in_graph]
        old: list[torch.Tensor] = []
        new: list[torch.Tensor] = []
        with fresh(), torch.no_grad():
            for copy in stale:
                made = copy.make()
                _check_layout(copy.value, made)
                old += _tensors(copy.value)
                new += _tensors(made)
            if old:
                torch._foreach_copy_(old, new)

    def release(self) -> None:
        if self.graph is not None:
            self.graph.reset()
        self.copies, self.graph = {}, None


def _on_gpu(w: torch.Tensor) -> bool:
    return w.is_cuda


def _check_layout(kept: Any, made: Any) -> None:
    before, now = ([(tuple(t.shape), t.dtype) for t in _tensors(v)] for v in (kept, made))
    if before != now:
        raise RuntimeError(f"an FP8 weight copy kept in a CUDA graph changed its layout: {before} were captured, the "
                           f"weights now give {now}; capture again (reset() and make_graphed_callables) after "
                           f"changing a weight's shape")


def capture_refreshes(kepts: list[GraphKept | None], stream: Any) -> None:
    """:meth:`GraphKept.capture_refresh` of each (once, where modules' forward passes share one), between the
    warm-up and the captures."""
    for kept in {id(k): k for k in kepts if k is not None}.values():
        kept.capture_refresh(stream)


@contextlib.contextmanager
def _open(kept: GraphKept | None, capturing: bool) -> Iterator[None]:
    if kept is None:
        yield
        return
    _active.append((kept, capturing))
    try:
        yield
    finally:
        _active.pop()


def recording(kept: GraphKept | None) -> contextlib.AbstractContextManager[None]:
    """While a graph's last warm-up runs: its weights' copies made and kept in ``kept`` (None: none)."""
    return _open(kept, False)


def capturing(kept: GraphKept | None) -> contextlib.AbstractContextManager[None]:
    """While a graph captures: it reads the copies ``kept`` recorded (None: none)."""
    return _open(kept, True)


def current() -> GraphKept | None:
    # the recording or capturing graph's GraphKept, or None
    return _active[-1][0] if _active else None


@contextlib.contextmanager
def fresh() -> Iterator[None]:
    """Inside: the weights' amaxes and block scales are computed, never read from their host caches; a weight's
    amax once (:func:`amaxes`)."""
    _fresh.append({})
    try:
        yield
    finally:
        _fresh.pop()


def is_fresh() -> bool:
    return bool(_fresh)


def amaxes() -> dict[int, torch.Tensor] | None:
    """Inside :func:`fresh`, the amaxes made so far by weight id (the weights cannot change within), else None."""
    return _fresh[-1] if _fresh else None


def replay_first(value: Any, keeps: bool, index: int) -> bool | None:
    # given none: fp8.microbatch's; required where the graphs keep weights, as TE requires it with fp8_weight_caching
    """Graphed module ``index``'s replay's checked ``is_first_microbatch``."""
    if value is not None and type(value) is not bool:
        raise TypeError(f"graphed module {index}: is_first_microbatch must be True, False or None, got {value!r}")
    value = current_first_microbatch() if value is None else value
    if value is None and keeps:
        raise TypeError(f"graphed module {index} was captured with cache_quantized_params=True (fp8_weight_caching): "
                        f"pass is_first_microbatch=True on a step's first microbatch and False on the others, or call "
                        f"it inside distwgrad.fp8.microbatch(first=...)")
    return value
