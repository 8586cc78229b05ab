"""LayerNormMLP / LayerNormLinear with distributed FC weights (gloo ranks) and under FP8 (CPU emulation).

Parity: fc1/fc2 (or LayerNormLinear's weight) are ``ShardedWeight``s and the biases ``ReplicatedWeight``s;
each rank runs its own data; the gradients must equal a single-process plain-torch reference averaged over
ranks in the weights' reduction order: bit-exact on 2 ranks, within a few fp32 ulps on 3 (uneven
shards: 3 ranks over 16 and 24 rows). The normalization's parameters are plain (a user's DDP reduces
them), so they are frozen here. FP8: the module against the quantize/dequantize/fp32-GEMM reference of
``tests/test_fp8_modules.py``, bit-exact.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import distwgrad
from distwgrad import ReplicatedWeight, ShardedWeight
from distwgrad.fp8 import BlockwiseScaling, PerTensorScaling, fp8_autocast
from distwgrad.fp8.emulate import fake_quant_cols, fake_quant_rows
from distwgrad.nn import LayerNormLinear, LayerNormMLP
from distwgrad.testing.multiprocess import for_each_case, run_distributed

H, FFN, B = 16, 24, 6  # hidden, ffn hidden, tokens per rank


def _full(kind):
    g = torch.Generator().manual_seed(0)
    if kind == "mlp":
        shapes = {"fc1_weight": (FFN, H), "fc1_bias": (FFN,), "fc2_weight": (H, FFN), "fc2_bias": (H,)}
    else:
        shapes = {"weight": (H, H), "bias": (H,)}
    return {n: torch.randn(s, generator=g) * 0.3 for n, s in shapes.items()}


def _build(case, full):
    mods = []
    shared = None
    for _ in range(2):
        if case["kind"] == "mlp":
            m = LayerNormMLP(H, FFN, delay_wgrad_compute=case["delay"])
        else:
            m = LayerNormLinear(H, H, delay_wgrad_compute=case["delay"])
        m.layer_norm_weight.requires_grad_(False)
        m.layer_norm_bias.requires_grad_(False)
        if shared is None or not case["tied"]:
            shared = {n: (ShardedWeight if t.dim() == 2 else ReplicatedWeight).from_full(t) for n, t in full.items()}
        for n, p in shared.items():
            setattr(m, n, p)
        mods.append(m)
    return torch.nn.Sequential(*mods)


def _reference(case, full):
    """Plain torch: norm (identity affine) -> fc1 -> gelu(tanh) -> fc2, twice, tied or not."""
    params = [{n: t.clone().requires_grad_() for n, t in full.items()}]
    params.append(params[0] if case["tied"] else {n: t.clone().requires_grad_() for n, t in full.items()})

    def model(x):
        for p in params:
            x = F.layer_norm(x, (H,))
            if case["kind"] == "mlp":
                x = F.linear(F.gelu(F.linear(x, p["fc1_weight"], p["fc1_bias"]), approximate="tanh"),
                             p["fc2_weight"], p["fc2_bias"])
            else:
                x = F.linear(x, p["weight"], p["bias"])
        return x
    return model, params


def _loss(model, x, microbatches):
    return model(x).tanh().square().mean() / microbatches


def _parity_case(case, rank, world):
    full = _full(case["kind"])
    model = _build(case, full)
    ref, ref_params = _reference(case, full)
    leaves = list({id(t): t for p in ref_params for t in p.values()}.values())
    mbs = case["microbatches"]
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(B, H, generator=g) for _ in range(world)]
    want = [None] * len(leaves)
    for m in range(mbs):  # each microbatch reduced (fp32 sum / world), then summed over microbatches
        per_rank = [torch.autograd.grad(_loss(ref, torch.chunk(x, mbs)[m], mbs), leaves) for x in xs]
        for i in range(len(leaves)):
            reduced = per_rank[0][i]
            for r in per_rank[1:]:
                reduced = reduced + r[i]
            reduced = reduced / world
            want[i] = reduced if want[i] is None else want[i] + reduced
    for microbatch in torch.chunk(xs[rank], mbs):
        _loss(model, microbatch, mbs).backward()
        if case["delay"]:
            distwgrad.drain_deferred_wgrads(model)
    assert distwgrad.finalize_model_grads([model]) > 0
    ours = [getattr(m, n) for m in model for n in full]
    ours = list({id(p): p for p in ours}.values())
    assert len(ours) == len(leaves)
    for p, w in zip(ours, want):
        rows = slice(p.shard_offset, p.shard_offset + p.shape[0]) if isinstance(p, ShardedWeight) else slice(None)
        w = w[rows]
        if world == 2:
            assert torch.equal(p.grad, w), (case, tuple(p.shape), (p.grad - w).abs().max())
        else:
            assert (p.grad - w).abs().max() <= 4 * torch.finfo(torch.float32).eps * w.abs().max(), case
    return True


def _parity_rank(rank, world, cases):
    return for_each_case(cases, _parity_case, rank, world)


_CASES = [dict(kind=k, tied=t, delay=d, microbatches=m)
          for k, t, d, m in itertools.product(["mlp", "ln_linear"], [False, True], [False, True], [1, 2])]


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_distributed_parity(world):
    results = run_distributed(_parity_rank, world, _CASES, timeout=300)
    assert results == [[True] * len(_CASES)] * world


RECIPES = [PerTensorScaling(), BlockwiseScaling(act_block=(1, 16), weight_block=(16, 16))]


def _dq_weight(w, recipe):
    from distwgrad.fp8 import dequantize, quantize_blockwise, quantize_per_tensor

    if isinstance(recipe, PerTensorScaling):
        return dequantize(quantize_per_tensor(w, recipe.fwd_dtype), dtype=torch.float32)
    return dequantize(quantize_blockwise(w, recipe.weight_block, recipe.dtype), dtype=torch.float32)


@pytest.mark.parametrize("recipe", RECIPES, ids=["per_tensor", "blockwise"])
@pytest.mark.parametrize("delay", [False, True])
def test_layernorm_mlp_fp8_matches_emulation_reference(recipe, delay):
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    mlp = LayerNormMLP(32, 48, params_dtype=bf16, delay_wgrad_compute=delay)
    with torch.no_grad():
        for p in (mlp.fc1_bias, mlp.fc2_bias):
            p.normal_()
    x = torch.randn(16, 32, dtype=bf16)
    with fp8_autocast(recipe):
        y = mlp(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    mlp.backward_dw()
    w1, w2 = mlp.fc1_weight.detach(), mlp.fc2_weight.detach()
    ln = F.layer_norm(x, (32,), mlp.layer_norm_weight.detach(), mlp.layer_norm_bias.detach())
    h = F.linear(fake_quant_rows(ln, recipe, grad=False), _dq_weight(w1, recipe),
                 mlp.fc1_bias.detach().float()).to(bf16)
    h_leaf = h.requires_grad_()
    a = F.gelu(h_leaf, approximate="tanh")
    want_y = F.linear(fake_quant_rows(a.detach(), recipe, grad=False), _dq_weight(w2, recipe),
                      mlp.fc2_bias.detach().float()).to(bf16)
    assert torch.equal(y, want_y)
    want_dw2 = fake_quant_cols(dy, recipe, grad=True).t().mm(fake_quant_cols(a.detach(), recipe, grad=False))
    assert torch.equal(mlp.fc2_weight.grad, want_dw2.to(bf16))
    da = fake_quant_rows(dy, recipe, grad=True).mm(_dq_weight(w2, recipe)).to(bf16)
    (dh,) = torch.autograd.grad(a, h_leaf, da)
    want_dw1 = fake_quant_cols(dh, recipe, grad=True).t().mm(fake_quant_cols(ln, recipe, grad=False))
    assert torch.equal(mlp.fc1_weight.grad, want_dw1.to(bf16))
    # The biases come from the main backward's high-precision dy, deferred or not (seed 000's FP8
    # block-scaling bias), never from a quantized copy.
    assert torch.equal(mlp.fc2_bias.grad, dy.sum(0)) and torch.equal(mlp.fc1_bias.grad, dh.sum(0))


@pytest.mark.parametrize("recipe", RECIPES, ids=["per_tensor", "blockwise"])
def test_fp8_deferred_equals_immediate_and_checkpoint(recipe):
    grads = []
    for delay, checkpoint in ((False, False), (True, False), (True, True)):
        torch.manual_seed(0)
        mlp = LayerNormMLP(32, 48, params_dtype=torch.bfloat16, activation="swiglu", delay_wgrad_compute=delay,
                           checkpoint=checkpoint)
        x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
        with fp8_autocast(recipe):
            mlp(x).float().square().sum().backward()
        mlp.backward_dw()
        grads.append([x.grad] + [p.grad for p in mlp.parameters()])
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other))
