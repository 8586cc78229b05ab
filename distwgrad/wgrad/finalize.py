"""``finalize_model_grads``: the one call that ends a step.

It refuses while any contribution is missing ([Note: contribution accounting] in ``weights/base.py``), then
has every weight reduce, scale by the token count and write ``.grad``. Each weight learns its paths in the
model, so later accounting errors name it (``blocks.0.attn.qkv.weight``).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from distwgrad.weights import _comm
from distwgrad.weights.base import DistributedParameter, MissingContributionError
from distwgrad.weights.lifecycle import MISSING_CAUSES
from distwgrad.wgrad.plain import plan_plain_params
from distwgrad.wgrad.plain import reduce_plain_params as reduce_plain
from distwgrad.wgrad.scheduler import deferred_modules, undrained
from distwgrad.wgrad.store import WeightGradStore

__all__ = ["finalize_model_grads", "distributed_parameters", "name_weights", "MissingContributionError"]


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


def name_weights(model_chunks: nn.Module | Sequence[nn.Module]) -> list[tuple[str, DistributedParameter]]:
    """Tells each distwgrad weight its paths, for errors (call it once after building the model); returns them."""
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    names: dict[int, list[str]] = {}
    for i, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters(remove_duplicate=False):
            if isinstance(p, DistributedParameter):
                names.setdefault(id(p), []).append(f"{i}.{name}" if len(chunks) > 1 else name)
    params = distributed_parameters(chunks)
    for _, p in params:
        p.names = names[id(p)]
    return params


def _label(p: DistributedParameter) -> str:
    return " = ".join(p.names) if p.names else p.label


def _missing(params: list[tuple[str, DistributedParameter]]) -> list[str]:
    """One line per weight whose count is off: uses still owed, or contributions no use accounts for."""
    return [f"{_label(p)}: {p.pending_contributions} of {p.expected_contributions} missing"
            if p.pending_contributions > 0 else
            f"{_label(p)}: {p.expected_contributions - p.pending_contributions} arrived for "
            f"{p.expected_contributions} recorded uses (see the error backward raised)"
            for _, p in params if p.pending_contributions]


def _token_scales(num_tokens: Any, params: list[DistributedParameter]) -> dict[int, float | None]:
    """Megatron's per-token loss scaling, per weight: its ranks over their total tokens (float64: exact), as
    weights average over their ranks ([Note: device meshes] in ``weights/sharded.py``); same order on every rank."""
    if num_tokens is None:
        return {}
    experts = [p for p in params if p.ep_size > 1]
    if experts:
        raise ValueError(f"finalize_model_grads: num_tokens with expert-parallel weights is not supported (their "
                         f"tokens come from ranks outside their own group): {_label(experts[0])} has ep_size "
                         f"{experts[0].ep_size}; average the loss per rank instead")
    by_group: dict[tuple[int, ...], list[DistributedParameter]] = {}
    for p in params:
        by_group.setdefault(tuple(id(g) for g in p.reduction_groups()), []).append(p)
    scales: dict[int, float | None] = {}
    for members in by_group.values():
        total = torch.as_tensor(num_tokens, dtype=torch.float64).reshape(1).clone().to(members[0].device)
        for group in members[0].reduction_groups():
            _comm.all_reduce_sum(total, group)
        tokens = float(total.item())
        if tokens <= 0:
            raise ValueError(f"num_tokens summed over the group is {tokens}; it must be positive")
        for p in members:
            scales[id(p)] = members[0].dp_size / tokens
    return scales


def finalize_model_grads(model_chunks: nn.Module | Sequence[nn.Module], num_tokens: Any = None, *,
                         pg_collection: Any = None, force_all_reduce: bool = False, discard: bool = False,
                         reduce_plain_params: bool = True, dp_group: Any = None) -> int:
    """Ends the step for every distwgrad weight in ``model_chunks`` and averages the plain parameters'
    gradients; returns how many distwgrad weights were finalized. A second call with nothing new is a no-op.

    Args:
        model_chunks: a model or a list of chunks (Megatron's convention).
        num_tokens: this rank's token count: gradients become per-token sums over the group / total tokens.
        pg_collection, force_all_reduce: Megatron's (the former picks the plain parameters' group).
        discard: abandon the step (drop queued wgrads, weights discard theirs, ``.grad`` untouched), on all ranks.
        reduce_plain_params: average non-distributed trainable parameters, as DDP does ([Note: plain
            parameters at finalize] in ``wgrad/plain.py``); False only if something else does (Megatron's DDP).
        dp_group: the process group or ``DeviceMesh`` plain parameters average over (default: step 1 there).

    Raises:
        MissingContributionError: naming undrained modules and weights missing contributions; nothing reduced.
    """
    del force_all_reduce
    if discard:
        for m in deferred_modules(model_chunks):
            store: WeightGradStore = m.wgrad_store  # type: ignore[assignment]  # WgradModule's
            store.clear()
        for _, p in distributed_parameters(model_chunks):
            p.discard_step()
        return 0
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    plain = plan_plain_params(chunks, dp_group=dp_group, pg_collection=pg_collection) if reduce_plain_params else []
    pending = undrained(model_chunks)
    if pending:
        raise MissingContributionError(
            "finalize_model_grads: deferred wgrads were never drained (call backward_dw() on them or "
            "distwgrad.drain_deferred_wgrads(model); to abandon the step instead: "
            "finalize_model_grads(model, discard=True)): " + "; ".join(pending))
    params = name_weights(model_chunks)
    if _missing(params):
        gc.collect()  # a graph held only by a reference cycle withdraws its uses once collected
    missing = _missing(params)
    if missing:
        raise MissingContributionError(
            "finalize_model_grads: gradient contributions missing (uses recorded in forward whose gradient "
            f"never arrived): {'; '.join(missing)}. {MISSING_CAUSES}")
    scales = _token_scales(num_tokens, [p for _, p in params])
    finished = sum(bool(p.finish_step(scales.get(id(p)))) for _, p in params)
    reduce_plain(chunks, num_tokens, plan=plain)
    return finished
