"""Plain parameters at finalize: DDP's average for every trainable parameter that is not a distributed weight.

[Note: plain parameters at finalize]
A plain parameter (trainable, not a distributed weight: a LayerNorm's, a fresh bias, a user's own) is whole
on every rank, so ``finalize_model_grads`` averages it over its data-parallel group, as DDP does, or the
replicas drift apart (Megatron's conventions in full: docs/megatron.md).

1. Group: a fresh bias takes its weight's groups; others ``dp_group`` (a group or ``DeviceMesh``), else
   ``pg_collection.dp_cp``/``.dp``, else the distributed weights' groups if they all agree (if not, raise
   rather than guess). Chunks with no distributed weight are left alone, except under Megatron's finalize
   (the default group, which on one rank still folds, step 3).
2. Which: those with a gradient finalize has not reduced, on any rank (a MAX all-reduce of flags keeps
   collectives matched), so a second finalize is a no-op. The marks are on gradients (``main_grad``'s
   ``_version``, ``.grad``'s identity), never on a weight's data ([Note: weight lifecycle] in ``weights/lifecycle.py``).
3. Fold in fp32: ``.grad`` is added into ``main_grad`` and set to None, unless it is a foreign module's
   placeholder (``grad_added_to_main_grad``, no ``zero_out_wgrad``; distwgrad's are zeros); else ``.grad``.
4. Average with one flat fp32 all-reduce per group (times ``ranks / total tokens`` with ``num_tokens``, as
   the weights), into ``main_grad`` in place, else ``.grad``.

A parameter Megatron marks expert-parallel (``allreduce=False``) raises on a group of more than one rank.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from distwgrad.protocol import is_distributed_weight
from distwgrad.weights import _comm
from distwgrad.weights.base import DistributedParameter

__all__ = ["reduce_plain_params", "plan_plain_params", "plain_groups", "tag_beside"]

_FINAL_MARK = "_distwgrad_plain_final"  # what finalize left on a plain parameter (step 2 of the Note)
_BESIDE = "_distwgrad_beside"  # on a parameter a module made beside a distributed weight: that weight, weakly


def tag_beside(param: torch.Tensor, weight: torch.Tensor) -> None:
    """Marks a fresh ``param`` made beside ``weight`` to reduce with ``weight``'s groups ([Note: plain parameters
    at finalize], step 1); held weakly ([Note: groups held weakly] in ``weights/base.py``)."""
    if isinstance(weight, DistributedParameter):
        setattr(param, _BESIDE, weakref.ref(weight))


def _beside(param: torch.Tensor) -> tuple[Any, ...] | None:
    ref = getattr(param, _BESIDE, None)
    weight = None if ref is None else ref()
    return None if weight is None else weight.reduction_groups()


def _mesh_groups(mesh: DeviceMesh) -> tuple[Any, ...]:
    return tuple(mesh.get_group(d) for d in range(mesh.ndim))


def _domain(w: DistributedParameter) -> frozenset[int]:
    """The global ranks ``w``'s gradient averages over."""
    if w.mesh is not None:
        return frozenset(w.mesh.mesh.flatten().tolist())
    group = w.group
    return frozenset(dist.get_process_group_ranks(group)) if group is not None else frozenset()


def plain_groups(chunks: list[nn.Module], dp_group: Any = None, pg_collection: Any = None, *,
                 default_group: bool = False) -> tuple[Any, ...] | str:
    """The groups an untagged plain parameter averages over (step 1 of the Note), or, when they are ambiguous,
    the reason as a string (raised only if such a parameter needs a reduction)."""
    if isinstance(dp_group, DeviceMesh):
        return _mesh_groups(dp_group)
    if dp_group is not None:
        return (dp_group,)
    for attr in ("dp_cp", "dp"):
        group = getattr(pg_collection, attr, None)
        if group is not None:
            return (group,)
    reps: dict[frozenset[int], DistributedParameter] = {}
    for chunk in chunks:
        for p in chunk.parameters():
            if isinstance(p, DistributedParameter):
                reps.setdefault(_domain(p), p)
    if len(reps) > 1:
        shown = "; ".join(f"{sorted(d)} ({w.label})" for d, w in reps.items())
        return (f"the distributed weights average over different ranks ({shown}); pass "
                f"finalize_model_grads(..., dp_group=...) for the plain parameters")
    if reps:
        return next(iter(reps.values())).reduction_groups()
    return (_comm.resolve_group(None),) if default_group else ()


def _size(groups: Sequence[Any]) -> int:
    return math.prod(_comm.group_size(g) for g in groups)


def _has_new_grad(p: torch.Tensor) -> bool:
    mark = p.__dict__.get(_FINAL_MARK)
    main_grad = getattr(p, "main_grad", None)
    if main_grad is not None:
        return p.grad is not None or mark != ("main", id(main_grad), main_grad._version)
    if p.grad is None:
        return False
    return mark is None or mark[0] != "grad" or mark[1]() is not p.grad or mark[2] != p.grad._version


def _foreign_holders(chunks: list[nn.Module]) -> set[int]:
    """ids of parameters held by a module that may hand autograd a placeholder that is not zeros."""
    from distwgrad.nn._base import WgradModule  # late: distwgrad.nn imports this package

    out: set[int] = set()
    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, WgradModule) or type(m).__module__.startswith("torch.nn"):
                continue
            out.update(id(p) for p in m.parameters(recurse=False))
    return out


