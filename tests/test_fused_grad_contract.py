"""TransformerEngine's ``.grad`` contract for weights fused into ``main_grad``: [Note: the fused .grad contract].

Every module with ``fuse_wgrad_accumulation=True``, deferred or not, eager and compiled: without the
attribute ``grad_added_to_main_grad`` autograd gets None (``.grad`` stays None, a plain optimizer with
momentum and weight decay leaves the weight alone) and the attribute is never created; with it (Megatron's
DDP sets it to False) the main backward sets it and hands a dummy of zeros. ``main_grad`` holds the
oracle's gradient either way, and biases are plain gradients.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import distwgrad.nn as dnn

E, T, K, N = 3, 10, 8, 6
SPLITS = [4, 0, 6]


def _module(kind: str, delay: bool) -> nn.Module:
    kw = dict(delay_wgrad_compute=delay, fuse_wgrad_accumulation=True)
    if kind == "linear":
        return dnn.Linear(K, N, **kw)
    if kind == "ln_linear":
        return dnn.LayerNormLinear(K, N, **kw)
    if kind == "mlp":
        return dnn.LayerNormMLP(K, 2 * K, **kw)
    return dnn.GroupedLinear(E, K, N, single_grouped_weight=(kind == "grouped_packed"), **kw)


def _run(module: nn.Module, x: torch.Tensor, compiled: bool) -> None:
    fwd = torch.compile(module, backend="aot_eager", fullgraph=True) if compiled else module
    out = fwd(x, SPLITS) if isinstance(module, dnn.GroupedLinear) else fwd(x)
    out.square().sum().backward()
    while module.pending_backward_dw:
        module.backward_dw()


def _reference_grads(module: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same module unfused and not deferred: the gradient ``main_grad`` must hold."""
    ref = _module(_kind_of(module), delay=False)
    ref.fuse_wgrad_accumulation = False
    ref.load_state_dict(module.state_dict())
    _run(ref, x, compiled=False)
    return {n: p.grad for n, p in ref.named_parameters()}


def _kind_of(module: nn.Module) -> str:
    if isinstance(module, dnn.GroupedLinear):
        return "grouped_packed" if module.single_grouped_weight else "grouped"
    return {dnn.LayerNormLinear: "ln_linear", dnn.Linear: "linear", dnn.LayerNormMLP: "mlp"}[type(module)]


CASES = [(kind, delay, False) for kind in ("linear", "ln_linear", "mlp", "grouped", "grouped_packed")
         for delay in (False, True)] + [("linear", True, True), ("mlp", False, True), ("grouped_packed", True, True)]


IDS = [f"{k}-{'delay' if d else 'now'}{'-compiled' if c else ''}" for k, d, c in CASES]


@pytest.mark.parametrize("megatron", [False, True], ids=["plain", "megatron_flag"])
@pytest.mark.parametrize(("kind", "delay", "compiled"), CASES, ids=IDS)
def test_fused_weights_hand_autograd_none_unless_flagged(kind, delay, compiled, megatron):
    torch.manual_seed(0)
    module = _module(kind, delay)
    weights = module._weights()
    for w in weights:
        w.main_grad = torch.zeros(w.shape)
        if megatron:
            w.grad_added_to_main_grad = False
    x = torch.randn(T, K)
    want = _reference_grads(module, x)
    _run(module, x, compiled)
    weight_ids = {id(w) for w in weights}
    for name, p in module.named_parameters():
        if id(p) not in weight_ids:  # biases and norm parameters: plain gradients
            assert p.grad is not None and torch.equal(p.grad, want[name]), name
            continue
        assert torch.equal(p.main_grad, want[name].float()), name
        if megatron:
            assert p.grad_added_to_main_grad is True, name
            assert torch.equal(p.grad, torch.zeros_like(p)), name  # the dummy: zeros, never garbage
        else:
            assert not hasattr(p, "grad_added_to_main_grad"), name
            assert p.grad is None, name


def test_a_plain_optimizer_leaves_fused_weights_alone():
    """TE users expect momentum and weight decay to skip a fused weight (its update is Megatron's)."""
    torch.manual_seed(1)
    module = _module("linear", delay=True)
    module.weight.main_grad = torch.zeros(module.weight.shape)
    before = module.weight.detach().clone()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    for _ in range(2):
        _run(module, torch.randn(T, K), compiled=False)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert torch.equal(module.weight.detach(), before)
    assert module.weight not in opt.state or not opt.state[module.weight]
    assert module.weight.main_grad.abs().sum() > 0
