"""``ReplicatedWeight``: a full copy on every rank whose gradient is all-reduced (DDP-like).

It goes through the same accounting as ``ShardedWeight`` (``weights/base.py``), so tied uses, microbatches
and deferred wgrads land exactly once before the fp32 all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from distwgrad.weights import _comm
from distwgrad.weights._accounting import Launched
from distwgrad.weights.base import DistributedParameter, ReducePolicy, _check_param_dtype

__all__ = ["ReplicatedWeight"]


class ReplicatedWeight(DistributedParameter):
    """A weight replicated over ``group``; finalize averages its gradient over the group in fp32."""

    @classmethod
    def from_full(cls, tensor: torch.Tensor, *, group: Any = None, mesh: DeviceMesh | None = None,
                  reduce_policy: ReducePolicy = ReducePolicy.PER_MICROBATCH,
                  requires_grad: bool = True, async_reduce: bool = False,
                  param_dtype: torch.dtype | None = None) -> ReplicatedWeight:
        """Wraps a copy of ``tensor``, which must be identical on every rank (shape/dtype checked).

        ``param_dtype``: as in ``ShardedWeight.from_full``: the copy stays in the tensor's dtype (the
        master) and modules compute with a ``param_dtype`` cast of it ([Note: mixed precision]).

        ``mesh`` instead of ``group`` (passing both raises ``ValueError``): a 1-D ``DeviceMesh`` is its
        group; a 2-D (replicate, shard) mesh replicates over ALL of its ranks, so the gradient is one fp32
        all-reduce over the flattened mesh, averaged over its ``R * S`` ranks: the same average as a
        ``ShardedWeight`` on that mesh ([Note: device meshes] in ``weights/sharded.py``).
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"ReplicatedWeight.from_full needs a tensor, got {type(tensor).__name__}")
        group, replicas = _comm.resolve_groups(group, mesh, tensor.device.type, "ReplicatedWeight.from_full")
        if replicas is not None:
            if not mesh.mesh_dim_names:  # DeviceMesh only flattens named dims
                raise ValueError(f"ReplicatedWeight.from_full: a 2-D mesh needs mesh_dim_names to be flattened "
                                 f"into one group, got {mesh!r}; build it with init_device_mesh(..., "
                                 f"mesh_dim_names=('replicate', 'shard'))")
            # One group over every rank of the mesh; DeviceMesh caches it, so all weights share it.
            group = mesh._flatten().get_group()
        _check_param_dtype(param_dtype, tensor.dtype)
        meta = _comm.all_gather_objects((tuple(tensor.shape), str(tensor.dtype), str(param_dtype)), group)
        if any(m != meta[0] for m in meta):
            raise ValueError(f"ReplicatedWeight.from_full: ranks disagree on the tensor: "
                             f"{dict(enumerate(meta))} (shape, dtype, param_dtype) by rank")
        self = cls(tensor.detach().clone(), requires_grad)
        self._init_state(group, reduce_policy, tensor.shape, async_reduce, param_dtype, mesh=mesh)
        return self

    def _gather(self) -> torch.Tensor:
        return self._local_for_gather()

    def _reduce(self, buffer: torch.Tensor, async_op: bool = False) -> Callable[[], torch.Tensor]:
        size = _comm.group_size(self.group)
        if size == 1:
            return Launched(None, lambda: buffer)
        work = _comm.all_reduce_sum(buffer, self.group, async_op=async_op)
        self.bytes_reduced += buffer.numel() * buffer.element_size()
        return Launched(work, lambda: buffer.div_(size))  # in place: the result is the input
