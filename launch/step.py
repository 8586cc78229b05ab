"""What one training step is, shared by the job, its parity oracle and the benchmarks: the recipe's autocast,
the optimizer, forward and backward of every microbatch, and the compiled blocks."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import torch

import distwgrad
from distwgrad.fp8 import fp8_autocast
from distwgrad.fp8 import microbatch as fp8_microbatch
from distwgrad.fp8.weights import sync_weight_amax
from distwgrad.models import MoEGPT

from .config import RECIPES, TrainConfig, fp8_recipe

__all__ = ["forward_backward", "compile_blocks", "optimizer_for", "optimizer_step", "comm_bytes", "RECIPE_CONTEXTS"]


def _autocast(recipe: str) -> contextlib.AbstractContextManager:
    """The context each forward/backward runs in: ``fp8_autocast`` of the recipe (distwgrad.fp8; emulated on
    CPU), or none."""
    fp8 = fp8_recipe(recipe)
    return contextlib.nullcontext() if fp8 is None else fp8_autocast(fp8)


RECIPE_CONTEXTS = {name: functools.partial(_autocast, name) for name in RECIPES}


def compile_blocks(model: MoEGPT, **compile_kwargs: Any) -> None:
    """``--compile``: each block's ``forward`` replaced by its ``torch.compile`` (the module's state, hooks and
    checkpoint keys unchanged). Compiled as a ``forward``, not as a module (``block.compile()``), so that
    ``--cuda-graph`` can graph it: a compiled module sends every call through dynamo, which would then trace
    the replay that graphing installs as the module's ``forward`` ([Note: compiled blocks under CUDA graphs]
    in ``launch/cuda_graph.py``)."""
    for block in model.blocks:
        block.forward = torch.compile(block.forward, **compile_kwargs)


def _optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW, fused on CUDA (one kernel over every parameter, distwgrad's shards included)."""
    params = list(model.parameters())
    fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, fused=fused or None)


def optimizer_for(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW, fused on CUDA (one kernel over every parameter, distwgrad's shards included)."""
    params = list(model.parameters())
    fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, fused=fused or None)


def keeps_fp8_weights(keep: bool, microbatches: int, recipe: str) -> bool:
    # so do --cuda-graph's graphs: [Note: fp8 weights kept in CUDA graphs] in distwgrad/fp8/graph_kept.py
    """Whether a step keeps FP8 weights across its microbatches: asked to, with an FP8 recipe and several."""
    return keep and microbatches > 1 and recipe != "none"


def forward_backward(model: torch.nn.Module, tokens_BS: torch.Tensor, microbatches: int,
                     recipe: str = "none", amax_modules: Sequence[torch.nn.Module] | None = None, *,
                     keep_fp8_weights: bool = True) -> torch.Tensor:
    """Forward and backward of every microbatch of ``tokens_BS`` (``[B, S + 1]``: inputs, then shifted
    targets), deferred wgrads drained; returns the loss (token mean, summed over microbatches), detached.
    The caller ends the step with ``distwgrad.finalize_model_grads`` and the optimizer. ``amax_modules``:
    whose sharded weights' amaxes a per-tensor step syncs first (default: the whole model; under
    ``--cuda-graph`` the eager parts, ``cuda_graph.eager_modules``: the graphs compute their own).
    ``keep_fp8_weights``: with an FP8 recipe and several microbatches, each runs under ``fp8.microbatch(first=...)``
    ([Note: fp8 weights kept across microbatches] in ``distwgrad/fp8/weights.py``); False: weights quantized at
    every use (``qa/studies/fp8_weights_kept.py`` compares the two)."""
    total = torch.zeros((), device=tokens_BS.device)
    if recipe.startswith("fp8_per_tensor"):
        # one amax all-reduce for every sharded weight of the step
        sync_weight_amax(model if amax_modules is None else amax_modules)
    keep = keeps_fp8_weights(keep_fp8_weights, microbatches, recipe)
    for i, mb in enumerate(tokens_BS.chunk(microbatches)):
        with RECIPE_CONTEXTS[recipe](), (fp8_microbatch(first=i == 0) if keep else contextlib.nullcontext()):
            loss = model.loss(mb[:, :-1], mb[:, 1:]) / microbatches
            loss.backward()
        distwgrad.drain_deferred_wgrads(model)
        total += loss.detach()
    return total


def optimizer_step(optimizer: torch.optim.Optimizer, lr: float | None = None) -> None:
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def comm_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """All-gathered and reduce-scattered bytes so far, summed over distinct weights (tied: once)."""
    params = [p for _, p in distwgrad.wgrad.distributed_parameters(model)]
    return sum(p.bytes_gathered for p in params), sum(p.bytes_reduced for p in params)
