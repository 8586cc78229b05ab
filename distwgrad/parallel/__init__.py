"""Where each kind of parallelism lives: data-parallel sharding is the weights themselves
(``distwgrad/weights/``); pipeline stages and schedules are here (``pipeline.py``)."""

from distwgrad.parallel.pipeline import (
    SCHEDULES,
    PipelineStage,
    build_schedule,
    check_pipeline_config,
    stage_placement,
    tie_first_and_last_stage,
)

__all__ = ["PipelineStage", "build_schedule", "stage_placement", "check_pipeline_config", "SCHEDULES",
           "tie_first_and_last_stage"]
