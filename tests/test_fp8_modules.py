"""FP8 modules and FP8 distributed weights (CPU emulation; gloo for the sharded cases).

Bit-exact comparisons: the modules' FP8 path and the explicit reference below run the same quantize /
dequantize / fp32-GEMM operations, so they agree to the bit. The FP8-vs-bf16 training comparison is
bounded by the quantization error, documented at that test.
"""

from __future__ import annotations

import pytest
import torch

import distwgrad
from distwgrad import ShardedWeight
from distwgrad.fp8 import (
    BlockwiseScaling,
    PerTensorScaling,
    dequantize,
    fp8_autocast,
    quantize_blockwise,
    quantize_per_tensor,
)
from distwgrad.fp8.emulate import fake_quant_cols, fake_quant_rows
from distwgrad.fp8.weights import materialize_quantized, sync_weight_amax
from distwgrad.nn import GroupedLinear, Linear
from distwgrad.testing.multiprocess import for_each_case, run_distributed

RECIPES = [PerTensorScaling(), BlockwiseScaling(act_block=(1, 16), weight_block=(16, 16))]


def _dq_weight(w, recipe):
    if isinstance(recipe, PerTensorScaling):
        return dequantize(quantize_per_tensor(w, recipe.fwd_dtype), dtype=torch.float32)
    return dequantize(quantize_blockwise(w, recipe.weight_block, recipe.dtype), dtype=torch.float32)


