"""What the job measures beyond the loss: validation loss, gradient norm, TensorBoard scalars (docs/training.md).

Validation (``--eval-every``) runs in eval mode under ``no_grad`` (graphed blocks run eagerly there) on fixed
held-out batches, each rank its rows. The gradient norm reads every gradient, so it runs at logged steps only.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["evaluate", "eval_rows", "grad_norm", "Board", "peak_memory_gib"]


def eval_rows(val: Any, global_batch: int, world_size: int) -> int:
    """Validation windows per batch: the global batch, or as many as a small ``val.bin`` holds (a multiple of
    the ranks); ``DataError`` if it holds fewer windows than ranks."""
    from distwgrad.data import DataError

    rows = min(global_batch, val.capacity()) // world_size * world_size
    if rows < world_size:
        raise DataError(f"--eval-every: the validation tokens hold {val.capacity()} windows of seq_len + 1, fewer "
                        f"than the {world_size} ranks (prepare more text, or a larger --val-fraction)")
    return rows


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: Any, batches: int, global_batch: int, rank: int, world_size: int,
             group: Any, device: torch.device, autocast: Any) -> float:
    """Mean next-token loss over ``batches`` validation batches of :func:`eval_rows` windows, over all ranks."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # summed token losses, tokens
    size = eval_rows(val, global_batch, world_size)
    rows = size // world_size
    try:
        for i in range(batches):
            tokens = val.eval_batch(i, size)[rank * rows:(rank + 1) * rows].to(device)
            with autocast():
                loss = model.loss(tokens[:, :-1], tokens[:, 1:])
            n = tokens[:, 1:].numel()
            total += torch.stack([loss.double() * n, torch.tensor(float(n), dtype=torch.float64, device=device)])
    finally:
        model.train(was_training)
    dist.all_reduce(total, group=group)
    return float(total[0] / total[1])


@torch.no_grad()
def grad_norm(model: torch.nn.Module, group: Any, *, skip: Any = (), copies: int | None = None) -> float:
    """Global L2 norm of each distinct ``.grad`` over ``group``: shards summed, the rest (on ``copies`` ranks,
    default all) counted once. ``skip``: parameters another rank counts (a weight tied across pipeline stages)."""
    from distwgrad import ShardedWeight

    sharded, replicated = [], []
    skipped = {id(p) for p in skip if p is not None}
    for p in {id(p): p for p in model.parameters()}.values():
        if p.grad is not None and id(p) not in skipped:
            (sharded if isinstance(p, ShardedWeight) else replicated).append(p.grad.float())
    device = next(model.parameters()).device
    squares = torch.zeros(2, dtype=torch.float64, device=device)
    for i, grads in enumerate((sharded, replicated)):
        if grads:
            squares[i] = torch.stack(torch._foreach_norm(grads)).double().square().sum()
    dist.all_reduce(squares, group=group)
    return math.sqrt(float(squares[0]) + float(squares[1]) / (copies or dist.get_world_size(group)))


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak memory so far: CUDA's allocator on a GPU, the resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


class Board:
    """TensorBoard scalars on rank 0, or nothing (``path`` None, or another rank)."""

    def __init__(self, path: str | None, rank: int) -> None:
        self._writer = None
        if path and rank == 0:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:  # tensorboard is an optional extra
                raise ValueError(f"--tensorboard {path!r} needs TensorBoard: pip install 'distwgrad[tensorboard]' "
                                 f"(or pip install tensorboard)") from exc
            self._writer = SummaryWriter(path)

    def scalars(self, step: int, values: dict[str, float | None]) -> None:
        if self._writer is None:
            return
        for tag, value in values.items():
            if value is not None and math.isfinite(value):
                self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
