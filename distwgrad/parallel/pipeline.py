"""Pipeline parallelism on ``torch.distributed.pipelining``, whose W steps are distwgrad's deferred wgrads.

[Note: W steps are deferred wgrads]
Zero-bubble schedules split backward into B (the input gradient, which the previous stage awaits) and W (the
weight gradient, which nobody awaits). torch's split works on the autograd graph and cannot reach inside one
autograd Function; distwgrad modules with ``delay_wgrad_compute=True`` split themselves, so B is torch's full
backward of the stage, and right after it the stage claims the wgrads it queued for the schedule's W of that
(stage, microbatch) through torch's ``dw_builder`` hook (``WeightGradStore.claim``). A schedule without W
actions runs them right after B; a W that never ran makes ``finalize_model_grads`` raise, naming the module,
stage and microbatch.

[Note: the loss is divided, not the gradients]
torch's schedules divide ``.grad`` by the microbatch count after the step, where a distwgrad weight's gradient
is not yet. So :func:`build_schedule` divides each microbatch's loss instead (the same gradients), and a stage
refuses torch's scaling rather than scale the plain parameters alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining as _pp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import schedules as _schedules

from distwgrad.parallel.schedules import SCHEDULES, _schedule_name, check_pipeline_config, stage_placement
from distwgrad.wgrad.scheduler import deferred_modules, run_deferred

__all__ = ["PipelineStage", "build_schedule", "stage_placement", "SCHEDULES", "check_pipeline_config",
           "tie_first_and_last_stage"]

class PipelineStage(_pp.PipelineStage):
    """torch's ``PipelineStage`` whose W actions run this stage's deferred wgrads of that microbatch.

    ``input_args``/``output_args`` (one microbatch, meta tensors will do) are required: torch's shape inference
    would deliver made-up wgrads into the real step. ``times``: each action's seconds ("F", "B", "W")."""

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device: torch.device | str, *,
                 input_args: Any, output_args: Any, group: Any = None, timed: bool = False) -> None:
        if input_args is None or output_args is None:
            raise ValueError(f"distwgrad.parallel.PipelineStage {stage_index}: pass input_args and output_args (the "
                             f"shapes of one microbatch's activations); torch's shape inference would run the "
                             f"stage on made-up data and count it as part of the step")
        super().__init__(submodule, stage_index, num_stages, torch.device(device), input_args=input_args,
                         output_args=output_args, group=group, dw_builder=self._claim_wgrads)
        given = (input_args,) if isinstance(input_args, torch.Tensor) else tuple(input_args)
        self._input_shapes = [tuple(t.shape) for t in given if isinstance(t, torch.Tensor)]
        self.timed = timed
        self.times: dict[str, list[float]] = {"F": [], "B": [], "W": []}
        self._bwd_chunk: int | None = None
        self._deferred: list[Any] | None = None  # the stage's deferring modules, at the first claim

    def reset_times(self) -> None:
        for v in self.times.values():
            v.clear()

    def _clock(self) -> float:
        if self.timed and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
                          save_forward_output: bool = True):
        if self.is_first:
            shapes = [tuple(t.shape) for t in args if isinstance(t, torch.Tensor)]
            if shapes != self._input_shapes:
                raise ValueError(
                    f"distwgrad.parallel.PipelineStage {self.stage_index}: microbatch {fwd_chunk_id} has input shapes "
                    f"{shapes}, but the stage was built for {self._input_shapes} (input_args): the batch must split "
                    f"into microbatches of equal size (each microbatch's loss is divided by their number)")
        t0 = self._clock()
        out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        self.times["F"].append(self._clock() - t0)
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        self._bwd_chunk = bwd_chunk_id
        t0 = self._clock()
        try:
            super().backward_one_chunk(bwd_chunk_id, loss, full_backward=False, last_backward=last_backward)
        finally:
            self._bwd_chunk = None
        self.times["B"].append(self._clock() - t0)
        if full_backward:  # a schedule without W actions: the W runs now ([Note: W steps are deferred wgrads])
            self.backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        t0 = self._clock()
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        self.times["W"].append(self._clock() - t0)

    def _claim_wgrads(self) -> Callable[[], None]:
        """torch's ``dw_builder``, called right after a microbatch's B: binds the wgrads it queued to its W."""
        label = f"W of stage {self.stage_index}, microbatch {self._bwd_chunk}"
        if self._deferred is None:  # which modules defer is fixed at construction: found once
            self._deferred = list(deferred_modules(self.submod)[::-1])  # the order backward produced the work
        mods: list[Any] = self._deferred
        work = [(m, w) for m in mods for w in m.wgrad_store.claim(label)]

        def run_w() -> None:
            for m, w in work:
                run_deferred(m, w)
        return run_w

    def scale_grads(self, grad_scale_factor: int) -> None:
        if grad_scale_factor != 1:
            raise RuntimeError(
                f"distwgrad.parallel.PipelineStage {self.stage_index}: the schedule divides gradients by "
                f"{grad_scale_factor} after the step (torch's scale_grads=True), which cannot reach distwgrad "
                f"weights (their gradients are not in .grad until finalize_model_grads): build the schedule with "
                f"distwgrad.parallel.build_schedule, or pass scale_grads=False and divide the loss yourself")


