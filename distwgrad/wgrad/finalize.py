"""``finalize_model_grads``: the one call that ends a step.

It refuses to finish while any contribution is missing (a deferred wgrad never drained, a forward whose
backward never ran), then has every distributed weight reduce what is left, scale by the token count, and
write ``.grad`` (see [Note: contribution accounting] in ``weights/base.py``). Each weight is visited once
however many modules share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from distwgrad.weights import _comm
from distwgrad.weights.base import DistributedParameter, MissingContributionError
from distwgrad.wgrad.scheduler import undrained

__all__ = ["finalize_model_grads", "distributed_parameters", "MissingContributionError"]


def distributed_parameters(model_chunks: nn.Module | Sequence[nn.Module]) -> list[tuple[str, DistributedParameter]]:
    """``(name, weight)`` for each distinct distwgrad weight (tied weights appear once)."""
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    seen: set[int] = set()
    out = []
    for i, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters(remove_duplicate=False):
            if isinstance(p, DistributedParameter) and id(p) not in seen:
                seen.add(id(p))
                out.append((f"{i}.{name}" if len(chunks) > 1 else name, p))
    return out


def _token_scales(num_tokens: Any, params: list[DistributedParameter]) -> dict[int, float | None]:
    """Megatron's per-token loss scaling, per weight: grads become sum over ranks / total tokens.

    Weights reduce to the *average* over their own group, so each weight's factor is its group's size
    over its group's total token count (this rank's ``num_tokens`` summed over that group). One
    all-reduce per distinct group, in the order the groups first appear (the same on every rank).
    """
    if num_tokens is None:
        return {}
    by_group: dict[int, list[DistributedParameter]] = {}
    for p in params:
        by_group.setdefault(id(p.group), []).append(p)
    scales: dict[int, float | None] = {}
    for members in by_group.values():
        group = members[0].group
        total = torch.as_tensor(num_tokens, dtype=torch.float64).reshape(1).clone().to(members[0].device)
        _comm.all_reduce_sum(total, group)
        tokens = float(total.item())
        if tokens <= 0:
            raise ValueError(f"num_tokens summed over the group is {tokens}; it must be positive")
        for p in members:
            scales[id(p)] = _comm.group_size(group) / tokens
    return scales


def finalize_model_grads(model_chunks: nn.Module | Sequence[nn.Module], num_tokens: Any = None, *,
                         pg_collection: Any = None, force_all_reduce: bool = False) -> int:
    """Ends the step for every distwgrad weight in ``model_chunks``; returns how many were finalized.

    Args:
        model_chunks: a model or a list of model chunks (Megatron's convention).
        num_tokens: if given, this rank's token count; gradients are scaled so the result is the sum
            of per-token gradients over the group divided by the group's total token count.
        pg_collection, force_all_reduce: accepted for Megatron signature compatibility; weights carry
            their own groups and always reduce in fp32.

    Raises:
        MissingContributionError: naming every module with undrained deferred wgrads, or every weight
            whose expected contributions did not all arrive. Nothing is reduced in that case.

    Calling it twice with no new contributions is a no-op (each weight's step is already closed).
    """
    del pg_collection, force_all_reduce
    pending = undrained(model_chunks)
    if pending:
        raise MissingContributionError(
            "finalize_model_grads: deferred wgrads were never drained (call backward_dw() on them or "
            "distwgrad.drain_deferred_wgrads(model)): " + "; ".join(pending))
    params = distributed_parameters(model_chunks)
    missing = [f"{name}: {p.pending_contributions} of {p._expected}" for name, p in params
               if p.pending_contributions]
    if missing:
        raise MissingContributionError(
            "finalize_model_grads: contributions missing (expected uses whose gradient never arrived): "
            + "; ".join(missing))
    scales = _token_scales(num_tokens, [p for _, p in params])
    return sum(bool(p.finish_step(scales.get(id(p)))) for _, p in params)
