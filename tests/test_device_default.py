"""TransformerEngine's device default: a module creates its parameters on the current CUDA device where CUDA
is available, else on torch's default device; a given device wins, and a fresh bias sits beside a given
weight (``distwgrad.nn._base.parameter_device``)."""

from __future__ import annotations

import pytest
import torch

import distwgrad.nn as dnn
from distwgrad.nn._base import parameter_device

BUILDERS = {
    "Linear": lambda **kw: dnn.Linear(4, 3, **kw),
    "LayerNormLinear": lambda **kw: dnn.LayerNormLinear(4, 3, **kw),
    "LayerNormMLP": lambda **kw: dnn.LayerNormMLP(4, 8, **kw),
    "GroupedLinear": lambda **kw: dnn.GroupedLinear(2, 4, 3, **kw),
    "GroupedLinear_packed": lambda **kw: dnn.GroupedLinear(2, 4, 3, single_grouped_weight=True, **kw),
    "Embedding": lambda **kw: dnn.Embedding(5, 4, **kw),
}


def _devices(module: torch.nn.Module) -> set[torch.device]:
    return {p.device for p in module.parameters()}


@pytest.mark.parametrize("name", BUILDERS)
def test_cuda_when_available_else_torch_default(name, monkeypatch):
    here = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    assert _devices(BUILDERS[name]()) == {here}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert parameter_device(None) == torch.device("cuda", 1)
    assert parameter_device("cpu") == torch.device("cpu")
    assert _devices(BUILDERS[name](device="meta")) == {torch.device("meta")}
    assert _devices(BUILDERS[name](device="cpu")) == {torch.device("cpu")}


def test_torch_default_device_is_followed_where_it_is_not_the_cpu():
    with torch.device("meta"):
        assert _devices(dnn.Linear(4, 3)) == {torch.device("meta")}
        assert _devices(dnn.GroupedLinear(2, 4, 3)) == {torch.device("meta")}


def test_a_fresh_bias_sits_beside_the_given_weight(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the default would be CUDA
    weight = torch.nn.Parameter(torch.randn(3, 4))
    lin = dnn.Linear(4, 3, weight=weight)
    assert lin.bias.device == weight.device == torch.device("cpu")
