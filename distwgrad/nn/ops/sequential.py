"""``ops.Sequential``: TransformerEngine's container of fusible ops, without the fusion."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Sequential"]


class Sequential(nn.Sequential):
    """Modules applied in order, as ``te.ops.Sequential``: ``forward(input, *extra_inputs)`` hands each module
    the next ``num_extra_inputs`` of ``extra_inputs`` (none for a module without the attribute), so
    ``Sequential(ops.GroupedLinear(...), ops.GroupedLinear(...))(x, splits_a, splits_b)`` calls
    ``first(x, splits_a)`` then ``second(y, splits_b)``. Each module runs its own kernels (distwgrad fuses
    nothing across ops)."""

    def forward(self, input: torch.Tensor, *extra_inputs):  # noqa: A002  TE's name
        extra = list(extra_inputs)
        for i, module in enumerate(self):
            n = getattr(module, "num_extra_inputs", 0)
            if n > len(extra):
                raise ValueError(f"ops.Sequential: module {i} ({type(module).__name__}) takes {n} extra inputs, "
                                 f"{len(extra)} are left of the {len(extra_inputs)} given")
            args, extra = extra[:n], extra[n:]
            input = module(input, *args)
        if extra:
            raise ValueError(f"ops.Sequential: {len(extra)} of the {len(extra_inputs)} extra inputs were not "
                             f"taken by any module (they take {[getattr(m, 'num_extra_inputs', 0) for m in self]})")
        return input
