"""Test support shipped with the package, so tests and benchmarks share one oracle and one harness.

``reference`` holds the reference implementations; ``multiprocess`` the multi-rank test harness
(``run_distributed``, ``for_each_case``); ``job_ranks`` a job's ranks as torchrun would start them, forked
(``run_job``); ``interpreter`` runs a test script under Triton's interpreter.
Submodules load on first access, not on ``import distwgrad.testing``, so importing this package stays
cheap (no ``torch.distributed``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["interpreter", "job_ranks", "multiprocess", "reference", "sweep"]


def __getattr__(name: str) -> ModuleType:
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
