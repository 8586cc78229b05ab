"""Modules: ``Linear``, ``GroupedLinear`` (MoE experts), ``LayerNormLinear`` and ``LayerNormMLP``,
TransformerEngine-compatible, and ``ops`` (``ops.GroupedLinear``, ``ops.Sequential``); ``fp8_autocast``,
``autocast`` and ``make_graphed_callables`` here as in ``transformer_engine.pytorch``
([Note: TransformerEngine's fp8_autocast])."""

from distwgrad.fp8.recipe import autocast, fp8_autocast
from distwgrad.graphs import make_graphed_callables
from distwgrad.nn import ops  # noqa: E402  after the modules it builds on
from distwgrad.nn.embedding import Embedding
from distwgrad.nn.grouped_linear import GroupedLinear
from distwgrad.nn.layernorm_linear import LayerNormLinear
from distwgrad.nn.layernorm_mlp import LayerNormMLP
from distwgrad.nn.linear import Linear

__all__ = ["Linear", "GroupedLinear", "LayerNormLinear", "LayerNormMLP", "Embedding", "fp8_autocast", "autocast",
           "make_graphed_callables", "ops"]
