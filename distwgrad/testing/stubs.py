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
