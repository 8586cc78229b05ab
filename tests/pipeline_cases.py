"""A small language model cut into pipeline stages, and its single-process oracle, for the pipeline tests.

Every block defers its wgrads, one block kind per distwgrad module with deferral (``LayerNormLinear`` and a
``Linear`` with a fresh bias, ``LayerNormMLP``, ``GroupedLinear``); the first stage embeds (``Embedding``,
its gradient in B) and the last stage ends in a ``LayerNorm`` and an lm_head whose weight is the
embedding's (a tied weight: one object on one rank, two copies tied across stages otherwise). Weights
are ``ShardedWeight``s over the data-parallel group (or an HSDP mesh) with rows that do not divide evenly
(V = 11, F = 5). Every parameter is drawn from a seed of its global layer index, so any cut of the layers
into stages builds the same model as the oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from distwgrad import ShardedWeight
from distwgrad.nn import Embedding, GroupedLinear, LayerNormLinear, LayerNormMLP, Linear

V, D, FF, T = 11, 8, 5, 3  # vocabulary, width, hidden width, tokens per sequence
KINDS = ("ln_linear", "ln_mlp", "grouped")


def _sharded(t: torch.Tensor, group, dtype: torch.dtype | None = None) -> ShardedWeight:
    """``group``: a process group, or a 2-D (replicate, shard) ``DeviceMesh`` (HSDP)."""
    if isinstance(group, DeviceMesh):
        return ShardedWeight.from_full(t, mesh=group, param_dtype=dtype)
    return ShardedWeight.from_full(t, group=group, param_dtype=dtype)


class Block(nn.Module):
    """``checkpoint``: the block recomputed in backward (non-reentrant activation checkpointing); ``dtype``:
    the weights' ``param_dtype`` (masters fp32) and the norms' dtype."""

    def __init__(self, index: int, group, *, checkpoint: bool = False, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        g = torch.Generator().manual_seed(1000 + index)
        w = lambda *shape: _sharded(torch.randn(*shape, generator=g) * 0.4, group, dtype)  # noqa: E731
        self.kind = KINDS[index % len(KINDS)]
        torch.manual_seed(index)  # fresh biases and norms
        if self.kind == "ln_linear":
            self.fc1 = LayerNormLinear(D, FF, weight=w(FF, D), delay_wgrad_compute=True, params_dtype=dtype)
            self.fc2 = Linear(FF, D, weight=w(D, FF), delay_wgrad_compute=True, params_dtype=dtype)
        elif self.kind == "ln_mlp":
            self.mlp = LayerNormMLP(D, FF, delay_wgrad_compute=True, params_dtype=dtype)
            self.mlp.fc1_weight = w(FF, D)
            self.mlp.fc2_weight = w(D, FF)
        else:
            self.norm = nn.LayerNorm(D, dtype=dtype)
            self.experts = GroupedLinear(2, D, D, bias=False, delay_wgrad_compute=True, params_dtype=dtype)
            for e in range(2):
                setattr(self.experts, f"weight{e}", w(D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint:
            return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "ln_linear":
            return x + self.fc2(F.gelu(self.fc1(x)))
        if self.kind == "ln_mlp":
            return x + self.mlp(x)
        flat = self.norm(x).reshape(-1, D)
        half = flat.shape[0] // 2
        return x + self.experts(flat, [half, flat.shape[0] - half]).reshape(x.shape)


def tied_weight(group, dtype: torch.dtype | None = None) -> ShardedWeight:
    return _sharded(torch.randn(V, D, generator=torch.Generator().manual_seed(7)) * 0.5, group, dtype)


class Stage(nn.Module):
    """Blocks ``layers`` of the model, with the embedding on the first stage and the head on the last."""

    def __init__(self, layers, group, *, first: bool, last: bool, tied: ShardedWeight | None = None,
                 untied: bool = False, checkpoint: bool = False, dtype: torch.dtype | None = None) -> None:
        """``untied``: the embedding and the head get a copy each (the oracle of copies tied across stages,
        whose gradients the caller sums). ``checkpoint``, ``dtype``: every block's (:class:`Block`)."""
        super().__init__()
        self.blocks = nn.ModuleDict({str(i): Block(i, group, checkpoint=checkpoint, dtype=dtype) for i in layers})
        tied = tied if tied is not None else (tied_weight(group, dtype) if first or last else None)
        self.embed = Embedding(V, D, weight=tied, params_dtype=dtype) if first else None
        if last:
            torch.manual_seed(99)
            self.norm = nn.LayerNorm(D, dtype=dtype)
            head = tied_weight(group, dtype) if untied else tied
            self.head = Linear(D, V, bias=False, weight=head, delay_wgrad_compute=True, params_dtype=dtype)
        else:
            self.norm = self.head = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, V).float(), target.reshape(-1))


def batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n, T), generator=g), torch.randint(0, V, (n, T), generator=g)


def sum_tied_copies(oracle: Stage) -> None:
    """An untied oracle's embedding and head gradients, summed into both copies (in the order the copies
    tied across stages add: each copy's own sum, then the two)."""
    e, h = oracle.embed.weight, oracle.head.weight
    total = e.main_grad + h.main_grad
    e.main_grad.copy_(total)
    h.main_grad.copy_(total)
