"""``--pp``: the job's model cut into pipeline stages on a ``(pp, dp)`` mesh and run by torch's schedules
(``distwgrad.parallel``): each stage's weights sharded over its data-parallel group (coalesced a block at a
time with ``--coalesce``), the embedding / lm_head weight tied across the first and the last stage
(docs/pipeline.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import distwgrad
from distwgrad.fp8.weights import sync_weight_amax
from distwgrad.models.moe_gpt_stage import MoEGPTStage, stage_loss
from distwgrad.parallel import (
    PipelineStage,
    build_schedule,
    check_pipeline_config,
    stage_placement,
    tie_first_and_last_stage,
)

from .config import TrainConfig
from .step import RECIPE_CONTEXTS

__all__ = ["Pipeline", "build_pipeline", "StageModules"]


class StageModules(nn.ModuleList):
    """This rank's stage modules, their parameters named as ``MoEGPT`` names them: blocks by their global
    index, the lm_head's copy of the tied weight as ``embedding.weight`` (checkpoints, the optimizer, the
    weights' names in errors: [Note: checkpoints of pipeline stages] in ``distwgrad/checkpoint.py``)."""

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        seen: set[int] = set()
        for module in self:
            for name, p in module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate):
                if name == prefix + "lm_head.weight":
                    name = prefix + "embedding.weight"
                if remove_duplicate and id(p) in seen:
                    continue
                seen.add(id(p))
                yield name, p


@dataclass
class Pipeline:
    """This rank's part of the pipeline: its stages, their modules (``model``: what the optimizer, the byte
    counters and the gradient norm see) and the schedule."""

    config: TrainConfig
    model: StageModules
    stages: list[PipelineStage]
    schedule: Any
    dp_group: Any
    dp_rank: int
    dp_size: int
    first: bool  # holds stage 0: feeds the inputs
    last: bool  # holds the last stage: computes the loss
    tied_copy: torch.Tensor | None  # the last stage's copy of the embedding weight, when it is a second copy
    coalesced: list[int]  # the stages whose blocks are coalesced units

    def forward_backward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """One step's forward and backward of every microbatch; this rank's share of the loss (the sum of the
        divided microbatch losses on the last stage: this data-parallel rank's mean loss; 0 elsewhere)."""
        for stage in self.stages:
            stage.reset_times()
        recipe = self.config.recipe
        if recipe.startswith("fp8_per_tensor"):
            sync_weight_amax(self.model)  # one amax all-reduce per data-parallel group, as the job's step does
        losses: list[torch.Tensor] = []
        args = (tokens_BS[:, :-1].contiguous(),) if self.first else ()
        kwargs = {"target": tokens_BS[:, 1:].contiguous(), "losses": losses} if self.last else {}
        with RECIPE_CONTEXTS[recipe]():  # every F, B and W of the step under the recipe
            self.schedule.step(*args, **kwargs)
        return torch.stack(losses).sum().detach() if losses else torch.zeros((), device=tokens_BS.device)

    def finalize(self) -> None:
        distwgrad.finalize_model_grads(list(self.model), dp_group=self.dp_group)

    def stage_times(self) -> dict[int, dict[str, float]]:
        """Milliseconds per action kind of the last step, per stage of this rank (mean over microbatches)."""
        return {s.stage_index: {f"{k}_ms": 1e3 * sum(v) / len(v) for k, v in s.times.items() if v}
                for s in self.stages}


def build_pipeline(config: TrainConfig, world_size: int, device: torch.device,
                   param_dtype: torch.dtype | None) -> Pipeline:
    """This rank's stages of ``MoEGPT(config.model_config())`` on a ``(pp, dp)`` mesh, and the schedule."""
    mc = config.model_config()
    pp, dp, micro = config.pp, world_size // config.pp, config.step_microbatches
    per_rank = check_pipeline_config(config.pp_schedule, pp_size=pp, n_layers=mc.n_layers, n_microbatches=micro)
    mesh = init_device_mesh(device.type, (pp, dp), mesh_dim_names=("pp", "dp"))
    dp_group = mesh.get_group("dp")
    n_stages, per_stage = pp * per_rank, mc.n_layers // (pp * per_rank)
    indices = stage_placement(config.pp_schedule, mesh.get_local_rank("pp"), pp, per_rank)
    rows = config.global_batch // (dp * micro)
    act = param_dtype or torch.float32
    shared = None
    modules, stages = [], []
    for s in indices:
        first, last = s == 0, s == n_stages - 1
        module = MoEGPTStage(mc, range(s * per_stage, (s + 1) * per_stage), first=first, last=last, device=device,
                             group=dp_group, param_dtype=param_dtype, tied=shared)
        if first or last:
            shared = module.tied_weight  # a V schedule's other end on this rank uses the same object
        x = (torch.empty(rows, mc.seq_len, dtype=torch.long, device="meta") if first else
             torch.empty(rows, mc.seq_len, mc.d_model, dtype=act, device="meta", requires_grad=True))
        y = torch.empty(rows, mc.seq_len, mc.vocab_size if last else mc.d_model, dtype=act, device="meta",
                        requires_grad=True)
        modules.append(module)
        stages.append(PipelineStage(module, s, n_stages, device, input_args=x, output_args=y,
                                    group=mesh.get_group("pp"), timed=True))
    holds_both = {0, n_stages - 1} <= set(indices)
    coalesced = []
    if config.coalesce and dp > 1:  # one gather and one reduction a block, per stage ([Note: coalesced units])
        for s, module in zip(indices, modules):  # both ends of a V share the tied weight, which joins one unit
            if not (holds_both and (module.first or module.last)):
                distwgrad.coalesce(module, units=list(module.blocks.values()))
                coalesced.append(s)
    tie_first_and_last_stage(None if holds_both else shared, config.pp_schedule, mesh)
    last_module = next((m for m in modules if m.last), None)
    tied_copy = last_module.lm_head.weight if last_module is not None and not holds_both else None
    schedule = build_schedule(config.pp_schedule, stages, micro, stage_loss)
    return Pipeline(config, StageModules(modules), stages, schedule, dp_group, dist.get_rank(dp_group), dp,
                    any(m.first for m in modules), last_module is not None, tied_copy, coalesced)
