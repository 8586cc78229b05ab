"""``distwgrad.integrations.megatron``'s ``install``, ``finalize_model_grads`` and ``attach_main_grads``,
single process.

``install`` on a plain config and on megatron-core's ``TransformerConfig``; finalize refusing a missing
contribution, draining deferred wgrads and waiting for reductions; fused-accumulation users (distwgrad's
and a foreign placeholder following Megatron's ``grad_added_to_main_grad`` / ``zero_out_wgrad``
convention); and one contiguous main_grad buffer. Data: ``megatron_cases.py``'s exact values.
"""

from __future__ import annotations

import types

import pytest
import torch
from megatron_cases import H, K, _values
from torch import nn

from distwgrad import ShardedWeight
from distwgrad.integrations import megatron as dw_megatron
from distwgrad.nn import Linear

# --- single-process units ------------------------------------------------------------------------------

def test_install_sets_the_four_functions():
    model = nn.Sequential(Linear(K, H))
    config = types.SimpleNamespace()
    assert dw_megatron.install(config, [model]) is config
    assert config.finalize_model_grads_func is dw_megatron.finalize_model_grads
    assert config.grad_sync_func is dw_megatron.grad_sync_func
    assert config.param_sync_func is dw_megatron.param_sync_func
    with config.no_sync_func():
        pass
    with pytest.raises(TypeError, match="cannot set finalize_model_grads_func on NoneType"):
        dw_megatron.install(None, [model])
    with pytest.raises(TypeError, match="non-empty list of nn.Modules"):
        dw_megatron.install(config, [])


def test_install_on_megatron_transformer_config():
    tc = pytest.importorskip("megatron.core.transformer.transformer_config")
    # cuda_graph_scope=[]: what megatron-core's default "full" means, without its deprecation warning
    config = tc.TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1, cuda_graph_scope=[])
    model = nn.Sequential(Linear(K, H))
    assert dw_megatron.install(config, [model]).finalize_model_grads_func is dw_megatron.finalize_model_grads


def test_finalize_refuses_a_missing_contribution_and_touches_nothing():
    w = ShardedWeight.from_full(torch.ones(H, K))
    model = nn.Sequential(Linear(K, H, weight=w))
    fired = []
    dw_megatron.register_grad_ready_hook(model, lambda name, p: fired.append(name))
    x = torch.ones(2, K)
    model(x).sum().backward()
    assert fired == ["0.weight", "0.bias"]  # complete outside no_sync: ready
    kept = model(x)  # a forward whose backward never runs, its graph alive (a dropped one withdraws its use)
    bias_grad = model[0].bias.grad.clone()
    with pytest.raises(dw_megatron.MissingContributionError, match=r"0.weight: 1 of 2"):
        dw_megatron.finalize_model_grads([model])
    assert torch.equal(model[0].bias.grad, bias_grad) and w.grad is None
    assert fired == ["0.weight", "0.bias"]  # nothing fires twice, nothing fires for the failed finalize
    del kept


def test_finalize_drains_and_waits():
    w = ShardedWeight.from_full(torch.ones(H, K))
    waits = []
    w.wait_for_reductions = lambda: waits.append(1)  # what an asynchronously reducing weight exposes
    model = nn.Sequential(Linear(K, H, weight=w, delay_wgrad_compute=True))
    for _ in range(3):
        model(torch.ones(2, K)).sum().backward()
    result = dw_megatron.finalize_model_grads(model)
    assert (result.drained, result.waited, result.weights, result.plain) == (3, 1, 1, 1) and waits == [1]
    assert torch.equal(w.grad, torch.full((H, K), 6.0)) and not w.grad.requires_grad
    assert dw_megatron.finalize_model_grads(model) == dw_megatron.FinalizeResult(0, 1, 0, 0)


class _ForeignFused(nn.Module):
    """Stands for a non-distwgrad fused-accumulation layer (e.g. Megatron's ColumnParallelLinear)."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight


@pytest.mark.parametrize("megatron", [False, True])
def test_tied_fused_and_unfused_users_keep_both_contributions(megatron):
    g = torch.Generator().manual_seed(2)
    w_full, x = _values((H, H), g, True), _values((4, H), g, True, 1.0, -1, 2)
    w = nn.Parameter(w_full.clone())
    if megatron:  # the flag Megatron's DDP puts on its parameters: [Note: the fused .grad contract]
        w.grad_added_to_main_grad = False
    model = nn.Sequential(Linear(H, H, bias=False, weight=w, fuse_wgrad_accumulation=True),
                          Linear(H, H, bias=False, weight=w))
    model(x).sum().backward()
    assert getattr(w, "grad_added_to_main_grad", None) is (True if megatron else None)
    assert not getattr(w, "zero_out_wgrad", False)
    dw_megatron.finalize_model_grads([model])
    ref = nn.Sequential(nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False))
    ref[0].weight = ref[1].weight = nn.Parameter(w_full.clone())
    ref(x).sum().backward()
    assert w.grad is None and torch.equal(w.main_grad, ref[0].weight.grad)


@pytest.mark.parametrize("zero_out_wgrad", [False, True])
def test_foreign_placeholder_follows_megatron_convention(zero_out_wgrad):
    w = nn.Parameter(torch.zeros(H, K))
    model = nn.Sequential(_ForeignFused(w))
    w.main_grad = torch.full((H, K), 2.0)
    w.grad_added_to_main_grad = True
    w.zero_out_wgrad = zero_out_wgrad
    w.grad = torch.full((H, K), 1.0) if zero_out_wgrad else torch.full((H, K), float("nan"))  # placeholder
    dw_megatron.finalize_model_grads([model])
    assert w.grad is None and torch.equal(w.main_grad, torch.full((H, K), 3.0 if zero_out_wgrad else 2.0))


def test_attach_main_grads_views_one_buffer():
    model = nn.Sequential(Linear(K, H), Linear(H, H))
    buffer = dw_megatron.attach_main_grads([model])
    assert buffer.numel() == sum(p.numel() for p in model.parameters()) and buffer.dtype == torch.float32
    assert all(p.main_grad._base is buffer for p in model.parameters())
    model(torch.ones(2, K)).sum().backward()
    dw_megatron.finalize_model_grads([model])
    assert torch.equal(model[1].bias.main_grad, torch.full((H,), 2.0))
    with pytest.raises(ValueError, match="already have a main_grad"):
        dw_megatron.attach_main_grads([model])
