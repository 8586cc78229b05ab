"""``--cuda-graph``: the job's transformer blocks replayed from CUDA graphs, the rest of the step eager.

[Note: the graphed step]
* What is graphed. Each block of ``MoEGPT.blocks`` is one callable of a single
  ``distwgrad.make_graphed_callables`` call (the per-module schedule: forwards captured in block order,
  backwards in reverse, every deferred expert wgrad as its own graph, one memory pool), captured once
  before the first step from a sample input of one microbatch's shape, ``[rows, seq_len, d_model]`` in the
  compute dtype (rows: ``global_batch / world / microbatches``). The embedding, the final norm, the tied
  lm_head and the loss stay eager: the tied weight is used at both ends of the model, outside every block.
* The step is the eager one (``forward_backward`` in ``launch/train.py``, ``finalize_model_grads``, the
  optimizer): calling a block replays its forward graph, ``loss.backward()`` its backward graph,
  ``drain_deferred_wgrads`` the expert wgrad graphs. The blocks' gradient accumulation and, at world > 1,
  their NCCL reduce-scatters run inside the graphs; ``finalize_model_grads`` runs eagerly, as always
  ([Note: captured distributed weights] in ``distwgrad/graphs.py``).
* Reductions are synchronous. ``MoEGPT`` builds its weights with ``async_reduce=True`` (the eager step
  overlaps each reduce-scatter with the rest of backward), whose wait runs on the host, which a graph
  cannot capture. The flag is read only when a reduction launches, so switching it off on the blocks'
  weights before any step opens (:func:`synchronous_reductions`) is building them with
  ``async_reduce=False``; the sums are bit-identical either way ([Note: contribution accounting] in
  ``distwgrad/weights/base.py``).
* FP8. The blocks are captured under the step's recipe (``--recipe``). The weights' amaxes (per tensor)
  and block-scale grids (blockwise) are computed inside the graphs from the weights each replay reads,
  never taken from the host-side cache that ``sync_weight_amax`` refreshes for the eager parts ([Note: amax
  under capture] in ``distwgrad/fp8/weights.py``); a block's backward reuses its forward's amax. So the
  per-tensor step syncs the amaxes of the eager parts' weights only (:func:`eager_modules`): the blocks'
  would be computed and never read (a whole pass over their fp32 masters a step).
* Refused before any process group exists (exit code 2, one line; ``launch/config.py`` and
  :func:`check_device`): a CPU device (gloo collectives and CPU kernels cannot be captured); an FP8 recipe
  at world > 1 (its graphs would all-reduce each weight's amax or grid inside every replay: an NCCL capture
  not yet run on several GPUs).
* Replays skip Python, so the weights' ``bytes_gathered`` / ``bytes_reduced`` counters do not move for the
  blocks' collectives: with ``--cuda-graph`` the report's per-step byte counts cover the eager embedding
  and lm_head only (``report.json``'s ``cuda_graph.comm_bytes`` says so).

[Note: compiled blocks under CUDA graphs]
``nn.Module.compile()`` routes every call of the module through dynamo, and ``make_graphed_callables``
replaces the module's ``forward`` with the replay: a compiled module would then trace the replay, not run it.
So ``--compile`` compiles each block's ``forward`` (``block.forward = torch.compile(block.forward)``:
``launch.train.compile_blocks``, the same compiled code), the warm-up and capture run it, and the replay that
replaces it is called without dynamo. The graphs hold inductor's kernels as well as the custom ops', so a step
issues the eager embedding, head, loss and optimizer only: what a host-bound step (FP8: its quantization
launches per call) gains.
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
    """Raises ``ValueError`` unless ``device`` is CUDA (and so the backend NCCL)."""
    if device.type != "cuda" or backend != "nccl":
        raise ValueError(f"--cuda-graph needs CUDA devices with NCCL, but this run is on {device} over {backend} "
                         f"(CUDA graphs capture CUDA kernels and NCCL collectives only); run it on a CUDA machine, "
                         f"or leave out --cuda-graph")


def recipe_for_graphs(name: str) -> Recipe | None:
    """The FP8 recipe the blocks are captured under: the step's own (``launch/config.py``'s ``fp8_recipe``)."""
    return fp8_recipe(name)


def synchronous_reductions(modules: tuple[nn.Module, ...]) -> int:
    """Sets ``async_reduce=False`` on the distributed weights of ``modules`` ([Note: the graphed step]);
    returns how many were switched. Call it before graphing, which refuses a weight with a step open."""
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


def graph_blocks(model: MoEGPT, rows: int, *, recipe: Recipe | None = None) -> dict[str, Any]:
    """Graphs every block of ``model`` for microbatches of ``rows`` sequences of ``config.seq_len`` tokens;
    returns what was captured, for ``report.json``. [Note: the graphed step]"""
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
                                     fp8_enabled=recipe is not None, fp8_recipe=recipe)
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    pool = torch.cuda.memory_allocated(device) - allocated - _new_main_grad_bytes(params, had)
    del samples
    return {"graphed": [f"blocks.{i}" for i in range(len(blocks))], "eager": list(EAGER_PARTS),
            "sample_shape": list(shape), "dtype": str(dtype).removeprefix("torch."),
            "num_warmup_iters": NUM_WARMUP_ITERS, "recipe": None if recipe is None else repr(recipe),
            "weights_made_synchronous": switched, "capture_s": seconds, "graph_bytes": pool,
            "comm_bytes": "the blocks' collectives replay inside the graphs, which skip the weights' byte "
                          "counters: bytes_*_per_step count the eager embedding and lm_head only"}


def eager_modules(model: MoEGPT) -> tuple[nn.Module, ...]:
    """The modules of ``model`` outside its graphed blocks (the embedding, whose weight the lm_head ties):
    the ones whose weights' amaxes the eager step syncs ([Note: the graphed step])."""
    return tuple(m for name, m in model.named_children() if name != "blocks")


def release(model: MoEGPT) -> None:
    """Releases the blocks' graphs and their pool (the blocks cannot run afterwards)."""
    model.blocks[0].reset()  # type: ignore[operator]  # installed by make_graphed_callables