def _fold(p: torch.Tensor, foreign: set[int]) -> torch.Tensor:
    """This rank's gradient of ``p`` as a dense fp32 tensor to all-reduce (step 3 of the Note)."""
    main_grad = getattr(p, "main_grad", None)
    grad = p.grad
    if main_grad is not None:
        if tuple(main_grad.shape) != tuple(p.shape):
            raise ValueError(f"main_grad of shape {tuple(main_grad.shape)} for a parameter of shape "
                             f"{tuple(p.shape)}")
        placeholder = (getattr(p, "grad_added_to_main_grad", False) and not getattr(p, "zero_out_wgrad", False)
                       and id(p) in foreign)
        if grad is not None and not placeholder:
            main_grad.add_(grad)
        p.grad = None
        return main_grad.float()
    if grad is None:
        return torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    return grad.float()


def _write_back(p: torch.Tensor, value: torch.Tensor) -> None:
    main_grad = getattr(p, "main_grad", None)
    if main_grad is not None:
        main_grad.copy_(value)
    elif p.grad is not None and p.grad.shape == p.shape:
        p.grad.copy_(value)  # in place: a caller holding .grad sees the average
    else:
        p.grad = value.to(p.dtype).clone(memory_format=torch.contiguous_format)


def _mark(p: torch.Tensor) -> None:
    main_grad = getattr(p, "main_grad", None)
    if main_grad is not None:
        setattr(p, _FINAL_MARK, ("main", id(main_grad), main_grad._version))
    else:
        setattr(p, _FINAL_MARK, ("grad", weakref.ref(p.grad), p.grad._version))


def _token_scale(num_tokens: Any, groups: Sequence[Any], device: torch.device) -> float | None:
    """The weights' factor (``wgrad/finalize.py``): ranks / tokens summed over the groups."""
    if num_tokens is None:
        return None
    total = torch.as_tensor(num_tokens, dtype=torch.float64).reshape(1).clone().to(device)
    for group in groups:
        _comm.all_reduce_sum(total, group)
    tokens = float(total.item())
    if tokens <= 0:
        raise ValueError(f"num_tokens summed over the group is {tokens}; it must be positive")
    return _size(groups) / tokens


Plan = list  # of (groups, [(name, param)]): which plain parameters average over which groups


def plan_plain_params(chunks: list[nn.Module], *, dp_group: Any = None, pg_collection: Any = None,
                      megatron: bool = False) -> Plan:
    """The plain trainable parameters of ``chunks`` by the groups they average over (step 1 of the Note).
    Raises ``ValueError`` for an ambiguous group, from the model alone: every rank alike, before any reduction."""
    named: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for i, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters(remove_duplicate=False):
            if id(p) not in seen and p.requires_grad and not is_distributed_weight(p):
                seen.add(id(p))
                named.append((f"{i}.{name}" if len(chunks) > 1 else name, p))
    if not named:
        return []
    default = plain_groups(chunks, dp_group, pg_collection, default_group=megatron)
    by_groups: dict[tuple[int, ...], tuple[tuple[Any, ...], list[tuple[str, torch.Tensor]]]] = {}
    for name, param in named:
        groups = _beside(param) or default
        if isinstance(groups, str):
            untagged = [n for n, q in named if _beside(q) is None]
            raise ValueError(f"finalize_model_grads: plain parameters {untagged}: {groups}")
        by_groups.setdefault(tuple(id(g) for g in groups), (groups, []))[1].append((name, param))
    return list(by_groups.values())


def reduce_plain_params(chunks: list[nn.Module], num_tokens: Any = None, *, dp_group: Any = None,
                        pg_collection: Any = None, megatron: bool = False, plan: Plan | None = None) -> int:
    """Averages every plain parameter's new gradient ([Note: plain parameters at finalize]); returns how many.
    ``megatron``: Megatron's conventions (step 1); ``plan``: :func:`plan_plain_params`'s, made earlier."""
    if plan is None:
        plan = plan_plain_params(chunks, dp_group=dp_group, pg_collection=pg_collection, megatron=megatron)
    if not plan:
        return 0
    foreign = _foreign_holders(chunks)
    return sum(_reduce(groups, members, num_tokens, foreign, megatron) for groups, members in plan)


def _reduce(groups: tuple[Any, ...], members: list[tuple[str, torch.Tensor]], num_tokens: Any,
            foreign: set[int], megatron: bool) -> int:
    size = _size(groups)
    if not groups or (size == 1 and num_tokens is None and not megatron):
        return 0
    if size > 1:
        expert = [name for name, p in members if getattr(p, "allreduce", True) is False]
        if expert:
            raise ValueError(f"finalize_model_grads: plain parameters {expert} are marked allreduce=False "
                             f"(expert-parallel); averaging them over the data-parallel group of {size} ranks "
                             f"would be wrong: make them distwgrad weights with their own group")
    params = [p for _, p in members]
    fresh = [_has_new_grad(p) for p in params]
    if size > 1:
        flags = torch.tensor(fresh, dtype=torch.int32, device=params[0].device)
        for group in groups:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        fresh = [bool(f) for f in flags.tolist()]
    todo = [p for p, f in zip(params, fresh) if f]
    if not todo:
        return 0
    scale = _token_scale(num_tokens, groups, todo[0].device)
    work = [_fold(p, foreign) for p in todo]
    flat = torch.cat([w.reshape(-1) for w in work]) if len(work) > 1 else work[0].reshape(-1).clone()
    for group in groups:
        _comm.all_reduce_sum(flat, group)
    if size > 1:
        flat.div_(size)
    if scale is not None:
        flat.mul_(scale)
    for p, part in zip(todo, flat.split([w.numel() for w in work])):
        _write_back(p, part.view(p.shape))
    for p in todo:  # after every write: main_grad views of one buffer share a version counter
        _mark(p)
    return len(todo)
