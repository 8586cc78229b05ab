"""``ShardedWeight``: a parameter that holds this rank's dim-0 shard of a full weight.

Forward and backward all-gather a transient full weight; the fp32 ``grad_buffer()`` is reduce-scattered into
the shard's ``main_grad``. Shards follow ``torch.chunk`` (DTensor's ``Shard(0)``, so DCP reshards them): 10
rows on 3 ranks are 4, 4, 2. Collectives pad every shard to the longest; padding is never read back.

[Note: device meshes]
``group=`` or ``mesh=`` (not both), with FSDP2's conventions: a 1-D mesh is exactly its group; a 2-D mesh is
HSDP's (replicate, shard), dims read by position (``docs/protocol.md``). ``group`` is the shard dim's group,
where every gather stays, and ``replicate_group`` the replicate dim's.
* Reduction: fp32 reduce-scatter over ``group``, fp32 all-reduce across replicas, divided by ``dp_size``
  (R * S): the average over every data-parallel rank. S = 1 skips only the reduce-scatter (no in-place
  path: [Note: a group of one] needs ``dp_size == 1``).
* Async: only the reduce-scatter is launched early. The all-reduce needs its result, so it is issued when the
  reduction lands, at points every rank reaches in the same order; issued when one rank's reduce-scatter
  happened to finish early, it could deadlock against a shard-group collective of another rank.
* ``ReplicatedWeight`` on a 2-D mesh all-reduces over the flattened mesh. Checkpoints save ``[Replicate(),
  Shard(0)]`` DTensors ([Note: checkpoint layout] in ``checkpoint.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from distwgrad.weights import _comm
from distwgrad.weights._accounting import Launched
from distwgrad.weights.base import DistributedParameter, ReducePolicy, _check_param_dtype

__all__ = ["ShardedWeight", "shard_rows"]


def shard_rows(rows: int, size: int) -> list[int]:
    """Rows held by each of ``size`` ranks for a dim-0 extent of ``rows`` (``torch.chunk`` layout)."""
    if rows < 0 or size <= 0:
        raise ValueError(f"shard_rows needs rows >= 0 and size > 0, got rows={rows}, size={size}")
    chunk = -(-rows // size)
    return [max(0, min(rows, (r + 1) * chunk) - r * chunk) for r in range(size)]


class ShardedWeight(DistributedParameter):
    """This rank's dim-0 shard of a weight; build it with :meth:`from_full` or :meth:`from_shard`."""

    @classmethod
    def from_full(cls, tensor: torch.Tensor, *, group: Any = None, mesh: DeviceMesh | None = None,
                  reduce_policy: ReducePolicy = ReducePolicy.PER_MICROBATCH,
                  requires_grad: bool = True, async_reduce: bool = False,
                  param_dtype: torch.dtype | None = None) -> ShardedWeight:
        """Shards ``tensor``, which must be identical on every rank of ``group`` (None: the default group).

        ``mesh``: instead of ``group``, a 1-D or 2-D (replicate, shard) ``DeviceMesh`` ([Note: device meshes]).
        ``async_reduce``: overlap each reduce-scatter with the rest of backward. ``param_dtype`` (e.g. bf16):
        the dtype modules compute in; the shard stays the master ([Note: mixed precision]). Raises
        ``ValueError`` on every rank when the ranks disagree on shape, dtype or ``param_dtype``."""
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            raise ValueError(f"ShardedWeight.from_full needs a tensor with at least one dimension, got "
                             f"{tensor!r}")
        group, replicas = _comm.resolve_groups(group, mesh, tensor.device.type, "ShardedWeight.from_full")
        _check_param_dtype(param_dtype, tensor.dtype)
        mine = (tuple(tensor.shape), str(tensor.dtype), str(param_dtype))
        for g in (group, replicas):
            meta = _comm.all_gather_objects(mine, g)
            if any(m != meta[0] for m in meta):
                raise ValueError(f"ShardedWeight.from_full: ranks disagree on the full tensor: "
                                 f"{dict(enumerate(meta))} (shape, dtype, param_dtype) by rank of "
                                 f"{'the replicas' if g is replicas else 'the group'}")
        rows = shard_rows(tensor.shape[0], _comm.group_size(group))
        rank = _comm.group_rank(group)
        start = sum(rows[:rank])
        shard = tensor.detach()[start:start + rows[rank]].clone()
        return cls._build(shard, group, rows, reduce_policy, requires_grad, async_reduce, param_dtype, replicas,
                          mesh)

    @classmethod
    def from_shard(cls, shard: torch.Tensor, *, group: Any = None, mesh: DeviceMesh | None = None,
                   reduce_policy: ReducePolicy = ReducePolicy.PER_MICROBATCH,
                   requires_grad: bool = True, async_reduce: bool = False,
                   param_dtype: torch.dtype | None = None) -> ShardedWeight:
        """Wraps this rank's rows (arguments as :meth:`from_full`); ``ValueError`` unless ranks and replicas
        agree on trailing dims and dtypes and the rows follow :func:`shard_rows`."""
        group, replicas = _comm.resolve_groups(group, mesh, shard.device.type, "ShardedWeight.from_shard")
        _check_param_dtype(param_dtype, shard.dtype)
        replica_meta = _comm.all_gather_objects((tuple(shard.shape), str(shard.dtype), str(param_dtype)), replicas)
        if any(m != replica_meta[0] for m in replica_meta):
            raise ValueError(f"ShardedWeight.from_shard: replicas disagree on the shard: "
                             f"{dict(enumerate(replica_meta))} (shape, dtype, param_dtype) by replica")
        meta = _comm.all_gather_objects((tuple(shard.shape), str(shard.dtype), str(param_dtype)), group)
        if any(m[0][1:] != meta[0][0][1:] or m[1:] != meta[0][1:] for m in meta):
            raise ValueError(f"ShardedWeight.from_shard: ranks disagree on trailing dims, dtype or param_dtype: "
                             f"{dict(enumerate(meta))} (shape, dtype, param_dtype) by rank")
        rows = [m[0][0] for m in meta]
        if rows != shard_rows(sum(rows), len(rows)):
            raise ValueError(f"ShardedWeight.from_shard: rows per rank {rows} do not follow the torch.chunk "
                             f"layout {shard_rows(sum(rows), len(rows))} for {sum(rows)} rows")
        return cls._build(shard.detach(), group, rows, reduce_policy, requires_grad, async_reduce, param_dtype,
                          replicas, mesh)

    @classmethod
    def _build(cls, shard: torch.Tensor, group: Any, rows: list[int], reduce_policy: ReducePolicy,
               requires_grad: bool, async_reduce: bool, param_dtype: torch.dtype | None,
               replicate_group: Any = None, mesh: DeviceMesh | None = None) -> ShardedWeight:
        self = cls(shard, requires_grad)
        full_shape = torch.Size([sum(rows), *shard.shape[1:]])
        self._init_state(group, reduce_policy, full_shape, async_reduce, param_dtype, replicate_group, mesh)
        self.shard_rows = rows
        self.shard_offset = sum(rows[: _comm.group_rank(group)])
        self.amax_allreduces = 0  # FP8 recipes' MAX all-reduces of this weight (all_reduce_max)
        return self

    @property
    def _padded_rows(self) -> int:
        return max(self.shard_rows)

    def _padded(self, t: torch.Tensor) -> torch.Tensor:
        pad = self._padded_rows - t.shape[0]
        if pad == 0:
            return t.contiguous()
        return torch.cat([t, t.new_zeros(pad, *t.shape[1:])])

    def _gather(self) -> torch.Tensor:
        """Cast, pad, all-gather: the gather moves compute-dtype bytes ([Note: mixed precision])."""
        return self.gather_rows(self._local_for_gather())

    def gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        """All-gathers a tensor with the shard's rows (any trailing shape, dtype) in rank order; alone: ``local``."""
        if local.dim() == 0 or local.shape[0] != self.shape[0]:
            raise ValueError(f"{self._name()}.gather_rows: local has shape {tuple(local.shape)}; it must have "
                             f"the shard's {self.shape[0]} rows")
        size = _comm.group_size(self.group)
        if size == 1:
            return local
        padded = self._padded(local)
        out = padded.new_empty(size * padded.shape[0], *padded.shape[1:])
        _comm.all_gather_into(out, padded, self.group)
        self.bytes_gathered += out.numel() * out.element_size()
        if len(set(self.shard_rows)) == 1:
            return out
        blocks = out.split(self._padded_rows)
        return torch.cat([b[:r] for b, r in zip(blocks, self.shard_rows)])

    def all_reduce_max(self, t: torch.Tensor, *, count: bool = True) -> torch.Tensor:
        """``t``, MAX-reduced in place over the shard group; ``count``: add one to ``amax_allreduces``."""
        if _comm.group_size(self.group) > 1:
            _comm.all_reduce_max(t, self.group)
            self.amax_allreduces += count
        return t

    def _reduce(self, buffer: torch.Tensor, async_op: bool = False) -> Callable[[], torch.Tensor]:
        """Reduce-scatter over the group, then all-reduce across replicas: [Note: device meshes]."""
        size, total = _comm.group_size(self.group), self.dp_size
        if total == 1:
            return Launched(None, lambda: buffer)
        if size == 1:  # the buffer is the shard: only the all-reduce across replicas ([Note: a group of one])
            work = _comm.all_reduce_sum(buffer, self.replicate_group, async_op=async_op)
            self.bytes_reduced += buffer.numel() * buffer.element_size()
            return Launched(work, lambda: buffer.div_(total))
        if len(set(self.shard_rows)) == 1:
            padded = buffer
        else:
            parts = buffer.split(self.shard_rows)
            padded = torch.cat([self._padded(p) for p in parts])
        padded = padded.contiguous()
        out = buffer.new_empty(self._padded_rows, *buffer.shape[1:])
        work = _comm.reduce_scatter_sum(out, padded, self.group, async_op=async_op)
        self.bytes_reduced += padded.numel() * padded.element_size()
        rows = self.shape[0]
        if self.replicate_group is None:
            # Only the collective's input and the 1/N output stay alive; the input goes at the wait.
            return Launched(work, lambda: out[:rows].div_(size), keep=padded)
        self.bytes_reduced += out.numel() * out.element_size()  # the all-reduce moves the (padded) shard

        def across_replicas() -> torch.Tensor:  # runs after the reduce-scatter landed
            _comm.all_reduce_sum(out, self.replicate_group)
            return out[:rows].div_(total)
        return Launched(work, across_replicas, keep=padded, collective_at_wait=True)