@pytest.mark.parametrize("recipe", RECIPES, ids=["per_tensor", "blockwise"])
@pytest.mark.parametrize("delay", [False, True])
def test_linear_fp8_matches_emulation_reference(recipe, delay):
    torch.manual_seed(0)
    lin = Linear(48, 40, params_dtype=torch.bfloat16, delay_wgrad_compute=delay)
    x = torch.randn(24, 48, dtype=torch.bfloat16, requires_grad=True)
    with fp8_autocast(recipe):
        y = lin(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    lin.backward_dw()
    w = lin.weight.detach()
    w_q = _dq_weight(w, recipe)
    want_y = torch.nn.functional.linear(fake_quant_rows(x.detach(), recipe, grad=False), w_q,
                                        lin.bias.detach().float()).to(torch.bfloat16)
    assert torch.equal(y, want_y)
    want_dx = fake_quant_rows(dy, recipe, grad=True).mm(w_q).to(torch.bfloat16)
    assert torch.equal(x.grad, want_dx)
    assert not torch.equal(x.grad, dy.mm(w))  # the bf16 weight was not used for dgrad
    want_dw = fake_quant_cols(dy, recipe, grad=True).t().mm(fake_quant_cols(x.detach(), recipe, grad=False))
    assert torch.equal(lin.weight.grad, want_dw.to(torch.bfloat16))
    assert torch.equal(lin.bias.grad, dy.sum(0))


@pytest.mark.parametrize("recipe", RECIPES, ids=["per_tensor", "blockwise"])
def test_grouped_linear_fp8_matches_emulation_reference(recipe):
    torch.manual_seed(0)
    g = GroupedLinear(3, 32, 16, bias=False, params_dtype=torch.bfloat16, single_grouped_weight=True)
    x = torch.randn(20, 32, dtype=torch.bfloat16, requires_grad=True)
    splits = [5, 0, 15]
    with fp8_autocast(recipe):
        y = g(x, splits)
    dy = torch.randn_like(y)
    y.backward(dy)
    w = g.weight.detach()
    if isinstance(recipe, PerTensorScaling):
        amax = w.abs().amax().float()
        wq = [dequantize(quantize_per_tensor(w[e], recipe.fwd_dtype, amax=amax), dtype=torch.float32)
              for e in range(3)]
    else:
        wq = [_dq_weight(w[e], recipe) for e in range(3)]
    xq = fake_quant_rows(x.detach(), recipe, grad=False)
    dyq = fake_quant_rows(dy, recipe, grad=True)
    for e, (s, t) in enumerate([(0, 5), (5, 5), (5, 20)]):
        assert torch.equal(y[s:t], xq[s:t].mm(wq[e].t()).to(torch.bfloat16))
        assert torch.equal(x.grad[s:t], dyq[s:t].mm(wq[e]).to(torch.bfloat16))


@pytest.mark.parametrize("recipe", RECIPES, ids=["per_tensor", "blockwise"])
@pytest.mark.parametrize("delay", [False, True])
def test_fp8_exempt_linear_runs_as_without_fp8(recipe, delay):
    """[Note: a module out of FP8]: an exempt Linear under fp8_autocast gives the output and gradients of the same
    Linear with FP8 off, bit for bit; the same Linear not exempt does not (so the comparison can fail)."""
    torch.manual_seed(0)
    base = Linear(48, 40, params_dtype=torch.bfloat16, delay_wgrad_compute=delay)
    x = torch.randn(24, 48, dtype=torch.bfloat16)
    dy = torch.randn(24, 40, dtype=torch.bfloat16)

    def run(fp8_exempt: bool, autocast: bool):
        lin = Linear(48, 40, params_dtype=torch.bfloat16, delay_wgrad_compute=delay, fp8_exempt=fp8_exempt)
        lin.load_state_dict(base.state_dict())
        xi = x.clone().requires_grad_()
        with fp8_autocast(recipe if autocast else None):
            y = lin(xi)
        y.backward(dy)
        lin.backward_dw()
        return y, xi.grad, lin.weight.grad, lin.bias.grad

    want = run(fp8_exempt=False, autocast=False)
    for got, ref in zip(run(fp8_exempt=True, autocast=True), want, strict=True):
        assert torch.equal(got, ref)
    quantized = run(fp8_exempt=False, autocast=True)
    assert not torch.equal(quantized[0], want[0]) and not torch.equal(quantized[2], want[2])
    assert "fp8_exempt=True" in repr(Linear(4, 4, fp8_exempt=True))


def test_the_models_routers_run_out_of_fp8():
    """Under fp8_autocast the job's model quantizes its attention and experts but not its routers ([Note: the
    model's mixed precision]): each router's output is what it gives with FP8 off, bit for bit."""
    from distwgrad.models import MoEGPT, MoEGPTConfig
    cfg = MoEGPTConfig(vocab_size=64, seq_len=17, d_model=32, n_layers=2, n_heads=2, n_experts=4, top_k=2, d_ff=32)
    model = MoEGPT(cfg, device=torch.device("cpu"), sharded=True, param_dtype=torch.bfloat16)
    seen = []
    hooks = [block.moe.router.register_forward_hook(lambda m, args, out: seen.append((m, args[0].clone(), out.clone())))
             for block in model.blocks]
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with fp8_autocast(PerTensorScaling()):
        model(tokens[:, :-1])
    for hook in hooks:
        hook.remove()
    assert len(seen) == cfg.n_layers
    for router, x, y in seen:
        assert router.fp8_exempt
        with torch.no_grad():
            assert torch.equal(y, router(x))
            router.fp8_exempt = False
            with fp8_autocast(PerTensorScaling()):
                assert not torch.equal(y, router(x))  # the check can fail: quantized, the output differs
            router.fp8_exempt = True


def test_recipe_is_carried_into_backward():
    """Backward runs outside the autocast block (and on another thread on CUDA): it must still be FP8."""
    torch.manual_seed(0)
    lin = Linear(32, 32, bias=False)
    x = torch.randn(8, 32, requires_grad=True)
    with fp8_autocast(PerTensorScaling()):
        y = lin(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    w_q = _dq_weight(lin.weight.detach(), PerTensorScaling())
    assert torch.equal(x.grad, fake_quant_rows(dy, PerTensorScaling(), grad=True).mm(w_q))


# --- FP8 sharded weights over ranks ----------------------------------------------------------------------

def _gather_case(case, rank, world):
    recipe, rows = case["recipe"], case["rows"]
    full = torch.randn(rows, 64, generator=torch.Generator().manual_seed(1)).to(case.get("device", "cpu"),
                                                                                 torch.bfloat16)
    w = ShardedWeight.from_full(full)
    before = w.bytes_gathered
    (q,) = materialize_quantized(w, recipe, backward=False)
    fp8_bytes = w.bytes_gathered - before
    w.materialize_group_for_forward()
    bf16_bytes = w.bytes_gathered - before - fp8_bytes
    got = dequantize(q, dtype=torch.float32)
    # Per-tensor: one global amax. Blockwise: the full weight's grid, blocks straddling ranks included.
    # Either way the gathered FP8 weight is exactly the full weight's quantization, scales included.
    want = _dq_weight(full, recipe)
    assert torch.equal(got, want)
    if isinstance(recipe, BlockwiseScaling):
        full_q = quantize_blockwise(full, recipe.weight_block, recipe.dtype)
        assert torch.equal(q.data.view(torch.uint8), full_q.data.view(torch.uint8))
        assert torch.equal(q.scale_inv, full_q.scale_inv)
    assert fp8_bytes <= 0.55 * bf16_bytes, (fp8_bytes, bf16_bytes)
    return fp8_bytes / bf16_bytes


def _packed_case(recipe, rank, world):
    """A packed [E, N, K] weight is sharded by experts: every expert quantizes whole on one rank."""
    full = torch.randn(5, 20, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    w = ShardedWeight.from_full(full)
    qs = materialize_quantized(w, recipe, backward=True)
    assert len(qs) == 5
    if isinstance(recipe, PerTensorScaling):
        amax = full.abs().amax().float()
        want = [dequantize(quantize_per_tensor(full[e], recipe.fwd_dtype, amax=amax), dtype=torch.float32)
                for e in range(5)]
    else:
        want = [_dq_weight(full[e], recipe) for e in range(5)]
    for q, wq in zip(qs, want):
        assert torch.equal(dequantize(q, dtype=torch.float32), wq)
    return None


def _gather_rank(rank, world, cases):
    if cases[0].get("device", "cpu") != "cpu":
        return for_each_case(cases, _gather_case, rank, world)
    packed = for_each_case([c["recipe"] for c in cases[::2]], _packed_case, rank, world)
    return for_each_case(cases, _gather_case, rank, world) + packed


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_fp8_all_gather_moves_fp8_bytes_and_equals_full_quantization(world):
    block = BlockwiseScaling(act_block=(1, 16), weight_block=(16, 16))
    cases = [dict(recipe=r, rows=rows) for r in (PerTensorScaling(), block) for rows in (64, 50)]
    ratios = run_distributed(_gather_rank, world, cases, timeout=120)
    assert all(r <= 0.55 for per_rank in ratios for r in per_rank if r is not None)


@pytest.mark.distributed
@pytest.mark.gpu
def test_fp8_all_gather_over_nccl():
    """The same gathers with CUDA shards over NCCL (skipped with fewer than two GPUs): the quantize
    kernels on each shard, FP8 bytes through NCCL, the result equal to quantizing the full weight."""
    block = BlockwiseScaling(act_block=(1, 16), weight_block=(16, 16))
    cases = [dict(recipe=r, rows=rows, device="cuda") for r in (PerTensorScaling(), block) for rows in (64, 50)]
    ratios = run_distributed(_gather_rank, 2, cases, timeout=120, device="cuda")
    assert all(r <= 0.55 for per_rank in ratios for r in per_rank)


def test_synced_amaxes_are_each_weights_compute_amax():
    """``sync_weight_amax`` computes every weight's amax in one stacked pass: the values of ``compute_amax``
    one weight at a time, bit for bit, NaN as +inf, an empty shard's 0."""
    from distwgrad.fp8 import compute_amax
    from distwgrad.fp8.weights import _local_amaxes

    full = [torch.randn(8, 8, generator=torch.Generator().manual_seed(i)) * (i + 1) for i in range(4)]
    full[1][2, 3] = float("nan")
    full[2][0, 0] = -float("inf")
    full[3].zero_()
    model = torch.nn.Sequential(*[Linear(8, 8, bias=False, weight=ShardedWeight.from_full(f)) for f in full])
    assert sync_weight_amax(model) == 4
    for f, p in zip(full, model.parameters()):
        cached = p._life.caches["fp8 amax"][2]
        assert torch.equal(cached, compute_amax(f)), (cached, compute_amax(f))
    assert _local_amaxes([torch.zeros(0, 3), torch.tensor([[-2.0, 1.0]])]).tolist() == [0.0, 2.0]


def _amax_rank(rank, world, dev="cpu"):
    from distwgrad.weights import _comm

    calls = []
    original = _comm.all_reduce_max
    _comm.all_reduce_max = lambda t, g: (calls.append(t.numel()), original(t, g))[1]
    try:
        torch.manual_seed(rank)  # different data per rank; weights identical (from_full)
        full = [torch.randn(32, 32, generator=torch.Generator().manual_seed(i)).to(dev) for i in range(3)]
        model = torch.nn.Sequential(*[Linear(32, 32, bias=False, weight=ShardedWeight.from_full(f)) for f in full])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            calls.clear()
            assert sync_weight_amax(model) == 3
            with fp8_autocast(PerTensorScaling()):
                model(torch.randn(4, 32).to(dev)).square().sum().backward()
            distwgrad.finalize_model_grads([model])
            assert calls == [3], calls  # one all-reduce of 3 amaxes for the step, none per weight
            opt.step()
            opt.zero_grad()
        # Without the per-step sync a stale amax falls back to one all-reduce per weight, counted.
        with fp8_autocast(PerTensorScaling()):
            model(torch.randn(4, 32).to(dev))
        return [getattr(p, "amax_allreduces", 0) for p in model.parameters()]
    finally:
        _comm.all_reduce_max = original


@pytest.mark.distributed
def test_one_amax_all_reduce_per_step():
    assert run_distributed(_amax_rank, 2, timeout=120) == [[1, 1, 1]] * 2


def _train(recipe, rank, steps=50, dev="cpu"):
    g = torch.Generator().manual_seed(0)
    w0 = ShardedWeight.from_full((torch.randn(64, 32, generator=g) * 0.2).to(dev))
    w1 = ShardedWeight.from_full((torch.randn(8, 64, generator=g) * 0.2).to(dev))
    model = torch.nn.Sequential(Linear(32, 64, bias=False, weight=w0), torch.nn.Tanh(),
                                Linear(64, 8, bias=False, weight=w1))
    target = torch.randn(32, 8, generator=g).to(dev)
    inputs = torch.randn(32, 32, generator=g).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        x, t = inputs[rank * 16:(rank + 1) * 16], target[rank * 16:(rank + 1) * 16]
        if recipe is not None:
            sync_weight_amax(model)
        with fp8_autocast(recipe):
            loss = (model(x) - t).square().mean()
        loss.backward()
        distwgrad.finalize_model_grads([model])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _parity_rank(rank, world, dev="cpu"):
    return [_train(None, rank, dev=dev), _train(PerTensorScaling(), rank, dev=dev),
            _train(BlockwiseScaling(act_block=(1, 16), weight_block=(16, 16)), rank, dev=dev)]


@pytest.mark.distributed
def test_fp8_training_tracks_fp32_over_50_steps():
    """Tolerance, derived rather than fitted: FP8 perturbs the model's output o by about eps*|o| with
    eps = 2^-4 (E4M3's relative rounding; the perturbations of the two operands partly cancel). For a
    squared loss L = mean(r^2), r = o - t, that moves L by at most 2*eps*|r||o| + (eps*|o|)^2, and at
    initialisation (small weights, o ~ t) |o|^2 ~ L0. So each step's FP8 loss must lie within
    2*eps*sqrt(L*L0) + eps^2*L0 of the fp32 loss L, and FP8 must train: the last loss below 1% of the
    first."""
    _check_fp8_tracks_fp32(run_distributed(_parity_rank, 2, timeout=300))


def _check_fp8_tracks_fp32(per_rank_losses):
    """``test_fp8_training_tracks_fp32_over_50_steps``'s bound on each rank's (fp32, per-tensor,
    blockwise) losses."""
    eps = 2.0**-4
    for fp32, per_tensor, blockwise in per_rank_losses:
        l0 = fp32[0]
        for fp8 in (per_tensor, blockwise):
            for a, b in zip(fp8, fp32):
                assert abs(a - b) <= 2 * eps * (b * l0) ** 0.5 + eps**2 * l0, (a, b)
            assert fp8[-1] < 0.01 * fp8[0]


@pytest.mark.distributed
@pytest.mark.gpu
def test_fp8_amax_and_training_over_nccl():
    """With CUDA tensors over NCCL (skipped with fewer than two GPUs): one amax all-reduce per step for
    all weights, and FP8 training (the quantize and FP8 GEMM kernels) within the same bound of fp32."""
    assert run_distributed(_amax_rank, 2, "cuda", timeout=180, device="cuda") == [[1, 1, 1]] * 2
    _check_fp8_tracks_fp32(run_distributed(_parity_rank, 2, "cuda", timeout=300, device="cuda"))
