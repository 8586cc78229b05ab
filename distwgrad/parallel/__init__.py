"""Where each kind of parallelism lives: data-parallel sharding is the weights themselves
(``distwgrad/weights/``); pipeline stages and schedules are here (``pipeline.py``, ``schedules.py``), and
expert parallelism (``experts.py``: ``ExpertParallel``, imported from there).

``torch.distributed.pipelining`` (and with it DTensor) loads on first use of a name from ``pipeline.py``,
not on ``import distwgrad.parallel``: the job checks its options (``schedules.py``) before it loads.
"""

from __future__ import annotations

import importlib
from typing import Any

from distwgrad.parallel.schedules import SCHEDULES, check_pipeline_config, stage_placement

__all__ = ["PipelineStage", "build_schedule", "stage_placement", "check_pipeline_config", "SCHEDULES",
           "tie_first_and_last_stage"]

_FROM_PIPELINE = ("PipelineStage", "build_schedule", "tie_first_and_last_stage")


def __getattr__(name: str) -> Any:
    if name in _FROM_PIPELINE:
        return getattr(importlib.import_module("distwgrad.parallel.pipeline"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
