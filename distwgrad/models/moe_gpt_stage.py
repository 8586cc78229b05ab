"""One pipeline stage of :class:`~distwgrad.models.MoEGPT`: a run of its blocks, with the embedding on the
first stage and the final norm and lm_head on the last.

Built from the same full tensors as the whole model (``init_full_weights``, seeded), so any cut of the
layers into stages computes the model ``MoEGPT`` computes; parameter names are the whole model's
(``blocks.<i>.`` with the global block index, ``embedding.weight``), so a stage's names are a subset of
its. The lm_head is the whole model's too: ``Linear(D, V)`` on the embedding's weight. When the first and
the last stage live on different ranks each holds a copy of that weight, tied across the stages by the
caller (``distwgrad.parallel.tie_first_and_last_stage``); on one rank (a V schedule) both stages are given
the same weight object (``tied=``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from distwgrad.models.moe_gpt import Block, MoEGPTConfig, init_full_weights, rms_norm
from distwgrad.nn import Embedding, Linear
from distwgrad.weights import ShardedWeight

__all__ = ["MoEGPTStage"]


class MoEGPTStage(nn.Module):
    """Blocks ``layers`` of ``MoEGPT(config)``; ``first`` adds the embedding (input: token ids ``[B, S]``),
    ``last`` the final norm and lm_head (output: logits ``[B, S, V]``); otherwise activations ``[B, S, D]``
    in and out. ``group``, ``param_dtype``: as ``MoEGPT``'s. ``tied``: the embedding weight to use (the
    other stage's on the same rank) instead of a fresh copy."""

    def __init__(self, config: MoEGPTConfig, layers: range, *, first: bool, last: bool,
                 device: torch.device | str | None = None, group: Any = None,
                 param_dtype: torch.dtype | None = None, tied: ShardedWeight | None = None) -> None:
        super().__init__()
        if not isinstance(layers, range) or layers.step != 1 or not 0 <= layers.start <= layers.stop <= config.n_layers:
            raise ValueError(f"layers must be a range within [0, {config.n_layers}) of step 1, got {layers!r}")
        if config.aux_loss_coef:
            raise ValueError(f"aux_loss_coef={config.aux_loss_coef} is not supported in pipeline stages (the last "
                             f"stage's loss cannot add the other stages' load-balancing losses); pass 0")
        self.config, self.param_dtype, self.first, self.last = config, param_dtype, first, last
        full = init_full_weights(config)

        def weight(name: str) -> ShardedWeight:
            return ShardedWeight.from_full(full[name].to(device), group=group, async_reduce=True,
                                           param_dtype=param_dtype)

        if (first or last) and tied is None:
            tied = weight("embedding.weight")
        self.embedding = Embedding(config.vocab_size, config.d_model, weight=tied) if first else None
        self.blocks = nn.ModuleDict({str(i): Block(config, weight, f"blocks.{i}.", True, param_dtype, "loop")
                                     for i in layers})
        self.lm_head = Linear(config.d_model, config.vocab_size, bias=False, weight=tied) if last else None

    @property
    def tied_weight(self) -> ShardedWeight | None:
        """The embedding / lm_head weight this stage holds, if any."""
        module = self.embedding if self.embedding is not None else self.lm_head
        return None if module is None else module.weight  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            if x.dim() != 2 or x.shape[1] > self.config.seq_len:
                raise ValueError(f"ids must be [batch, seq <= {self.config.seq_len}], got {tuple(x.shape)}")
            x = self.embedding(x)
        for block in self.blocks.values():
            x = block(x)
        if self.lm_head is not None:
            x = self.lm_head(rms_norm(x))
        return x


def stage_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """``MoEGPT.loss``'s: the mean next-token cross-entropy, in fp32."""
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), targets_BS.flatten())


__all__ += ["stage_loss"]
