"""Modules: ``Linear`` and ``GroupedLinear`` (MoE experts), TransformerEngine-compatible."""

from distwgrad.nn.embedding import Embedding
from distwgrad.nn.grouped_linear import GroupedLinear
from distwgrad.nn.linear import Linear

__all__ = ["Linear", "GroupedLinear", "Embedding"]
