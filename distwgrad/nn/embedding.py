"""``Embedding``: a token lookup whose weight may be distributed and tied to an output projection.

Legend: T tokens (leading dims flattened), V rows (``num_embeddings``), D ``embedding_dim``.

Backward needs no weight: ``run_wgrad`` ``index_add_``s ``dy`` into the fp32 ``grad_buffer()``, as ``Linear``
accumulates ([Note: accumulate, never assign]). Tied (``Linear(D, V, bias=False, weight=embedding.weight)``),
each use counts and the weight reduces once ([Note: contribution accounting] in ``weights/base.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distwgrad.nn._base import WgradModule, check_compute_dtype, parameter_device
from distwgrad.protocol import materialize_weight_for_forward
from distwgrad.wgrad.accumulate import run_wgrad

__all__ = ["Embedding"]


def _scatter_rows(ids_T: torch.Tensor, dy_TD: torch.Tensor, weight: torch.Tensor):
    """The wgrad 'GEMM' of a lookup: rows of ``dy`` added at their token ids."""
    def scatter(targets: list[torch.Tensor | None]) -> list[torch.Tensor]:
        target = targets[0]
        if target is not None:  # a distributed weight's fp32 grad_buffer()
            return [target.index_add_(0, ids_T, dy_TD.to(target.dtype))]
        # A plain weight: summed in at least fp32, rounded once to the weight's dtype (for fp32 weights
        # this is torch.nn.Embedding's own CPU backward, bit for bit).
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)
        acc = torch.zeros(weight.shape, dtype=acc_dtype, device=dy_TD.device)
        return [acc.index_add_(0, ids_T, dy_TD.to(acc_dtype)).to(weight.dtype)]
    return scatter


class _EmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids_T, weight, weight_grad: bool, uses):
        (w_VD,) = materialize_weight_for_forward([weight])
        y_TD = F.embedding(ids_T, w_VD)
        del w_VD  # transient: never saved, never cached
        ctx.save_for_backward(ids_T)
        # The parameter rides on ctx, not save_for_backward: [Note: what backward may hold].
        ctx.weight, ctx.weight_grad = weight, weight_grad
        ctx.uses = uses  # [Note: contribution accounting]: freed with the graph, it withdraws an unused use
        return y_TD

    @staticmethod
    def backward(ctx, dy_TD):
        (ids_T,) = ctx.saved_tensors
        weight = ctx.weight
        if not ctx.weight_grad:
            return None, None, None, None
        (gw,) = run_wgrad([weight], _scatter_rows(ids_T, dy_TD.contiguous(), weight), fuse=False,
                          deferred=False, uses=ctx.uses)
        return None, gw, None, None


class Embedding(WgradModule):
    """A lookup ``y[..., :] = weight[ids[...], :]`` whose weight may be distributed or tied.

    Args:
        num_embeddings, embedding_dim: V and D.
        params_dtype, device: a fresh weight's; given with ``weight``, ``params_dtype`` must be its compute dtype.
        weight: an existing full-shape ``[V, D]`` weight (a ``ShardedWeight``, or a parameter to tie); a fresh
            one is drawn from N(0, 1), as ``torch.nn.Embedding`` does.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, params_dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self._init_wgrad(delay_wgrad_compute=False, fuse_wgrad_accumulation=False)
        for name, v in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.wgrad_store.owner = f"Embedding({num_embeddings}, {embedding_dim})"
        if weight is None:
            dtype = params_dtype or torch.get_default_dtype()
            weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype,
                                              device=parameter_device(device)))
            nn.init.normal_(weight)
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.params_dtype = params_dtype
        check_compute_dtype(self.wgrad_store.owner, {"weight": self.weight}, params_dtype)
        full = tuple(getattr(self.weight, "full_shape", self.weight.shape))
        if full != (num_embeddings, embedding_dim):
            raise ValueError(f"{self.wgrad_store.owner}: weight has full shape {full}, expected "
                             f"{(num_embeddings, embedding_dim)}")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
            got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise TypeError(f"{self.wgrad_store.owner}: ids must be an int32/int64 tensor, got {got}")
        if ids.device != self.weight.device:
            raise ValueError(f"{self.wgrad_store.owner}: ids on {ids.device}, weight on {self.weight.device}")
        check_compute_dtype(self.wgrad_store.owner, {"weight": self.weight}, self.params_dtype)
        weight_grad = torch.is_grad_enabled() and self.weight.requires_grad
        uses = self._begin_forward([self.weight] if weight_grad else [])
        y_TD = _EmbeddingFunction.apply(ids.reshape(-1), self.weight, weight_grad, uses)
        return y_TD.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"
