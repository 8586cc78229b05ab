"""Collectives the weights use, with one spelling across the torch versions we support (>= 2.11).

Every helper takes the group explicitly (no module-level group globals) and treats ``group=None`` with
no initialised process group as a group of one, so single-process code needs no ``init_process_group``.

[Note: process groups at exit]
A gloo process group that is still alive when the interpreter tears down (a reference kept past
``destroy_process_group()``) is destroyed there, and that intermittently aborts the process after its last
line ran ("terminate called without an active exception", exit -6; seen in a quarter of 2-rank runs on
torch 2.13). Two things kept groups alive in ordinary distwgrad scripts: the weights themselves, which
now refer to their groups weakly ([Note: groups held weakly] in ``weights/base.py``), and torch itself:
``torch.distributed._shard``, imported on first use by dynamo (the first optimizer step imports dynamo),
keeps the default group alive when it is first imported after ``init_process_group``. Importing it here,
with distwgrad, before any group exists, avoids that (11 ms); a script that imports distwgrad after
``init_process_group`` should import ``torch.distributed._shard`` before it.
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
    """``(shard group, replicate group or None)`` from ``group`` or ``mesh`` ([Note: device meshes] in
    ``weights/sharded.py``): a 1-D mesh is its group; a 2-D mesh is ``(replicate, shard)``, FSDP2's HSDP
    convention (dim 0 replicates, dim 1 shards). ``who`` names the caller in the errors."""
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
    """``out`` (``size * len(inp)`` rows) receives every rank's ``inp`` in rank order; with ``async_op``
    returns the work handle to ``wait()`` on (``inp`` and ``out`` must stay alive until then)."""
    return _all_gather_single(out, inp, group=group, async_op=async_op)


def reduce_scatter_sum(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """``out`` receives this rank's row block of the element-wise sum of every rank's ``inp``.

    With ``async_op`` returns the work handle to ``wait()`` on (``inp`` and ``out`` must stay alive).
    """
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
