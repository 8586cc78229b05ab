"""Fixed-seed samples of the large test sweeps, so CI on two cores runs a subset and ``--full`` runs all.

A sweep of cases (configs, dtypes, shapes) that is too slow for CI keeps a deterministic sample: the
first and last case (the edges a sweep is usually ordered by) and ``k - 2`` more drawn by a seeded
generator, the same cases on every run and machine. ``pytest --full`` (``tests/conftest.py``) sets
``DISTWGRAD_FULL_SWEEPS=1``, which this module reads, so the interpreter cases that run in a child
process see it too; ``qa/L2_gpu/run.sh`` runs the full sweeps.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from typing import TypeVar

__all__ = ["full", "sample", "params", "FULL_ENV"]

FULL_ENV = "DISTWGRAD_FULL_SWEEPS"
T = TypeVar("T")


def full() -> bool:
    """Whether this run takes every case (``pytest --full``)."""
    return os.environ.get(FULL_ENV) == "1"


def sample(cases: Sequence[T], k: int, *, seed: int = 0) -> list[T]:
    """``cases`` in order, or, unless :func:`full`, ``k`` of them: the first, the last and ``k - 2`` drawn
    with ``random.Random(seed)``."""
    cases = list(cases)
    if k < 2:
        raise ValueError(f"sample: k must be at least 2 (the first and last case), got {k}")
    if full() or len(cases) <= k:
        return cases
    middle = sorted(random.Random(seed).sample(range(1, len(cases) - 1), k - 2))
    return [cases[i] for i in (0, *middle, len(cases) - 1)]


def params(cases: Sequence[T], k: int, *, seed: int = 0) -> list:
    """``cases`` as ``pytest.param``s for ``parametrize``: :func:`sample`'s ``k`` as they are, the rest marked
    ``full`` (skipped without ``--full``, listed either way)."""
    import pytest  # the tests' dependency, not the package's

    picked = {id(c) for c in sample(cases, k, seed=seed)}
    return [pytest.param(c) if id(c) in picked else pytest.param(c, marks=pytest.mark.full) for c in cases]
