"""The DistributedWeight protocol and its list-shaped dispatchers.

A distributed weight is a ``torch.Tensor`` subclass whose local storage is not the tensor a GEMM needs (a
shard, a replica to reduce, a quantized copy). Modules call its hooks only through the dispatchers, which keep
TransformerEngine's shape (``weights[0]`` leads the group; plain tensors pass through), so weights written
for TE plug into distwgrad's modules and ours into TE's. The contract in full: ``docs/protocol.md``.

[Note: the finalize contract]
``finalize_group_grads(wgrads)`` is called once per *contribution*: after every wgrad GEMM of one use of the
group in one microbatch, in backward or from a deferred ``backward_dw``. It returns ``None`` or, per weight,
a local-shape tensor that is one more contribution to ``.grad``: the main backward hands it to autograd, a
deferred ``backward_dw`` adds it to ``.grad``; never dropped, never used twice. distwgrad's own weights
return ``None`` and fill ``main_grad`` and ``.grad`` themselves when the step's last contribution arrives.

[Note: what backward may hold]
The autograd context holds the weight object, never a gathered copy, as a plain attribute: through
``save_for_backward``, ``saved_tensors_hooks`` (activation offloading) would strip the subclass. Backward
re-materializes through ``materialize_weight_for_backward``.

[Note: one-member groups exchange bare tensors]
As with TE's implementers (Megatron's GTP weights), a one-member group's ``materialize_group_for_*`` may
return a bare tensor, and its ``finalize_group_grads`` receives the bare wgrad and may return a bare tensor
or ``None``; the dispatchers always return lists. This holds on every module path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "DistributedWeight",
    "is_distributed_weight",
    "materialize_weight_for_forward",
    "materialize_weight_for_backward",
    "finalize_weight_grads",
    "grad_buffers",
    "weight_grad_buffers",
    "weight_grad_dtype",
]


@runtime_checkable
class DistributedWeight(Protocol):
    """What a weight must provide to be materialized and finalized by distwgrad's modules."""

    is_distributed_weight: bool

    def materialize_group_for_forward(self) -> Sequence[torch.Tensor]:
        """Full tensors for the forward GEMM of every weight in this weight's group (may all-gather)."""

    def materialize_group_for_backward(self) -> Sequence[torch.Tensor]:
        """Full tensors again for dgrad; the forward copy is never saved, so this re-gathers."""

    def finalize_group_grads(self, wgrads: Sequence[torch.Tensor]) -> Any:
        """Accepts one contribution per weight of the group; see [Note: the finalize contract]."""

    def grad_buffer(self) -> torch.Tensor:
        """Full-size buffer the wgrad GEMM accumulates into (fp32 for distwgrad's weights)."""


def is_distributed_weight(t: object) -> bool:
    """True for tensors that set ``is_distributed_weight``; ``TypeError`` for a claimant that is no tensor."""
    claims = bool(getattr(t, "is_distributed_weight", False))
    if claims and not isinstance(t, torch.Tensor):
        raise TypeError(f"a DistributedWeight must be a torch.Tensor subclass (usually an nn.Parameter); got "
                        f"{type(t).__name__}, which sets is_distributed_weight but is not a tensor")
    return claims


def _as_group(weights: torch.Tensor | Sequence[torch.Tensor | None], what: str) -> tuple[list, bool]:
    """``(weights as a list, whether a bare weight was passed)``: a bare leader's group is what it returns."""
    if isinstance(weights, torch.Tensor):
        return [weights], True
    weights = list(weights)
    if len(weights) == 0:
        raise ValueError(f"{what} got an empty list of weights")
    return weights, False


def _check_group(weights: Sequence[torch.Tensor | None], what: str) -> bool:
    lead = is_distributed_weight(weights[0])
    if not lead and any(is_distributed_weight(w) for w in weights[1:]):
        kinds = [type(w).__name__ for w in weights]
        raise TypeError(f"{what}: the leader weights[0] is a plain tensor but later weights are distributed "
                        f"({kinds}); the leader must act for the whole group")
    return lead


def _group_result(result: Any, weights: Sequence[Any], what: str, *, bare: bool = False) -> list[Any]:
    """[Note: one-member groups exchange bare tensors]: a bare tensor is a one-member group's result."""
    if result is None:
        return [None] * len(weights)
    out = [result] if isinstance(result, torch.Tensor) else list(result)
    if not bare and len(out) != len(weights):
        raise ValueError(f"{what}: the leader returned {len(out)} tensors for a group of {len(weights)} "
                         f"weights")
    return out


