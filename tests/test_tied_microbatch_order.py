"""Tied weights over microbatches: the deferred path adds each contribution in the order ``backward_dw()``
drains them.

Regular autograd sums a tied parameter's uses inside one backward before it accumulates into ``.grad``:
``(a1 + b1) + (a2 + b2)`` over two microbatches. ``backward_dw()`` adds one contribution a call:
``((a1 + b1) + a2) + b2`` for the order (0, 1). Both are the same terms, in bf16, in another order, so the
two results differ by at most a bf16 ulp or two at the gradient's magnitude, which is what TransformerEngine's
tied-wgrad file sees for two microbatches (its fixed 1e-2 tolerance fails where a value is small). Here each
contribution is measured alone, on untied copies with the same weights and inputs, and both paths must equal
their own order's sum bit for bit (``torch.equal``): no term is lost, doubled or assigned over.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import distwgrad.nn as te

_DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]
_BF16 = torch.bfloat16
_GROUPS, _HIDDEN, _TOKENS_PER_GROUP = 2, 16, 16


def _linear(delay: bool, device: str) -> nn.Module:
    return te.Linear(_HIDDEN, _HIDDEN, bias=True, params_dtype=_BF16, device=device,
                     delay_wgrad_compute=delay, fuse_wgrad_accumulation=False)


def _mlp(delay: bool, device: str) -> nn.Module:
    return te.LayerNormMLP(32, 64, params_dtype=_BF16, device=device, delay_wgrad_compute=delay,
                           fuse_wgrad_accumulation=False)


def _grouped(delay: bool, device: str, packed: bool) -> nn.Module:
    return te.GroupedLinear(_GROUPS, _HIDDEN, _HIDDEN, bias=not packed, params_dtype=_BF16, device=device,
                            fuse_wgrad_accumulation=False, delay_wgrad_compute=delay, single_grouped_weight=packed)


def _ops_grouped(delay: bool, device: str, packed: bool) -> nn.Module:
    return te.ops.GroupedLinear(_GROUPS, _HIDDEN, _HIDDEN, bias=False, dtype=_BF16, device=device,
                                accumulate_into_main_grad=False, delay_wgrad_compute=delay,
                                single_grouped_weight=packed)


# name: (build(delay, device), the tied parameter names, width of an input row, grouped)
_MODULES = {
    "Linear": (_linear, ("weight", "bias"), _HIDDEN, False),
    "LayerNormMLP": (_mlp, ("fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias"), 32, False),
    "GroupedLinear": (lambda d, dev: _grouped(d, dev, False), ("weight0", "weight1", "bias0", "bias1"), _HIDDEN, True),
    "GroupedLinear-packed": (lambda d, dev: _grouped(d, dev, True), ("weight",), _HIDDEN, True),
    "ops.GroupedLinear": (lambda d, dev: _ops_grouped(d, dev, False), ("weight0", "weight1"), _HIDDEN, True),
    "ops.GroupedLinear-packed": (lambda d, dev: _ops_grouped(d, dev, True), ("weight",), _HIDDEN, True),
}


def _pair(build, delay: bool, device: str, state: dict) -> nn.ModuleList:
    pair = nn.ModuleList([build(delay, device) for _ in range(2)])
    pair.load_state_dict(state)
    return pair


def _backward(pair: nn.ModuleList, x: torch.Tensor, splits) -> None:
    y = pair[0](x.clone().requires_grad_(True), *splits)
    pair[1](y, *splits).float().sum().backward()


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
@pytest.mark.parametrize("name", list(_MODULES))
def test_tied_microbatches_add_each_contribution_in_drain_order(name, order, device):
    build, params, width, grouped = _MODULES[name]
    torch.manual_seed(9)
    state = nn.ModuleList([build(False, device) for _ in range(2)]).state_dict()
    for p in params:  # use 1 holds use 0's values in the untied copies too
        state[f"1.{p}"] = state[f"0.{p}"]
    splits = [torch.tensor([_TOKENS_PER_GROUP] * _GROUPS, device=device, dtype=torch.int64)] if grouped else []
    rows = _TOKENS_PER_GROUP * _GROUPS if grouped else 8
    xs = [torch.randn(rows, width, device=device, dtype=_BF16) for _ in range(2)]

    untied = _pair(build, False, device, state)  # each use's contribution alone: parts[mb][use][param]
    parts = []
    for x in xs:
        untied.zero_grad(set_to_none=True)
        _backward(untied, x, splits)
        parts.append([{p: getattr(untied[u], p).grad.clone() for p in params} for u in (0, 1)])

    regular, delayed = _pair(build, False, device, state), _pair(build, True, device, state)
    for pair in (regular, delayed):
        for p in params:
            setattr(pair[1], p, getattr(pair[0], p))
        for x in xs:
            _backward(pair, x, splits)
    for _ in xs:
        for use in order:
            delayed[use].backward_dw()

    for p in params:
        (a1, b1), (a2, b2) = ((mb[0][p], mb[1][p]) for mb in parts)
        first, second = order
        drained = [parts[mb][use][p] for mb in (0, 1) for use in (first, second)]
        want_delayed = ((drained[0] + drained[1]) + drained[2]) + drained[3]
        want_regular = (a1 + b1) + (a2 + b2)
        assert torch.equal(getattr(delayed[0], p).grad, want_delayed), p
        assert torch.equal(getattr(regular[0], p).grad, want_regular), p
        # the two orders' results: a bf16 rounding or two at the gradient's magnitude, never a lost term
        ulp = torch.finfo(_BF16).eps * want_regular.abs().max().float()
        assert (want_delayed.float() - want_regular.float()).abs().max() <= 2 * ulp, p
