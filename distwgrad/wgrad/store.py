"""``WeightGradStore``: the per-module FIFO of deferred wgrad work.

With ``delay_wgrad_compute=True`` a module's main backward computes dgrad only and queues a closure
holding what the wgrad GEMM needs: the saved input, the output gradient and the *parameters* (never a
gathered copy: the wgrad product needs no weight at all). ``backward_dw()`` pops the oldest closure,
runs it, then fires the module's wgrad-accumulation-and-reduce hooks.

A pipeline schedule's W action runs the work of one stage and microbatch, not the oldest: right after a
microbatch's backward the stage claims (:meth:`claim`) what that backward queued, under a label naming the stage
and microbatch, and its W runs (:meth:`run`) exactly those items (``distwgrad/parallel/pipeline.py``). A label
names the item wherever it is reported undrained.
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

    Args:
        owner: a name for error messages (the module's qualified name once known).
        strict: when True, :meth:`check_can_queue` (called at the start of every forward that will
            queue work) raises if work from an earlier backward is still undrained.
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
        """Runs the oldest queued wgrad, then drops it; raises naming the module when nothing is queued.

        If the work raises before changing any gradient (a refused CUDA-graph capture, say), it stays
        queued, so the contribution is not lost and ``finalize_model_grads`` still sees it.
        """
        if not self._queue:
            raise DeferredWgradError(
                f"{self.owner}: backward_dw() called with no deferred wgrad queued (every backward "
                f"queues exactly one; was backward run, or was this module drained already?)")
        self._run(self._queue[0])

    def run(self, work: Callable[[], None]) -> None:
        """Runs one queued item (one that :meth:`claim` returned), wherever it is in the queue, then drops it."""
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
        """Drops queued work without running it (e.g. after an aborted step); returns how many."""
        n = len(self._queue)
        self._queue.clear()
        self._labels.clear()
        return n
