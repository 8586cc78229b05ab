"""Pipeline schedules by torch's names, where each places its stages, and what each needs; no torch import
beyond the standard library's, so the job can check its options before anything is built."""

from __future__ import annotations

__all__ = ["SCHEDULES", "stage_placement", "check_pipeline_config"]

# torch's names; single: one stage per rank; v: two stages per rank, the first and last on rank 0.
SCHEDULES = {"GPipe": "single", "1F1B": "single", "Interleaved1F1B": "loop", "InterleavedZeroBubble": "loop",
             "ZBVZeroBubble": "v", "DualPipeV": "v"}


def _schedule_name(name: str) -> str:
    for known in SCHEDULES:
        if known.lower() == str(name).lower():
            return known
    raise ValueError(f"pipeline schedule {name!r} is not one of {sorted(SCHEDULES)}")


def stage_placement(schedule: str, pp_rank: int, pp_size: int, stages_per_rank: int = 1) -> list[int]:
    """The stage indices that rank ``pp_rank`` of ``pp_size`` holds, in the order the schedule expects.

    ``GPipe`` and ``1F1B``: one stage, ``pp_rank``. Interleaved schedules: ``stages_per_rank`` stages in a
    loop (rank r holds r, r + pp, r + 2 pp, ...). ``ZBVZeroBubble`` and ``DualPipeV``: two stages in a V
    (rank r holds r and 2 pp - 1 - r), so the first and the last stage share rank 0.
    """
    kind = SCHEDULES[_schedule_name(schedule)]
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank must be in [0, {pp_size}), got {pp_rank}")
    if kind == "single":
        if stages_per_rank != 1:
            raise ValueError(f"{schedule} runs one stage per rank, got stages_per_rank={stages_per_rank}")
        return [pp_rank]
    if kind == "v":
        if stages_per_rank != 2:
            raise ValueError(f"{schedule} runs two stages per rank (a V), got stages_per_rank={stages_per_rank}")
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    if stages_per_rank < 1:
        raise ValueError(f"stages_per_rank must be >= 1, got {stages_per_rank}")
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


def check_pipeline_config(schedule: str, *, pp_size: int, n_layers: int, n_microbatches: int,
                          stages_per_rank: int | None = None) -> int:
    """Checks a pipeline configuration before anything is built; returns the stages per rank.

    One ``ValueError`` naming the values for: an unknown schedule, layers that do not divide over the
    stages, fewer microbatches than a schedule can run (``1F1B`` and the interleaved schedules need at least
    ``pp_size``; the V schedules at least ``2 * pp_size`` for DualPipeV, ``pp_size`` for ZBV).
    """
    name = _schedule_name(schedule)
    kind = SCHEDULES[name]
    per_rank = {"single": 1, "v": 2}.get(kind, stages_per_rank or 2)
    if stages_per_rank is not None and stages_per_rank != per_rank:
        raise ValueError(f"{name} runs {per_rank} stage(s) per rank, got stages_per_rank={stages_per_rank}")
    if pp_size < 1:
        raise ValueError(f"pp_size must be >= 1, got {pp_size}")
    stages = pp_size * per_rank
    if n_layers % stages:
        raise ValueError(f"{n_layers} layers do not divide over {stages} pipeline stages ({name} at pp={pp_size}: "
                         f"{per_rank} stage(s) per rank); choose a layer count that is a multiple of {stages}")
    need = 2 * pp_size if name == "DualPipeV" else (pp_size if name != "GPipe" else 1)
    if n_microbatches < need:
        raise ValueError(f"{name} at pp={pp_size} needs at least {need} microbatches, got {n_microbatches}")
    return per_rank
