"""``--cuda-graph``: the job's transformer blocks replayed from CUDA graphs, the rest of the step eager.

[Note: the graphed step]
* The blocks are the callables of one ``distwgrad.make_graphed_callables`` call, captured before the first
  step from one microbatch's shape. Embedding, final norm, tied lm_head and loss stay eager (the tied weight
  is used outside every block); the step is the eager one, the blocks' reduce-scatters replaying inside the
  graphs ([Note: captured distributed weights] in ``distwgrad/graphs.py``).
* Reductions are synchronous (an ``async_reduce`` wait runs on the host); the flag is read only when a
  reduction launches, so :func:`synchronous_reductions` before any step gives the same bits.
* FP8: the graphs compute the blocks' amaxes ([Note: amax under capture] in ``distwgrad/fp8/weights.py``),
  so the step syncs amaxes of :func:`eager_modules` only. At world > 1 it is refused (exit code 2, as is a
  CPU device): an NCCL amax all-reduce in every replay is not yet run on several GPUs.
* FP8 weights kept across microbatches (the step's default) are kept in the graphs too ([Note: fp8 weights kept
  in CUDA graphs] in ``distwgrad/fp8/graph_kept.py``).
* Replays skip Python, so the weights' byte counters miss the blocks' collectives (``report.json`` says so).

[Note: compiled blocks under CUDA graphs]
A compiled module routes every call through dynamo, which would trace the replay ``make_graphed_callables``
installs as its ``forward``. So ``--compile`` compiles each block's ``forward`` instead
(``launch.train.compile_blocks``); capture runs the compiled code, and the replay is called without dynamo.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import distwgrad
from distwgrad.fp8.recipe import Recipe
from distwgrad.models import MoEGPT
from distwgrad.weights.base import DistributedParameter

from .config import fp8_recipe

__all__ = ["check_device", "recipe_for_graphs", "synchronous_reductions", "graph_blocks", "eager_modules", "release"]

NUM_WARMUP_ITERS = 3  # make_graphed_callables' default
EAGER_PARTS = ("embedding", "final rms_norm", "lm_head (tied to the embedding)", "loss")


def check_device(device: torch.device, backend: str) -> None:
    """Raises ``ValueError`` unless ``device`` is CUDA over NCCL."""
    if device.type != "cuda" or backend != "nccl":
        raise ValueError(f"--cuda-graph needs CUDA devices with NCCL, but this run is on {device} over {backend} "
                         f"(CUDA graphs capture CUDA kernels and NCCL collectives only); run it on a CUDA machine, "
                         f"or leave out --cuda-graph")


def recipe_for_graphs(name: str) -> Recipe | None:
    """The FP8 recipe the blocks are captured under: the step's own."""
    return fp8_recipe(name)


def synchronous_reductions(modules: tuple[nn.Module, ...]) -> int:
    """Sets ``async_reduce=False`` on ``modules``' distributed weights before any step opens; returns how many."""
    switched = 0
    for m in modules:
        for p in m.parameters():
            if isinstance(p, DistributedParameter) and p.async_reduce:
                p.async_reduce = False
                switched += 1
    return switched


def _new_main_grad_bytes(params: Sequence[torch.Tensor], before: set[int]) -> int:
    grads = [getattr(p, "main_grad", None) for p in params]
    return sum(g.untyped_storage().nbytes() for g in grads if g is not None and id(g) not in before)


def graph_blocks(model: MoEGPT, rows: int, *, recipe: Recipe | None = None,
                 keep_fp8_weights: bool = False) -> dict[str, Any]:
    # keep_fp8_weights: the graphs keep FP8 weights across a step's microbatches (step.keeps_fp8_weights)
    """Graphs every block for microbatches of ``rows`` sequences; returns what was captured, for ``report.json``."""
    blocks = tuple(model.blocks)
    cfg, dtype = model.config, model.param_dtype or torch.float32
    device = next(model.parameters()).device
    shape = (rows, cfg.seq_len, cfg.d_model)
    switched = synchronous_reductions(blocks)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    samples = tuple((torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_(),)
                    for _ in blocks)
    params = [p for b in blocks for p in b.parameters()]
    had = {id(g) for g in (getattr(p, "main_grad", None) for p in params) if g is not None}
    torch.cuda.synchronize(device)
    allocated, t0 = torch.cuda.memory_allocated(device), time.perf_counter()
    distwgrad.make_graphed_callables(blocks, samples, num_warmup_iters=NUM_WARMUP_ITERS,
                                     fp8_enabled=recipe is not None, fp8_recipe=recipe,
                                     cache_quantized_params=keep_fp8_weights and recipe is not None)
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    pool = torch.cuda.memory_allocated(device) - allocated - _new_main_grad_bytes(params, had)
    del samples
    return {"graphed": [f"blocks.{i}" for i in range(len(blocks))], "eager": list(EAGER_PARTS),
            "sample_shape": list(shape), "dtype": str(dtype).removeprefix("torch."),
            "num_warmup_iters": NUM_WARMUP_ITERS, "recipe": None if recipe is None else repr(recipe),
            "fp8_weights_kept": keep_fp8_weights and recipe is not None,
            "weights_made_synchronous": switched, "capture_s": seconds, "graph_bytes": pool,
            "comm_bytes": "the blocks' collectives replay inside the graphs, which skip the weights' byte "
                          "counters: bytes_*_per_step count the eager embedding and lm_head only"}


def eager_modules(model: MoEGPT) -> tuple[nn.Module, ...]:
    """The modules outside the graphed blocks: those whose amaxes the eager step syncs ([Note: the graphed step])."""
    return tuple(m for name, m in model.named_children() if name != "blocks")


def release(model: MoEGPT) -> None:
    """Releases the blocks' graphs and their pool (the blocks cannot run afterwards)."""
    model.blocks[0].reset()  # type: ignore[operator]  # installed by make_graphed_callables
