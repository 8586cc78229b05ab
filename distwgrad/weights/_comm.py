"""Collectives the weights use, with one spelling across the torch versions we support (>= 2.11).

Every helper takes the group explicitly; ``group=None`` with no initialised process group is a group of one.

[Note: process groups at exit]
A gloo group alive at interpreter teardown can abort the process after its last line (exit -6). So weights hold
groups weakly ([Note: groups held weakly] in ``weights/base.py``), and ``torch.distributed._shard``, which keeps
the default group alive if first imported after ``init_process_group`` (dynamo imports it), is imported here;
a script importing distwgrad after ``init_process_group`` should import it first.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._shard  # noqa: F401  (before any group exists: [Note: process groups at exit])
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["resolve_group", "resolve_groups", "group_rank", "group_size", "all_gather_into", "reduce_scatter_sum",
           "all_reduce_sum", "all_gather_objects"]

# torch 2.13 renamed the tensor-in/tensor-out collectives; 2.11 only has the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def resolve_group(group: Any) -> Any:
    """``None`` means the default group; with no initialised default group, a group of one."""
    if group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return group


def resolve_groups(group: Any, mesh: Any, device_type: str, who: str) -> tuple[Any, Any]:
    """``(shard group, replicate group or None)`` from ``group`` or ``mesh``; a 2-D mesh is ``(replicate, shard)``
    (FSDP2's HSDP; [Note: device meshes] in ``weights/sharded.py``). ``who`` names the caller in errors."""
    if mesh is None:
        return resolve_group(group), None
    if group is not None:
        raise ValueError(f"{who}: pass group or mesh, not both (got group={group!r} and mesh={mesh!r})")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{who}: mesh must be a torch.distributed.DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"{who}: mesh must be 1-D (shard) or 2-D (replicate, shard), got a {mesh.ndim}-D mesh "
                         f"of shape {tuple(mesh.shape)} (names {mesh.mesh_dim_names})")
    if mesh.device_type != device_type:
        raise ValueError(f"{who}: mesh.device_type={mesh.device_type!r} but the tensor is on {device_type!r}")
    if mesh.get_coordinate() is None:
        raise ValueError(f"{who}: rank {dist.get_rank()} is not in mesh {mesh.mesh.tolist()}")
    if mesh.ndim == 1:
        return mesh.get_group(), None
    return mesh.get_group(1), mesh.get_group(0)


def group_size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Any) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """``out`` gets every rank's ``inp`` in rank order; ``async_op`` returns a handle (keep both tensors alive)."""
    return _all_gather_single(out, inp, group=group, async_op=async_op)


def reduce_scatter_sum(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """``out`` gets this rank's row block of the sum of every rank's ``inp``; ``async_op`` as in ``all_gather_into``."""
    return _reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce_sum(t: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    if group is not None:
        return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return None


def all_gather_objects(obj: Any, group: Any) -> list[Any]:
    if group is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def all_reduce_max(t: torch.Tensor, group: Any) -> None:
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)


__all__ += ["all_reduce_max"]
