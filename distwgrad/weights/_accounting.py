"""Uses tied to autograd graphs, and the process-wide bound on reductions in flight.

Both serve [Note: contribution accounting] in ``weights/base.py``: a graph freed without a backward frees
its :class:`Use`s and so withdraws them; :func:`admit` keeps a step's gradient buffers from piling up.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["MAX_INFLIGHT_REDUCTIONS", "Use", "Uses", "Launched", "arriving", "admit", "launched", "forget"]

# One reduction in flight per process: it overlaps the next weight's wgrad (double buffering), and the
# peak stays at one in-flight buffer whatever the number of weights or microbatches ([Note: contribution
# accounting]). Raising it buys overlap across several weights for one more full-size buffer each.
MAX_INFLIGHT_REDUCTIONS = 1


class Use:
    """One recorded use of ``weight``, held by its forward's autograd context; freed undelivered, withdrawn."""

    __slots__ = ("weight", "step", "delivered")

    def __init__(self, weight: Any, step: int) -> None:
        self.weight = weight
        self.step = step
        self.delivered = False

    def __del__(self) -> None:
        # A Use whose __init__ never ran recorded nothing: dynamo builds one while tracing a module's
        # forward and drops it at the graph break before the use is recorded (docs/architecture.md).
        if not getattr(self, "delivered", True):
            self.weight._life.withdraw(self.step)


class Uses:
    """The uses one module forward recorded, in the order of its tracked parameters."""

    __slots__ = ("_by_param",)

    def __init__(self, uses: Sequence[tuple[torch.Tensor, Use]]) -> None:
        self._by_param: dict[int, list[Use]] = {}
        for p, use in uses:
            self._by_param.setdefault(id(p), []).append(use)

    def take(self, params: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, Use]]:
        """``(param, use)`` for each param with a recorded use; a param listed k times gets its k-th use."""
        seen: dict[int, int] = collections.Counter()
        out = []
        for p in params:
            uses = self._by_param.get(id(p), [])
            if seen[id(p)] < len(uses):
                out.append((p, uses[seen[id(p)]]))
            seen[id(p)] += 1
        return out


@contextlib.contextmanager
def arriving(uses: Uses | None, params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Wraps one contribution per param, from choosing where the wgrad lands to its delivery (``run_wgrad``).

    A use already delivered (a retained graph) or of an earlier step records a new use first, before the wgrad
    picks its buffer, which recording may reduce ([Note: coalesced units]); a failed delivery withdraws it."""
    picked = [] if uses is None else uses.take(params)
    renewed = []
    for p, use in picked:
        if use.delivered or not p._life.is_current(use.step):
            p.expect_contribution()
            use.step, use.delivered = p._life.step_id, False
            renewed.append(use)
    before = {id(p): p._life.delivered for p, _ in picked}
    try:
        yield
    finally:
        grown = {id(p): p._life.delivered - before[id(p)] for p, _ in picked}
        for p, use in picked:
            if grown[id(p)] > 0:
                grown[id(p)] -= 1
                use.delivered = True
            elif use in renewed:  # its extra use was never delivered: take it back
                p._life.withdraw(use.step)
                use.delivered = True


class Launched:
    """A launched reduction: calling it waits and gives the local result; ``done()`` never blocks.

    ``collective_at_wait``: ``result`` issues a collective, so ``done()`` stays False ([Note: device meshes])."""

    __slots__ = ("_work", "_result", "_keep", "_collective_at_wait")

    def __init__(self, work: Any, result: Callable[[], torch.Tensor], keep: Any = None,
                 collective_at_wait: bool = False) -> None:
        self._work, self._result, self._keep = work, result, keep
        self._collective_at_wait = collective_at_wait

    def done(self) -> bool:
        if self._collective_at_wait:
            return False
        return self._work is None or self._work.is_completed()

    def __call__(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        self._keep = None
        return self._result()


# One entry per asynchronous reduction in flight in this process, in launch order: (owner, land, done), where
# land() lands the owner's oldest reduction and done() says, without blocking, whether this one finished.
# Bounded by MAX_INFLIGHT_REDUCTIONS.
_LAUNCHED: collections.deque[tuple[Any, Callable[[], None], Callable[[], bool]]] = collections.deque()


def admit() -> None:
    """Makes room for one more reduction: lands those already complete, then the oldest while at the bound."""
    while _LAUNCHED and _LAUNCHED[0][2]():
        _LAUNCHED[0][1]()
    while len(_LAUNCHED) >= MAX_INFLIGHT_REDUCTIONS:
        _LAUNCHED[0][1]()


def launched(owner: Any, land: Callable[[], None], work: Any) -> None:
    """Registers ``owner``'s launched reduction; ``land()`` lands the owner's oldest."""
    _LAUNCHED.append((owner, land, getattr(work, "done", lambda: False)))


def forget(owner: Any) -> None:
    """Drops ``owner``'s oldest entry (it just landed, or its step was discarded)."""
    for i, (o, _, _) in enumerate(_LAUNCHED):
        if o is owner:
            del _LAUNCHED[i]
            return
