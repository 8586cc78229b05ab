"""``WeightGradStore``: the per-module FIFO of deferred wgrad work.

Backward queues a closure over the saved input, ``dy`` and the *parameters* (never a gathered weight: wgrad
needs none); ``backward_dw()`` runs the oldest. A pipeline's W runs exactly the items its stage and microbatch
:meth:`claim`-ed, under a label that names them if left undrained (``distwgrad/parallel/pipeline.py``).
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable

import torch

__all__ = ["WeightGradStore", "DeferredWgradError"]


class DeferredWgradError(RuntimeError):
    """A deferred wgrad was drained, skipped or queued in the wrong order."""


class WeightGradStore:
    """FIFO of deferred wgrad closures for one module.

    ``strict``: :meth:`check_can_queue` (at each forward that will queue) raises while earlier work is undrained.
    """

    def __init__(self, owner: str, *, strict: bool = False) -> None:
        self.owner = owner
        self.strict = strict
        self._queue: collections.deque[Callable[[], None]] = collections.deque()
        # claimed item -> its label, for as long as anything (a W) holds the item
        self._labels: weakref.WeakKeyDictionary[Callable[[], None], str] = weakref.WeakKeyDictionary()

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, work: Callable[[], None]) -> None:
        self._queue.append(work)

    def queued(self) -> tuple[Callable[[], None], ...]:
        """The queued work, oldest first (read-only; graph capture keeps it alive while capturing)."""
        return tuple(self._queue)

    def claim(self, label: str) -> tuple[Callable[[], None], ...]:
        """The items queued since the last claim, oldest first, now labelled ``label``."""
        fresh = tuple(w for w in self._queue if w not in self._labels)
        for w in fresh:
            self._labels[w] = label
        return fresh

    def labels(self) -> list[str]:
        """Each queued item's label, oldest first ("unclaimed" for an item no schedule claimed)."""
        return [self._labels.get(w, "unclaimed") for w in self._queue]

    def check_can_queue(self) -> None:
        if self.strict and self._queue:
            raise DeferredWgradError(
                f"{self.owner}: forward would queue deferred wgrad work on top of {len(self._queue)} "
                f"undrained item(s); call backward_dw() (or distwgrad.drain_deferred_wgrads) first, or "
                f"turn strict checking off")

    def pop(self) -> None:
        """Runs and drops the oldest wgrad; raises when none is queued. Work that raises stays queued, not lost."""
        if not self._queue:
            raise DeferredWgradError(
                f"{self.owner}: backward_dw() called with no deferred wgrad queued (every backward "
                f"queues exactly one; was backward run, or was this module drained already?)")
        self._run(self._queue[0])

    def run(self, work: Callable[[], None]) -> None:
        """Runs one item :meth:`claim` returned, wherever it is in the queue, then drops it."""
        if not any(w is work for w in self._queue):
            raise DeferredWgradError(
                f"{self.owner}: the deferred wgrad {self._labels.get(work, 'given')!r} is not queued (was it run "
                f"already, by backward_dw() or a drain, or dropped by finalize_model_grads(discard=True)?)")
        self._run(work)

    def _run(self, work: Callable[[], None]) -> None:
        with torch.no_grad():  # a deferred GEMM is gradient bookkeeping, never part of a graph
            work()
        self._queue.remove(work)  # by identity: closures compare by identity

    def clear(self) -> int:
        """Drops queued work without running it (after an aborted step); returns how many."""
        n = len(self._queue)
        self._queue.clear()
        self._labels.clear()
        return n
