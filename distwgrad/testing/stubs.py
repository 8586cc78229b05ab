"""Stand-ins for launcher tests that must not compile or run a kernel."""

from __future__ import annotations

import functools
from collections.abc import Callable


class StubKernel:
    """Takes a jitted kernel's place: ``kernel[grid](*args, **kwargs)`` calls ``launch(grid, *args,
    **kwargs)`` instead, so a test sees the grid and arguments a launcher chose (or makes the launch
    fail as a build would)."""

    def __init__(self, launch: Callable) -> None:
        self._launch = launch

    def __getitem__(self, grid) -> Callable:
        return functools.partial(self._launch, grid)


def record_ragged_dispatch(monkeypatch, kernels, triton_kernel: str) -> list[str]:
    """Makes ``kernels`` (a grouped-GEMM kernel module) record which fprop/dgrad kernel its dispatcher
    picks instead of running one: the Gluon kernel always applies and "launches" as ``"gluon"``, the
    Triton kernel named ``triton_kernel`` as ``"triton"``. Returns the list the choices land in."""
    taken: list[str] = []

    def launch_gluon(*args) -> bool:
        taken.append("gluon")
        return True
    monkeypatch.setattr(kernels, "_gluon_ragged", lambda *a: True)
    monkeypatch.setattr(kernels, "_launch_gluon_ragged", launch_gluon)
    monkeypatch.setattr(kernels, triton_kernel, StubKernel(lambda grid, *a, **kw: taken.append("triton")))
    return taken