def _to_implementer(tensors: Sequence[Any]) -> Any:
    """What a group's implementer receives: a bare tensor for a one-member group, else a list."""
    return tensors[0] if len(tensors) == 1 else list(tensors)


def _own_group(weights: Sequence[torch.Tensor]) -> bool:
    """distwgrad's weights each act for themselves (one collective per weight or per packed weight)."""
    return all(getattr(w, "acts_for_itself", False) for w in weights)


def _materialize(weights, backward: bool, what: str) -> list[torch.Tensor]:
    weights, bare = _as_group(weights, what)
    if not _check_group(weights, what):
        return weights
    hook = "materialize_group_for_backward" if backward else "materialize_group_for_forward"
    if _own_group(weights):
        return [_group_result(getattr(w, hook)(), [w], what)[0] for w in weights]
    return _group_result(getattr(weights[0], hook)(), weights, what, bare=bare)


def materialize_weight_for_forward(weights: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors for the forward GEMM, one per weight (one or a list in, a list out); plain ones pass through."""
    return _materialize(weights, False, "materialize_weight_for_forward")


def materialize_weight_for_backward(weights: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors for dgrad, re-materialized (never the forward copy); plain tensors pass through."""
    return _materialize(weights, True, "materialize_weight_for_backward")


def grad_buffers(weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The buffer each distributed weight's wgrad GEMM accumulates into."""
    return [w.grad_buffer() for w in weights]


def weight_grad_dtype(weights: torch.Tensor | Sequence[torch.Tensor], compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype a wgrad GEMM should produce: a distributed weight's ``main_grad`` dtype (fp32, so the reduction
    never rounds to the compute dtype) if it has one, else ``compute_dtype``."""
    weights, _ = _as_group(weights, "weight_grad_dtype")
    if is_distributed_weight(weights[0]):
        main_grad = getattr(weights[0], "main_grad", None)
        if isinstance(main_grad, torch.Tensor):
            return main_grad.dtype
    return compute_dtype


def weight_grad_buffers(weights: torch.Tensor | Sequence[torch.Tensor], shape: Sequence[int], dtype: torch.dtype,
                        device: torch.device | str) -> list[torch.Tensor]:
    """One buffer per weight for the wgrad GEMM: each member's own ``grad_buffer()`` (a shared one would let
    per-expert GEMMs overwrite each other; ``RuntimeError`` unless of ``shape``), for plain weights zeros."""
    weights, _ = _as_group(weights, "weight_grad_buffers")
    shape = tuple(shape)
    if not _check_group(weights, "weight_grad_buffers"):
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in weights]
    buffers = [w.grad_buffer() for w in weights]
    for i, b in enumerate(buffers):
        if tuple(b.shape) != shape:
            raise RuntimeError(f"wgrad GEMM needs a buffer of shape {shape}, but grad_buffer() of weight {i} "
                               f"({type(weights[i]).__name__}) has shape {tuple(b.shape)}")
    return buffers


def finalize_weight_grads(weights: torch.Tensor | Sequence[torch.Tensor], wgrads: Sequence[torch.Tensor]) -> list[Any]:
    """Delivers one contribution per weight; returns, per weight, ``None`` or a gradient for ``.grad``.

    ``weights``: one leader acting for a group of ``len(wgrads)``, or one weight per wgrad. Plain tensors'
    ``wgrads`` come back unchanged, as ordinary gradients ([Note: the finalize contract])."""
    weights, bare = _as_group(weights, "finalize_weight_grads")
    wgrads = [wgrads] if isinstance(wgrads, torch.Tensor) else list(wgrads)
    if not bare and len(wgrads) != len(weights):
        raise ValueError(f"finalize_weight_grads: {len(wgrads)} wgrads for {len(weights)} weights")
    if not _check_group(weights, "finalize_weight_grads"):
        return wgrads
    if _own_group(weights):
        return [_group_result(w.finalize_group_grads(g), [w], "finalize_weight_grads")[0]
                for w, g in zip(weights, wgrads)]
    result = weights[0].finalize_group_grads(_to_implementer(wgrads))
    return _group_result(result, wgrads, "finalize_weight_grads")
