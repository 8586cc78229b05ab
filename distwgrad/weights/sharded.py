"""``ShardedWeight``: a parameter that holds this rank's dim-0 shard of a full weight.

Forward all-gathers a transient full weight, backward re-gathers it, wgrads accumulate into a full fp32
``grad_buffer()`` and the reduction reduce-scatters that buffer, in fp32, into the shard's ``main_grad``
(see [Note: contribution accounting] in ``weights/base.py``). The optimizer steps on shards.

Shards may be uneven and follow ``torch.chunk`` (and so DTensor's ``Shard(0)``): every rank holds
``ceil(rows / size)`` rows until the rows run out (10 rows on 3 ranks: 4, 4, 2; 2 rows on 3 ranks: 1, 1,
0). Using DTensor's layout lets ``torch.distributed.checkpoint`` reshard our weights between world
sizes. Collectives pad every shard to the largest shard's row count, so each rank sends and receives
equal-sized blocks; padding rows are never read back.

[Note: device meshes]
``from_full`` / ``from_shard`` take ``group=`` or ``mesh=`` (a ``torch.distributed.DeviceMesh``; both is a
``ValueError``). FSDP2's conventions: a 1-D mesh shards over its one dim and is exactly its group (the same
collectives, bit-identical); a 2-D mesh is (replicate, shard), HSDP: dim 0 replicates, dim 1 shards
(``init_device_mesh(device, (R, S), mesh_dim_names=("replicate", "shard"))``; the dims are read by
position, the names are the user's). Shard within a node, replicate across nodes.
* Layout: ``group`` is the shard dim's group and ``replicate_group`` the replicate dim's (None without a
  2-D mesh). The shards follow ``group`` (``torch.chunk`` over S ranks); the R replicas of a shard hold
  the same rows and bytes. Every gather (forward, backward, FP8: ``fp8/weights.py`` gathers and takes
  amaxes over ``w.group``) runs within the shard group, so it moves what an S-rank gather moves.
* Reduction: reduce-scatter the fp32 buffer over the shard group (sum), then all-reduce the shard over
  the replicate group (sum), then divide by ``dp_size = R * S``: the average over every data-parallel
  rank, as FSDP2's HSDP averages (and as DDP would over R * S ranks). Both collectives are fp32.
  ``bytes_reduced`` counts both: the reduce-scatter's (padded) input plus the all-reduce's (padded) shard.
* Async: the reduce-scatter is launched without waiting; the all-reduce needs its result, so it is issued
  when the reduction lands, i.e. only at points every rank reaches in the same order (the in-flight bound,
  ``grad_buffer``, ``finish_step``, ``wait_for_reductions``, ``discard_step``), never because the
  reduce-scatter happened to finish early on one rank: an early all-reduce on one rank could wait on a
  replica that is itself waiting in a shard-group collective on a third rank. The values are those of
  the synchronous path, bit for bit. The all-reduce does not overlap compute on gloo; on the GPU a stream
  would order it after the reduce-scatter (FSDP2's way), which is not done here.
* A shard group of one (S = 1, R > 1): the buffer is the shard, there is no reduce-scatter, and the
  all-reduce across replicas still runs (async like any all-reduce); [Note: a group of one]'s in-place
  path is only for ``dp_size == 1``. R = 1 gives the 1-D numbers (an all-reduce over one rank).
* ``ReplicatedWeight`` on a 2-D mesh replicates over every rank of it: one fp32 all-reduce over the
  flattened mesh (``DeviceMesh._flatten``, cached by the mesh: every weight shares the group), the same
  average over R * S ranks as a ``ShardedWeight`` on that mesh; a 1-D mesh is its group.
* Token scaling (``finalize_model_grads(num_tokens=...)``) sums tokens over the group then across
  replicas and scales by ``dp_size / tokens`` (``wgrad/finalize.py``).
* Checkpoints wrap a 2-D mesh's shards as ``DTensor`` ``[Replicate(), Shard(0)]`` on that mesh, so DCP
  reshards between meshes and world sizes ([Note: checkpoint layout] in ``checkpoint.py``).
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
    """This rank's dim-0 shard of a weight, gathered on use and reduce-scattered on finalize.

    Build it with :meth:`from_full` or :meth:`from_shard`; use it as any module's weight (constructor
    argument or assignment), tied across as many modules as you like.
    """

    @classmethod
    def from_full(cls, tensor: torch.Tensor, *, group: Any = None, mesh: DeviceMesh | None = None,
                  reduce_policy: ReducePolicy = ReducePolicy.PER_MICROBATCH,
                  requires_grad: bool = True, async_reduce: bool = False,
                  param_dtype: torch.dtype | None = None) -> ShardedWeight:
        """Shards ``tensor``, which must be identical on every rank of ``group`` (None: default group).

        ``mesh`` instead of ``group``: a 1-D ``DeviceMesh`` (the same as passing its group) or a 2-D one
        whose dims are (replicate, shard), FSDP2's HSDP mesh (``init_device_mesh("cuda", (R, S),
        mesh_dim_names=("replicate", "shard"))``): the tensor is sharded over the shard dim, each replica
        holds the same shards, and the gradient is reduce-scattered over the shard dim then all-reduced
        across replicas, averaged over all ``R * S`` ranks ([Note: device meshes]). Passing both raises
        ``ValueError``.

        ``async_reduce`` launches each reduce-scatter without waiting, to overlap it with the rest of
        backward ([Note: contribution accounting]). ``param_dtype`` (e.g. ``torch.bfloat16``): the shard
        stays in the tensor's dtype (the master copy) and the weight is cast to ``param_dtype`` before
        every all-gather, so modules compute in it ([Note: mixed precision]). Raises ``ValueError`` on
        every rank when the ranks disagree on the shape, dtype or ``param_dtype``.
        """
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
        """Wraps this rank's rows; ranks must agree on trailing dims, dtype and ``param_dtype`` (as in
        :meth:`from_full`) and the rows must follow the ``torch.chunk`` layout of :func:`shard_rows`
        (checked on every rank). ``mesh``: as in :meth:`from_full`; with a 2-D mesh the rows follow the
        shard dim and every replica passes the same shape (checked)."""
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
        """Cast (to ``param_dtype``), pad, all-gather: the gather moves compute-dtype bytes
        ([Note: mixed precision] in ``weights/base.py``)."""
        return self.gather_rows(self._local_for_gather())

    def gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        """All-gathers a tensor laid out like this weight: ``local`` holds this rank's ``shard_rows`` rows
        (any trailing shape and dtype: the cast shard, its FP8 bytes, per-expert scale grids), the result
        every rank's in rank order (padded to the longest shard on the wire). The bytes moved count in
        ``bytes_gathered``. With one rank, ``local`` itself."""
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
        """In place, the element-wise MAX of ``t`` over the shard group (an amax, a block-amax grid: the
        replicas of a 2-D mesh hold the same shards, so the shard group is enough); counted in
        ``amax_allreduces`` unless ``count`` is False (one all-reduce on behalf of many weights).
        Returns ``t``."""
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
