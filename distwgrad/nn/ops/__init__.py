"""TransformerEngine's fusible-ops names (``te.ops``): ``import distwgrad.nn as te`` gives
``te.ops.GroupedLinear`` and ``te.ops.Sequential``."""

from distwgrad.nn.ops.grouped_linear import GroupedLinear
from distwgrad.nn.ops.sequential import Sequential

__all__ = ["GroupedLinear", "Sequential"]
