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

[Note: one-member groups exchange bare tensors]
TransformerEngine's implementers (Megatron's GTP weights) speak bare tensors for a group of one: the
dispatchers take one weight or a list and always return a list, but a one-member group's
``materialize_group_for_forward/backward`` may return a bare tensor, its ``finalize_group_grads``
receives the bare wgrad (a list only for larger groups) and may return a bare tensor or ``None``. This
holds on every module path (Linear, packed GroupedLinear, LayerNormMLP, LayerNormLinear) and for
distwgrad's own weights, which act for themselves and so always receive a bare wgrad.
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
    """True for tensors that opt into the protocol (``is_distributed_weight`` set to True).

    An object that claims the protocol but is not a ``torch.Tensor`` is a ``TypeError``: modules pass the
    weight through ``ctx``, DDP hooks and ``torch.compile``, which all need a tensor.
    """
    claims = bool(getattr(t, "is_distributed_weight", False))
    if claims and not isinstance(t, torch.Tensor):
        raise TypeError(f"a DistributedWeight must be a torch.Tensor subclass (usually an nn.Parameter); got "
                        f"{type(t).__name__}, which sets is_distributed_weight but is not a tensor")
    return claims


def _as_group(weights: torch.Tensor | Sequence[torch.Tensor | None], what: str) -> tuple[list, bool]:
    """``(weights as a list, whether the caller passed a bare weight)``; a bare weight is a leader whose
    group is whatever it returns (TE's Linear passes one weight, GroupedLinear a list)."""
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
    """Tensors for the forward GEMM, one per weight; plain tensors pass through as the same objects.

    ``weights`` is one weight or a list (always a list back); a distributed leader is called once for
    the whole group ([Note: one-member groups exchange bare tensors]).
    """
    return _materialize(weights, False, "materialize_weight_for_forward")


def materialize_weight_for_backward(weights: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors for dgrad, re-materialized (never the forward copy); plain tensors pass through."""
    return _materialize(weights, True, "materialize_weight_for_backward")


def grad_buffers(weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The buffer each distributed weight's wgrad GEMM accumulates into."""
    return [w.grad_buffer() for w in weights]


def weight_grad_dtype(weights: torch.Tensor | Sequence[torch.Tensor], compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype a wgrad GEMM should produce for this group (TE PR #3397).

    A distributed weight reduces its wgrad before it accumulates, so the GEMM emits ``main_grad``'s dtype
    (fp32) and the reduction never rounds to the compute dtype. A distributed weight without a
    ``main_grad`` yet, and every plain weight (even one carrying a ``main_grad``: its wgrad is either
    fused into ``main_grad`` by the GEMM or an ordinary ``.grad``), keep ``compute_dtype``.
    """
    weights, _ = _as_group(weights, "weight_grad_dtype")
    if is_distributed_weight(weights[0]):
        main_grad = getattr(weights[0], "main_grad", None)
        if isinstance(main_grad, torch.Tensor):
            return main_grad.dtype
    return compute_dtype


def weight_grad_buffers(weights: torch.Tensor | Sequence[torch.Tensor], shape: Sequence[int], dtype: torch.dtype,
                        device: torch.device | str) -> list[torch.Tensor]:
    """One buffer per weight for the wgrad GEMM to write into (TE PR #3397).

    A distributed weight brings its own: each member's ``grad_buffer()`` (never the leader's reused for
    the group, which would let the per-expert GEMMs overwrite each other), each checked against ``shape``
    (a shard-shaped buffer would let the GEMM write out of bounds). Plain weights get fresh zeroed
    scratch of ``shape`` and ``dtype``.
    """
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

    ``weights`` is one weight (a leader acting for a group of ``len(wgrads)``) or a list of one per wgrad.
    Plain tensors pass through: their ``wgrads`` are returned unchanged (the caller treats them as
    ordinary gradients). See [Note: the finalize contract] and
    [Note: one-member groups exchange bare tensors].
    """
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
