"""Plain parameters at finalize: DDP's average for every trainable parameter that is not a distributed weight.

[Note: plain parameters at finalize]
A plain parameter is a parameter of the model chunks with ``requires_grad`` that is not a distributed weight
(``is_distributed_weight`` false; TransformerEngine-style protocol weights reduce themselves and are left
alone): a LayerNorm's weight, a bias a module made next to a distributed weight, a user's own parameter.
Every rank holds it whole, so without a reduction each rank would step on its own gradient and the replicas
would drift apart. ``finalize_model_grads`` therefore averages them over their data-parallel group, as DDP
does, unless the caller reduces them itself (``reduce_plain_params=False``: Megatron's DDP).

1. The group. A parameter a distwgrad module made beside a distributed weight (a fresh bias) reduces with
   that weight's groups. Any other uses ``dp_group`` if given (a process group or a ``DeviceMesh``, all of
   whose ranks are data-parallel), else ``pg_collection.dp_cp`` or ``.dp`` (Megatron's), else the groups of
   the chunks' distributed weights when they all average over the same ranks. With weights averaging over
   different ranks (an expert-parallel model, say) and no ``dp_group``, finalize raises rather than guess;
   chunks with no distributed weight at all are left alone (plain torch: DDP's business), except under
   Megatron's finalize, which takes the default group. A group of one rank with no ``num_tokens`` leaves
   plain gradients untouched (Megatron's finalize still folds ``.grad`` into ``main_grad``, step 3).
2. Which ones: a parameter takes part when it has a gradient that finalize has not reduced yet, on any
   rank of the group (one MAX all-reduce of a flag per parameter keeps the collectives matched; a rank
   with no gradient contributes zeros). "Not reduced yet": ``main_grad`` changed (its ``_version``)
   since the last finalize, or ``.grad`` is set (with ``main_grad``), or ``.grad`` is not the tensor
   finalize wrote (without). A second finalize with no new gradient is a no-op, as for the weights. (These
   marks are on gradients, which autograd and the runtime only ever change in place or replace, never on a
   weight's data: [Note: weight lifecycle] in ``weights/lifecycle.py``.)
3. Fold, in fp32. With ``main_grad`` (Megatron's convention): ``.grad`` is added into ``main_grad`` unless
   ``grad_added_to_main_grad`` says it is a placeholder, then ``.grad`` is set to None (Megatron's DDP
   does exactly this in its backward hook). It is a placeholder only when ``grad_added_to_main_grad``
   is true, ``zero_out_wgrad`` is false, and some module holding the parameter is neither a distwgrad
   module nor a ``torch.nn`` module (a foreign fused-accumulation layer, e.g. Megatron's own
   ``ColumnParallelLinear``, may return uninitialised memory there). distwgrad's modules always return
   zeros as the placeholder, so a tied parameter with one fused and one unfused distwgrad user keeps
   both contributions without ``zero_out_wgrad``. Without ``main_grad``: ``.grad`` (None: zeros) in fp32.
4. One flat fp32 all-reduce SUM per group (every parameter of the group side by side), divide by the
   group's ranks: the average, as DDP does, and as the weights do.
5. With ``num_tokens``: multiply by ``ranks / (num_tokens summed over the group)``, the weights' factor, so
   the result is ``sum over ranks / total tokens`` (Megatron's per-token loss).
6. Write: into ``main_grad`` in place (never replaced; ``.grad`` stays None: Megatron's optimizer reads
   ``main_grad``), else ``.grad`` (the parameter's dtype).

A parameter Megatron marks expert-parallel (``allreduce=False``) must not be averaged over the
data-parallel group: finalize raises for it when the group has more than one rank (make it a distwgrad
weight with its expert-data-parallel group).
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
    """Marks a plain ``param`` a module made next to ``weight`` (a fresh bias): at finalize it reduces with
    ``weight``'s groups ([Note: plain parameters at finalize], step 1). The weight is held weakly, as it holds
    its groups ([Note: groups held weakly] in ``weights/base.py``)."""
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
    """The groups an untagged plain parameter averages over, in order (step 1 of the Note): none (left as they
    are) for chunks without a distributed weight unless ``default_group``; or, when the distributed weights
    disagree and nothing was given, the reason as a string (raised only if such a parameter needs a
    reduction)."""
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
    Raises ``ValueError`` naming them when their group is ambiguous: decided from the model alone, so every
    rank decides alike, before anything is reduced."""
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
    """Averages every plain trainable parameter's new gradient over its data-parallel group ([Note: plain
    parameters at finalize]); returns how many were reduced. ``megatron``: Megatron's conventions, chunks
    without a distributed weight average over the default group instead of being left alone, and a group of
    one still folds ``.grad`` into ``main_grad``. ``plan``: :func:`plan_plain_params`'s, made earlier."""
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
