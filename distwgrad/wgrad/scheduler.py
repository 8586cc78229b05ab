"""Draining every deferred wgrad of a model in one call, in a chosen order.

One call instead of TE's loop over each module's ``backward_dw()`` (kept for schedules that interleave wgrads).
``order`` changes only speed and the order reductions fire, the same on every rank: ``"reverse"`` (default, the
order backward queued), ``"forward"``, or modules or indices into ``deferred_modules(model)``, each named once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from distwgrad.wgrad.store import DeferredWgradError

__all__ = ["deferred_modules", "drain_deferred_wgrads", "deferred_wgrad_scope"]


def _roots(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    if isinstance(model, nn.Module):
        return [model]
    roots = list(model)
    if not all(isinstance(m, nn.Module) for m in roots):
        raise TypeError(f"expected an nn.Module or a list of them, got {[type(m).__name__ for m in roots]}")
    return roots


def deferred_modules(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """Modules under ``model`` (or each of a list of model chunks) that defer their wgrads, each once."""
    seen: set[int] = set()
    out: list[nn.Module] = []
    for i, root in enumerate(_roots(model)):
        for name, m in root.named_modules():
            need = getattr(m, "need_backward_dw", None)
            if need is not None and need() and id(m) not in seen:
                seen.add(id(m))
                if hasattr(m, "wgrad_store"):
                    m.wgrad_store.owner = f"{type(m).__name__} '{name or '<root>'}'" + (f" of chunk {i}" if i else "")
                out.append(m)
    return out


def _ordered(mods: list[nn.Module], order) -> list[nn.Module]:
    if order == "reverse":
        return mods[::-1]
    if order == "forward":
        return mods
    if isinstance(order, str):
        raise ValueError(f"order must be 'reverse', 'forward' or a sequence, got {order!r}")
    picked = [mods[o] if isinstance(o, int) else o for o in order]
    if sorted(map(id, picked)) != sorted(map(id, mods)):
        raise ValueError(f"order must name each of the {len(mods)} deferring modules exactly once, got {order!r}")
    return picked


def drain_deferred_wgrads(model: nn.Module | Sequence[nn.Module], *, order="reverse") -> int:
    """Runs every queued deferred wgrad under ``model``, each module's whole FIFO in turn; returns how many."""
    count = 0
    m: Any
    for m in _ordered(deferred_modules(model), order):
        while getattr(m, "pending_backward_dw", 0):
            m.backward_dw()
            count += 1
    return count


@contextlib.contextmanager
def deferred_wgrad_scope(model: nn.Module | Sequence[nn.Module], *, order="reverse",
                         strict: bool = False) -> Iterator[list[nn.Module]]:
    """Runs the body, then drains every deferred wgrad of ``model``; after an exception in the body, nothing.

    ``strict=True``: while open, each store refuses to queue work on top of undrained work.
    """
    mods = deferred_modules(model)
    previous = [m.wgrad_store.strict for m in mods]
    for m in mods:
        m.wgrad_store.strict = strict or m.wgrad_store.strict
    try:
        yield mods
        drain_deferred_wgrads(mods, order=order)
    finally:
        for m, s in zip(mods, previous):
            m.wgrad_store.strict = s


def undrained(model: nn.Module | Sequence[nn.Module]) -> list[str]:
    """Names of modules with deferred wgrads still queued."""
    stores: list[Any] = [m.wgrad_store for m in deferred_modules(model)]
    out = []
    for s in (s for s in stores if len(s)):
        labels = [x for x in s.labels() if x != "unclaimed"]
        out.append(f"{s.owner} ({len(s)} queued" + (f": {', '.join(labels)})" if labels else ")"))
    return out


def run_deferred(module: Any, work: Any) -> None:
    """Runs one claimed deferred wgrad of ``module`` and its accumulate-and-reduce hooks, as ``backward_dw()`` does."""
    module.wgrad_store.run(work)
    for hook in module.wgrad_accumulation_and_reduce_hooks:
        hook()


__all__ += ["undrained", "run_deferred", "DeferredWgradError"]
