"""``finalize_model_grads``: the one call that ends a step.

It refuses to finish while any contribution is missing (a deferred wgrad never drained, a forward whose
backward never ran), then has every distributed weight reduce what is left, scale by the token count, and
write ``.grad`` (see [Note: contribution accounting] in ``weights/base.py``). Each weight is visited once
however many modules share it, and learns its path(s) in the model, so every later accounting error,
from here or from inside backward, names it (``blocks.0.attn.qkv.weight``). ``discard=True`` abandons a
broken step instead, so the next one starts clean.
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
    """Tells every distwgrad weight its path(s) in ``model_chunks`` (all of a tied weight's), for error
    messages; returns :func:`distributed_parameters`. ``finalize_model_grads`` calls it each step; call it
    once after building the model so errors raised in the first step's backward name weights too."""
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
    """Megatron's per-token loss scaling, per weight: grads become sum over ranks / total tokens.

    Weights reduce to the *average* over their own data-parallel ranks (the group, times the replicas on
    a 2-D mesh: [Note: device meshes] in ``weights/sharded.py``), so each weight's factor is that rank
    count over their total token count (this rank's ``num_tokens`` summed over the group, then across
    replicas: float64 sums of counts, exact in any order). One all-reduce per distinct group, in the
    order the groups first appear (the same on every rank).
    """
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
    gradients over their data-parallel group; returns how many distwgrad weights were finalized.

    Args:
        model_chunks: a model or a list of model chunks (Megatron's convention).
        num_tokens: if given, this rank's token count; gradients are scaled so the result is the sum
            of per-token gradients over the group divided by the group's total token count.
        pg_collection: Megatron's process groups; its ``dp_cp`` (else ``dp``) group averages the plain
            parameters. ``force_all_reduce``: accepted for Megatron signature compatibility; weights carry
            their own groups and always reduce in fp32.
        discard: abandon the step instead (after an error, say): drop every queued deferred wgrad and
            have each weight discard its step (``DistributedParameter.discard_step``); ``.grad`` is left
            as it was and 0 is returned. Every rank must discard together (in-flight reductions are
            waited for).
        reduce_plain_params: average every trainable parameter that is not a distributed weight (a
            LayerNorm's, a bias a module made) over its data-parallel group, as DDP does, so replicas never
            drift ([Note: plain parameters at finalize] in ``wgrad/plain.py``). Pass False only when
            something else reduces them (Megatron's DDP).
        dp_group: the process group or ``DeviceMesh`` plain parameters average over; default: the group
            of a fresh bias's weight, else ``pg_collection``'s, else the distributed weights' (when they
            agree), else the default group.

    Raises:
        MissingContributionError: naming every module with undrained deferred wgrads, or every weight
            (by its path in the model) whose expected contributions did not all arrive, with the likely
            causes and the fix. Nothing is reduced in that case and the step stays open.

    Calling it twice with no new contributions is a no-op (each weight's step is already closed, each plain
    gradient already averaged).
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
