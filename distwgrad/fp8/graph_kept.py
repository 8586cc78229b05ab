"""FP8 weight copies CUDA graphs keep across the microbatches of a step.

[Note: fp8 weights kept in CUDA graphs]
``make_graphed_callables(..., cache_quantized_params=True)`` (TE's ``fp8_weight_caching``): a replay runs no Python,
so the eager step cache ([Note: fp8 weights kept across microbatches] in ``fp8/weights.py``) moves out of the
graphs. Each captured forward and backward owns a :class:`GraphKept`. In the last warm-up iteration it records,
eagerly, each FP8 copy of a weight held whole on this rank that its module asks for, into tensors it owns, outside
any graph pool: a graph's pool memory is taken again by later captures, and their replays would overwrite a copy
that must outlive them. The capture reads those tensors and quantizes no such weight. Before each replay the host
refreshes a graph's copies, eagerly and in place, unless the replay may reuse them: a forward whose call passed
``is_first_microbatch=False`` (or ran in ``fp8.microbatch(first=False)``), or a backward, and no weight's write token
has moved since that graph last refreshed ([Note: weight lifecycle]: every finalize moves it). So each graph's first
replay in a step quantizes, in any schedule, and the graphs read the bits of quantizing at every use. A copy the
warm-up did not record is quantized in the graph at every use and counted (``misses``). The refresh computes the
weights' amaxes and scales fresh, as a capture does ([Note: amax under capture] in ``fp8/weights.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from distwgrad.fp8.recipe import current_first_microbatch
from distwgrad.weights.lifecycle import write_token

__all__ = ["GraphKept", "capturing", "current", "fresh", "recording", "replay_first"]

T = TypeVar("T")

# (graph, capturing) innermost last; a module global: a backward runs on the autograd engine's thread
_active: list[tuple[GraphKept, bool]] = []
_fresh = [0]  # > 0 while recording or refreshing: the weights' host caches are not read


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


class GraphKept:
    """One captured graph's kept FP8 weight copies, and how often its replays refreshed them."""

    def __init__(self) -> None:
        self.copies: dict[tuple, _Copy] = {}
        self.replays = self.refreshes = self.misses = 0

    def kept(self, weights: list[torch.Tensor], key: tuple, make: Callable[[], T]) -> T:
        """``make()``'s value for ``weights`` while this graph records or captures ([Note: fp8 weights kept in
        CUDA graphs]): recorded, the copy it keeps (the same for a weight used twice); captured, that copy."""
        capturing = _active[-1][1]
        full = (tuple(id(w) for w in weights), *key)
        copy = self.copies.get(full)
        if not capturing:
            if copy is None:
                with fresh():
                    value = _map(make(), torch.clone)  # owned: no host cache shares it
                copy = self.copies[full] = _Copy(list(weights), make, value)
            return copy.value
        if copy is None:  # the warm-up asked for no such copy: quantized in the graph at every use
            self.misses += 1
            return make()
        copy.captured = True
        return copy.value

    def before_replay(self, reuse: bool) -> None:
        """Refreshes, on the current stream, each copy the graph reads unless ``reuse`` and no weight moved."""
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
        old: list[torch.Tensor] = []
        new: list[torch.Tensor] = []
        with fresh(), torch.no_grad():
            for copy in stale:
                made = _tensors(copy.make())
                kept = _tensors(copy.value)
                if [(t.shape, t.dtype) for t in made] != [(t.shape, t.dtype) for t in kept]:
                    raise RuntimeError(f"an FP8 weight copy kept in a CUDA graph changed its layout: "
                                       f"{[(tuple(t.shape), t.dtype) for t in kept]} were captured, the weights "
                                       f"now give {[(tuple(t.shape), t.dtype) for t in made]}; capture again "
                                       f"(reset() and make_graphed_callables) after changing a weight's shape")
                old += kept
                new += made
            torch._foreach_copy_(old, new)

    def held_bytes(self) -> int:
        """What the kept copies hold, scales included."""
        return sum(t.untyped_storage().nbytes() for copy in self.copies.values() for t in _tensors(copy.value))

    def release(self) -> None:
        self.copies = {}


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
    """Inside: the weights' amaxes and block scales are computed, never read from their host caches."""
    _fresh[0] += 1
    try:
        yield
    finally:
        _fresh[0] -= 1


def is_fresh() -> bool:
    return _fresh[0] > 0


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