def build_schedule(schedule: str, stages: PipelineStage | Sequence[PipelineStage], n_microbatches: int,
                   loss_fn: Callable[..., torch.Tensor], **kwargs: Any) -> Any:
    """torch's schedule ``schedule`` (one of :data:`SCHEDULES`) over this rank's ``stages``; ``kwargs`` go to it.
    Each microbatch's loss is ``loss_fn(output, target) / n_microbatches`` ([Note: the loss is divided, not
    the gradients]), so the ``losses`` that ``step()`` fills sum to the batch's mean loss."""
    name = _schedule_name(schedule)
    if "scale_grads" in kwargs:
        raise ValueError("build_schedule divides the loss; scale_grads cannot be passed "
                         "([Note: the loss is divided, not the gradients])")
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"n_microbatches must be a positive int, got {n_microbatches!r}")
    local = [stages] if isinstance(stages, PipelineStage) else list(stages)
    if not local or not all(isinstance(s, PipelineStage) for s in local):
        got = [type(s).__name__ for s in local]
        raise TypeError(f"stages must be distwgrad.parallel.PipelineStage objects, got {got}")

    def divided(output, target):
        return loss_fn(output, target) / n_microbatches

    cls = _schedules.get_schedule_class(name)
    if SCHEDULES[name] == "single":
        if len(local) != 1:
            raise ValueError(f"{name} runs one stage per rank, got {len(local)}")
        return cls(local[0], n_microbatches, loss_fn=divided, scale_grads=False, **kwargs)
    return cls(local, n_microbatches, loss_fn=divided, scale_grads=False, **kwargs)


def tie_first_and_last_stage(weight: nn.Parameter | None, schedule: str, mesh: DeviceMesh) -> None:
    """Ties this rank's copy of ``weight`` (used on the first and last stage: an embedding and its lm_head) to
    the other stage's copy, so their gradients sum at finalize ([Note: a weight tied across pipeline stages]
    in ``weights/base.py``).

    ``mesh``: ``(pp,)``, ``(pp, dp)`` or ``(pp, replicate, shard)``; a V schedule ties nothing. Collective over
    the default group: every rank calls it per tied weight, in one order; a rank without either stage passes None.
    """
    if not isinstance(mesh, DeviceMesh) or mesh.ndim not in (1, 2, 3):
        raise ValueError(f"tie_first_and_last_stage: mesh must be a 1-D (pp), 2-D (pp, dp) or 3-D (pp, replicate, "
                         f"shard) DeviceMesh, got {mesh!r}")
    ranks = mesh.mesh.reshape(mesh.shape[0], -1)  # [pp, every data-parallel place]
    pp = ranks.shape[0]
    last = 0 if SCHEDULES[_schedule_name(schedule)] == "v" else pp - 1
    me = dist.get_rank()
    mine = None
    for j in range(ranks.shape[1]):  # every rank creates every pair's group: dist.new_group's contract
        pair = sorted({int(ranks[0, j]), int(ranks[last, j])})
        group = dist.new_group(pair) if len(pair) > 1 else None
        if me in pair:
            mine = group
    if mine is not None:
        if not hasattr(weight, "tie_across_stages"):
            raise TypeError(f"tie_first_and_last_stage: a distwgrad weight (ShardedWeight, ReplicatedWeight) is "
                            f"needed, got {type(weight).__name__}")
        weight.tie_across_stages(mine)
