"""The DistributedWeight protocol and its list-shaped dispatchers.

A distributed weight is a ``torch.Tensor`` subclass (usually an ``nn.Parameter``) whose local storage is
not the tensor a GEMM needs: a dim-0 shard, a replica that must be reduced, a quantized copy. Modules
never look inside; they call the four hooks below through the dispatchers, which keep TransformerEngine's
shape (``weights[0]`` is the leader and acts for the group, plain tensors pass through untouched), so a
weight written for TE's protocol plugs into distwgrad's modules and ours into TE's.

[Note: the finalize contract]
``finalize_group_grads(wgrads)`` is called once per *contribution*: after every wgrad GEMM of one use
of the group in one microbatch (immediately in backward, or later from a deferred ``backward_dw``),
with ``wgrads`` being the tensors the GEMM wrote, normally the ``grad_buffer()`` of each weight.
It returns ``None`` or, per weight, a tensor of the weight's own (local) shape that is one more
contribution to the weight's ``.grad``. distwgrad's modules use that return value in exactly one way on
every path: in the main backward it is handed to autograd as the weight's gradient; in a deferred
``backward_dw`` it is added to ``.grad`` (``None`` initialises, otherwise add). It is never dropped and
never used twice. distwgrad's own weights always return ``None``: they deliver into ``main_grad`` and
``.grad`` themselves, when the step's last contribution has arrived (``docs/protocol.md``).

[Note: what backward may hold]
The autograd context holds the weight *object* (the shard), never a gathered copy, and holds it as a
plain attribute rather than through ``save_for_backward``: ``saved_tensors_hooks`` (activation
offloading) replace saved tensors with plain ones, which would strip the subclass and send backward down
the non-distributed branch. Backward re-materializes through ``materialize_weight_for_backward``.
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
    """True for tensors that opt into the protocol (``is_distributed_weight`` set to True)."""
    return isinstance(t, torch.Tensor) and bool(getattr(t, "is_distributed_weight", False))


def _check_group(weights: Sequence[torch.Tensor | None], what: str) -> bool:
    if isinstance(weights, torch.Tensor):
        raise TypeError(f"{what} takes a list of weights (Linear passes [weight]), got a single tensor "
                        f"of shape {tuple(weights.shape)}")
    if len(weights) == 0:
        raise ValueError(f"{what} got an empty list of weights")
    lead = is_distributed_weight(weights[0])
    if not lead and any(is_distributed_weight(w) for w in weights[1:]):
        kinds = [type(w).__name__ for w in weights]
        raise TypeError(f"{what}: the leader weights[0] is a plain tensor but later weights are distributed "
                        f"({kinds}); the leader must act for the whole group")
    return lead


def _group_result(result: Any, weights: Sequence[Any], what: str) -> list[torch.Tensor]:
    out = [result] if isinstance(result, torch.Tensor) else list(result)
    if len(out) != len(weights):
        raise ValueError(f"{what}: the leader returned {len(out)} tensors for a group of {len(weights)} "
                         f"weights")
    return out


def _own_group(weights: Sequence[torch.Tensor]) -> bool:
    """distwgrad's weights each act for themselves (one collective per weight or per packed weight)."""
    return all(getattr(w, "_distwgrad_weight", False) for w in weights)


def materialize_weight_for_forward(weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors for the forward GEMM, one per weight; plain tensors pass through."""
    if not _check_group(weights, "materialize_weight_for_forward"):
        return list(weights)
    if _own_group(weights):
        return [w.materialize_group_for_forward()[0] for w in weights]
    return _group_result(weights[0].materialize_group_for_forward(), weights, "materialize_weight_for_forward")


def materialize_weight_for_backward(weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors for dgrad, re-materialized (never the forward copy); plain tensors pass through."""
    if not _check_group(weights, "materialize_weight_for_backward"):
        return list(weights)
    if _own_group(weights):
        return [w.materialize_group_for_backward()[0] for w in weights]
    return _group_result(weights[0].materialize_group_for_backward(), weights,
                         "materialize_weight_for_backward")


def grad_buffers(weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The buffer each distributed weight's wgrad GEMM accumulates into."""
    return [w.grad_buffer() for w in weights]


def finalize_weight_grads(weights: Sequence[torch.Tensor], wgrads: Sequence[torch.Tensor]) -> list[Any]:
    """Delivers one contribution per weight; returns, per weight, ``None`` or a gradient for ``.grad``.

    Plain tensors pass through: their ``wgrads`` are returned unchanged (the caller treats them as
    ordinary gradients). See [Note: the finalize contract].
    """
    if len(wgrads) != len(weights):
        raise ValueError(f"finalize_weight_grads: {len(wgrads)} wgrads for {len(weights)} weights")
    if not _check_group(weights, "finalize_weight_grads"):
        return list(wgrads)
    if _own_group(weights):
        return [w.finalize_group_grads([g])[0] for w, g in zip(weights, wgrads)]
    result = weights[0].finalize_group_grads(list(wgrads))
    if result is None:
        return [None] * len(weights)
    return _group_result(result, weights, "finalize_weight_grads")
