"""FP8 weight copies a CUDA graph keeps across the microbatches of a step.

[Note: fp8 weights kept in CUDA graphs]
``make_graphed_callables(..., cache_quantized_params=True)`` (TE's ``fp8_weight_caching``): a replay runs no Python,
so the eager step cache ([Note: fp8 weights kept across microbatches] in ``fp8/weights.py``) becomes TE's device
flag. Each captured forward and backward owns a :class:`GraphKept`, which gates the quantizations of the weights
it captures ([Note: gated weight quantization] in ``kernels/_gate.py``) and holds their outputs as long as the
graphs. Before a replay the host sets its flag from the weights' write tokens ([Note: weight lifecycle]): a forward
skips where its call passed ``is_first_microbatch=False`` (or ran in ``fp8.microbatch(first=False)``), a backward
always, if no weight moved since that graph's last quantizing replay: each graph's first replay in a step quantizes
whatever the flags, in any schedule. Kept where a weight is held whole on its rank; a byte an element and graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from distwgrad.fp8.recipe import current_first_microbatch
from distwgrad.kernels._gate import gated
from distwgrad.weights.lifecycle import write_token

__all__ = ["GraphKept", "capturing", "current", "replay_first"]

T = TypeVar("T")

_capturing: list[GraphKept] = []  # a module global: a captured backward runs on the autograd engine's thread


class GraphKept:
    """One captured graph's kept FP8 weight copies, its flag, and when it last quantized."""

    def __init__(self, device: torch.device) -> None:
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)  # nonzero: the replay skips
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # the copies' allocations
        self.held: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []
        self.fresh: list[tuple[int, int]] | None = None  # the weights' tokens at the last quantizing replay
        self.skipping = False  # what the flag holds
        self.replays = self.skips = 0

    def make(self, weights: list[torch.Tensor], make: Callable[[], T]) -> T:
        # make() while capturing, its weight quantize kernels gated on this graph's flag
        with gated(self.flag, self.stream) as outputs:
            value = make()
        if outputs:
            self.held += outputs
            seen = {id(w) for w in self.weights}
            self.weights += [w for w in weights if id(w) not in seen]
        return value

    def before_replay(self, reuse: bool) -> None:
        """Sets the flag for the next replay (stream-ordered): skip if ``reuse`` and no weight moved since."""
        if not self.weights:
            return
        tokens = [write_token(w) for w in self.weights]
        skip = reuse and tokens == self.fresh
        if skip != self.skipping:
            self.flag.fill_(int(skip))
            self.skipping = skip
        if not skip:
            self.fresh = tokens
        self.replays += 1
        self.skips += skip

    def release(self) -> None:
        self.held, self.weights, self.fresh = [], [], None


@contextlib.contextmanager
def capturing(kept: GraphKept | None) -> Iterator[None]:
    """While a graph captures: its weights' copies kept in ``kept`` (None: none)."""
    if kept is None:
        yield
        return
    _capturing.append(kept)
    try:
        yield
    finally:
        _capturing.pop()


def current() -> GraphKept | None:
    # the capturing graph's GraphKept, or None
    return _capturing[-1] if _capturing else None


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
