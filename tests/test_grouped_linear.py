"""GroupedLinear against a per-expert ``torch.nn.Linear`` oracle (seed 000's grouped cases, seed 004's
regressions). fp32 and bf16 comparisons are bit-exact: the CPU path runs the same per-expert calls as the
oracle and deferred contributions are added in the same order as autograd adds them, except for TIED
weights over several microbatches (see tests/test_linear.py's docstring), checked bit-exactly against
the oracle summed in the deferred order.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import distwgrad
from distwgrad import ShardedWeight
from distwgrad.nn import GroupedLinear
from distwgrad.testing.multiprocess import for_each_case, run_distributed

E, D = 3, 12


def _pair(*, packed, bias, delay, tied, dtype=torch.float32, fuse=False):
    torch.manual_seed(5)
    kw = dict(bias=bias, params_dtype=dtype, single_grouped_weight=packed, delay_wgrad_compute=delay,
              fuse_wgrad_accumulation=fuse)
    layers = [GroupedLinear(E, D, D, **kw), GroupedLinear(E, D, D, **kw)]
    if tied:
        for name, _ in list(layers[0].named_parameters()):
            setattr(layers[1], name, getattr(layers[0], name))
    return layers


def _expert_tensors(layer, kind):
    if layer.single_grouped_weight:
        return list(getattr(layer, kind).detach().unbind(0))
    return [getattr(layer, f"{kind}{e}").detach() for e in range(E)]


def _oracle(layers, *, tied):
    out = []
    for layer in layers:
        experts = torch.nn.ModuleList(torch.nn.Linear(D, D, bias=layer.use_bias) for _ in range(E))
        for e, lin in enumerate(experts):
            lin.to(_expert_tensors(layer, "weight")[e].dtype)
            lin.weight.data.copy_(_expert_tensors(layer, "weight")[e])
            if layer.use_bias:
                lin.bias.data.copy_(_expert_tensors(layer, "bias")[e])
        out.append(experts)
    if tied:
        for e in range(E):
            out[1][e].weight = out[0][e].weight
            out[1][e].bias = out[0][e].bias
    return out


def _oracle_forward(experts, x, splits):
    chunks, start = [], 0
    for lin, s in zip(experts, splits):
        chunks.append(lin(x[start:start + s]))
        start += s
    return torch.cat(chunks)


def _loss(y):
    return y.float().square().sum()


def _run(layers, x, splits_per_mb, *, order=(0, 1)):
    for microbatch, splits in zip(torch.split(x, [sum(s) for s in splits_per_mb]), splits_per_mb):
        h = microbatch
        for layer in layers:
            h = layer(h, splits)
        _loss(h).backward()
        for i in order:
            layers[i].backward_dw()


def _run_oracle(oracle, x, splits_per_mb):
    for microbatch, splits in zip(torch.split(x, [sum(s) for s in splits_per_mb]), splits_per_mb):
        h = microbatch
        for experts in oracle:
            h = _oracle_forward(experts, h, splits)
        _loss(h).backward()


def _grads(layer, kind):
    if layer.single_grouped_weight:
        return list(getattr(layer, kind).grad.unbind(0))
    return [getattr(layer, f"{kind}{e}").grad for e in range(E)]


SPLITS = [[3, 0, 5], [1, 6, 1], [0, 0, 8], [4, 4, 0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_single_microbatch_bit_exact(dtype, packed, bias, delay, order):
    for tied in (False, True):
        layers = _pair(packed=packed, bias=bias, delay=delay, tied=tied, dtype=dtype)
        oracle = _oracle(layers, tied=tied)
        x = torch.randn(8, D, dtype=dtype)
        _run(layers, x, SPLITS[:1], order=order)
        _run_oracle(oracle, x, SPLITS[:1])
        for layer, experts in zip(layers, oracle):
            for kind in ("weight", "bias") if bias else ("weight",):
                for got, lin in zip(_grads(layer, kind), experts):
                    assert torch.equal(got, getattr(lin, kind).grad), (tied, kind)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("microbatches", [2, 4])
def test_microbatches_accumulate(packed, microbatches):
    splits = SPLITS[:microbatches]
    x = torch.randn(8 * microbatches, D)
    # Untied: the deferred order equals autograd's: bit-exact.
    layers = _pair(packed=packed, bias=True, delay=True, tied=False)
    oracle = _oracle(layers, tied=False)
    _run(layers, x, splits)
    _run_oracle(oracle, x, splits)
    for layer, experts in zip(layers, oracle):
        for kind in ("weight", "bias"):
            for got, lin in zip(_grads(layer, kind), experts):
                assert torch.equal(got, getattr(lin, kind).grad)
    # Tied: bit-exact against per-use oracle gradients summed in the deferred drain order.
    for order in ((0, 1), (1, 0)):
        layers = _pair(packed=packed, bias=True, delay=True, tied=True)
        untied = _oracle(layers, tied=False)
        expected = None
        for microbatch, sp in zip(torch.split(x, [sum(s) for s in splits]), splits):
            h = microbatch
            for experts in untied:
                h = _oracle_forward(experts, h, sp)
            per_layer = [torch.autograd.grad(_loss(h), [lin.weight for lin in experts], retain_graph=True)
                         for experts in untied]
            for i in order:
                expected = list(per_layer[i]) if expected is None else [a + b for a, b in zip(expected, per_layer[i])]
        _run(layers, x, splits, order=order)
        for got, want in zip(_grads(layers[0], "weight"), expected):
            assert torch.equal(got, want)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_second_step_equals_fresh_model(packed, set_to_none):
    layers = _pair(packed=packed, bias=True, delay=True, tied=True)
    params = list({id(p): p for layer in layers for p in layer.parameters()}.values())
    opt = torch.optim.SGD(params, lr=0.1)
    x1, x2 = torch.randn(8, D), torch.randn(8, D)
    _run(layers, x1, SPLITS[:1])
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    fresh = _oracle(layers, tied=True)
    _run(layers, x2, SPLITS[1:2])
    _run_oracle(fresh, x2, SPLITS[1:2])
    for layer, experts in zip(layers, fresh):
        for kind in ("weight", "bias"):
            for got, lin in zip(_grads(layer, kind), experts):
                assert torch.equal(got, getattr(lin, kind).grad)


def test_main_backward_never_hands_autograd_an_unfilled_buffer():
    for packed in (False, True):
        layers = _pair(packed=packed, bias=True, delay=True, tied=True)
        h = torch.randn(8, D)
        for layer in layers:
            h = layer(h, SPLITS[0])
        h.sum().backward()
        assert all(p.grad is None for layer in layers for p in layer.parameters())


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("delay", [False, True])
def test_fused_main_grad(packed, delay):
    layers = _pair(packed=packed, bias=False, delay=delay, tied=False, fuse=True)
    oracle = _oracle(layers, tied=False)
    x = torch.randn(8, D)
    _run(layers, x, SPLITS[:1])
    _run_oracle(oracle, x, SPLITS[:1])
    for layer, experts in zip(layers, oracle):
        params = [layer.weight] if packed else [getattr(layer, f"weight{e}") for e in range(E)]
        mains = list(params[0].main_grad.unbind(0)) if packed else [p.main_grad for p in params]
        for main, lin in zip(mains, experts):
            assert main.dtype == torch.float32 and torch.equal(main, lin.weight.grad)
        # [Note: the fused .grad contract]: no Megatron flag on the weights, so autograd gets None
        assert all(p.grad is None and not hasattr(p, "grad_added_to_main_grad") for p in params)


@pytest.mark.parametrize("splits", [[0, 37, 1, 90], [128, 0, 0, 0], [0, 0, 0, 128]])
def test_uneven_routing(splits):
    torch.manual_seed(0)
    layer = GroupedLinear(4, D, 7, delay_wgrad_compute=True)
    oracle = torch.nn.ModuleList(torch.nn.Linear(D, 7) for _ in range(4))
    for e, lin in enumerate(oracle):
        lin.weight.data.copy_(getattr(layer, f"weight{e}").detach())
        lin.bias.data.copy_(getattr(layer, f"bias{e}").detach())
    x = torch.randn(128, D, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y = layer(x, torch.tensor(splits))
    yr = _oracle_forward(oracle, xr, splits)
    assert torch.equal(y, yr)
    y.square().sum().backward()
    layer.backward_dw()
    yr.square().sum().backward()
    assert torch.equal(x.grad, xr.grad)
    for e, lin in enumerate(oracle):
        assert torch.equal(getattr(layer, f"weight{e}").grad, lin.weight.grad)
        assert torch.equal(getattr(layer, f"bias{e}").grad, lin.bias.grad)


def test_weight_requires_grad_is_read_from_the_parameters():
    layer = GroupedLinear(2, D, D, bias=False, single_grouped_weight=True)
    layer.weight.requires_grad_(False)
    x = torch.randn(4, D, requires_grad=True)
    layer(x, [2, 2]).sum().backward()
    assert layer.weight.grad is None and x.grad is not None
    layer.weight.requires_grad_(True)
    layer(x, [2, 2]).sum().backward()
    assert layer.weight.grad is not None  # never silently skipped
    mixed = GroupedLinear(2, D, D, bias=False)
    mixed.weight1.requires_grad_(False)
    with pytest.raises(ValueError, match=r"some expert weights require grad and some do not \(\[True, False\]\)"):
        mixed(x, [2, 2])


def test_bad_splits_and_inputs():
    layer = GroupedLinear(3, D, 4)
    x = torch.randn(6, D)
    with pytest.raises(ValueError, match=r"m_splits \[1, 2, 2\] sum to 5, but the input has 6 tokens"):
        layer(x, [1, 2, 2])
    with pytest.raises(ValueError, match=r"negative split: \[7, -1, 0\]"):
        layer(x, [7, -1, 0])
    with pytest.raises(ValueError, match="must have 3 entries .* got 2"):
        layer(x, [3, 3])
    with pytest.raises(ValueError, match="must have 3 entries"):
        layer(x, torch.tensor([3, 3]))
    with pytest.raises(TypeError, match="integer tensor"):
        layer(x, torch.tensor([2.0, 2.0, 2.0]))
    with pytest.raises(ValueError, match=r"input of shape \(6, 5\), expected last dim in_features=12"):
        layer(torch.randn(6, 5), [2, 2, 2])
    with pytest.raises(TypeError, match="input dtype torch.float64"):
        layer(x.double(), [2, 2, 2])
    with pytest.raises(ValueError, match="num_gemms must be a positive int, got 0"):
        GroupedLinear(0, D, 4)
    layer.weight1 = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"weight full shapes .*\(3, 3\).*expected"):
        layer(x, [2, 2, 2])


# --- sharded experts over 2 ranks ------------------------------------------------------------------------

def _sharded_case(case, rank, world):
    """3 optimizer steps of sharded experts vs the single-process oracle on the global batch.

    On CUDA the experts' products run in the Triton kernels, whose fp32 summation order is not the
    oracle's (cuBLAS): there the data are small dyadic rationals and the loss is linear in y, so every
    product, sum and update is exact in fp32 in any order, and bit-exact comparison still holds (a lost
    or doubled contribution still shows)."""
    packed, delay, dev = case["packed"], case["delay"], case.get("device", "cpu")
    exact = case.get("exact", dev != "cpu")
    g = torch.Generator().manual_seed(0)
    if exact:  # multiples of 1/8 in [-1/2, 1/2]
        full_w = (torch.randint(-4, 5, (E, 5, D), generator=g) / 8).to(dev)
        full_b = (torch.randint(-4, 5, (E, 5), generator=g) / 8).to(dev)
    else:
        full_w = (torch.randn(E, 5, D, generator=g) * 0.3).to(dev)  # packed: 3 experts on 2 ranks -> 2 + 1
        full_b = (torch.randn(E, 5, generator=g) * 0.1).to(dev)

    def loss_of(y, r, step):
        if not exact:
            return y.tanh().square().mean()
        c = torch.randint(-3, 4, y.shape, generator=torch.Generator().manual_seed(100 * step + r)).to(dev)
        return (y * c).sum() / 8
    layer = GroupedLinear(E, D, 5, single_grouped_weight=packed, delay_wgrad_compute=delay, device=dev)
    if packed:
        layer.weight = ShardedWeight.from_full(full_w)
        layer.bias = distwgrad.ReplicatedWeight.from_full(full_b)
    else:
        for e in range(E):  # 5 rows per expert on 2 ranks -> 3 + 2 (uneven)
            setattr(layer, f"weight{e}", ShardedWeight.from_full(full_w[e]))
            setattr(layer, f"bias{e}", distwgrad.ReplicatedWeight.from_full(full_b[e]))
    oracle = torch.nn.ModuleList(torch.nn.Linear(D, 5) for _ in range(E)).to(dev)
    for e, lin in enumerate(oracle):
        lin.weight.data.copy_(full_w[e])
        lin.bias.data.copy_(full_b[e])
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    for step in range(3):
        gs = torch.Generator().manual_seed(10 + step)
        if exact:  # integers in [-4, 4]
            xs = [torch.randint(-4, 5, (9, D), generator=gs).float().to(dev) for _ in range(world)]
        else:
            xs = [torch.randn(9, D, generator=gs).to(dev) for _ in range(world)]
        splits = [[2, 0, 7], [4, 4, 1]]
        loss_of(layer(xs[rank], splits[rank]), rank, step).backward()
        layer.backward_dw()
        distwgrad.finalize_model_grads([layer])
        # Oracle: per-rank grads, reduced as the weights reduce: (g0 + g1) / 2.
        per_rank = [torch.autograd.grad(loss_of(_oracle_forward(oracle, xs[r], splits[r]), r, step),
                                        list(oracle.parameters())) for r in range(world)]
        for p, g0, g1 in zip(oracle.parameters(), *per_rank):
            p.grad = (g0 + g1) / 2
        want_w = torch.stack([lin.weight.grad for lin in oracle])
        if packed:
            rows = slice(layer.weight.shard_offset, layer.weight.shard_offset + layer.weight.shape[0])
            assert torch.equal(layer.weight.grad, want_w[rows]), (step, (layer.weight.grad - want_w[rows]).abs().max())
        else:
            for e in range(E):
                w = getattr(layer, f"weight{e}")
                want_e = want_w[e][w.shard_offset:w.shard_offset + w.shape[0]]
                assert torch.equal(w.grad, want_e), (e, step, (w.grad - want_e).abs().max())
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p in oracle.parameters():
                p -= 0.5 * p.grad
    want = torch.stack([lin.weight.detach() for lin in oracle])
    if packed:
        assert torch.equal(layer.weight.detach(), want[layer.weight.shard_offset:][: layer.weight.shape[0]])
    return True


def _sharded_rank(rank, world, cases):
    return for_each_case(cases, _sharded_case, rank, world)


@pytest.mark.distributed
def test_sharded_experts_match_single_process_after_three_steps():
    """Random data, and the exact-arithmetic data of the CUDA run (``exact``)."""
    cases = [dict(packed=p, delay=d, exact=x) for p, d, x in itertools.product([False, True], [False, True],
                                                                              [False, True])]
    assert run_distributed(_sharded_rank, 2, cases, timeout=300) == [[True] * 8] * 2


@pytest.mark.distributed
@pytest.mark.gpu
def test_sharded_experts_over_nccl():
    """The same with CUDA tensors over NCCL (skipped with fewer than two GPUs): the CUDA grouped GEMM
    path, and the oracle on the same GPU."""
    cases = [dict(packed=p, delay=d, device="cuda") for p, d in itertools.product([False, True], [False, True])]
    assert run_distributed(_sharded_rank, 2, cases, timeout=300, device="cuda") == [[True] * 4] * 2


def test_transformer_engine_constructor_and_forward_conventions():
    g = GroupedLinear(2, D, 4, init_method=torch.nn.init.ones_, return_bias=True, single_grouped_weight=True)
    assert torch.equal(g.weight, torch.ones(2, 4, D))
    x = torch.randn(5, D)
    out, biases = g(x, [2, 3], is_first_microbatch=False)
    assert len(biases) == 1 and biases[0] is g.bias  # returned, not added
    torch.testing.assert_close(out, x.sum(1, keepdim=True).expand(5, 4))  # a matmul vs a sum: rounding
    with pytest.raises(NotImplementedError, match="sequence_parallel"):
        GroupedLinear(2, D, 4, sequence_parallel=True)


@pytest.mark.parametrize("packed", [False, True])
def test_use_grouped_tensor_is_an_accepted_execution_hint(packed):
    """TE's ``use_grouped_tensor`` picks one of TE's two execution paths; distwgrad has one, so both
    settings build the same parameters and compute the same bits."""
    torch.manual_seed(0)
    a = GroupedLinear(2, D, 4, single_grouped_weight=packed, use_grouped_tensor=True, device="cpu")
    b = GroupedLinear(2, D, 4, single_grouped_weight=packed, use_grouped_tensor=False, device="cpu")
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
    b.load_state_dict(a.state_dict())
    x = torch.randn(5, D)
    ya, yb = a(x, torch.tensor([2, 3])), b(x, [2, 3])
    assert torch.equal(ya, yb)
    ya.sum().backward()
    yb.sum().backward()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa.grad, pb.grad)


def test_parameter_checks_rerun_when_a_parameter_changes():
    """[Note: per-call host work] in nn/_base.py, for GroupedLinear's packed and per-expert weights."""
    x = torch.randn(4, D)
    packed = GroupedLinear(2, D, D, bias=False, single_grouped_weight=True)
    packed(x, [2, 2])
    packed.weight = torch.nn.Parameter(torch.randn(3, D, D))
    with pytest.raises(ValueError, match=rf"weight full shapes \[\(3, {D}, {D}\)\], expected \[\(2, {D}, {D}\)\]"):
        packed(x, [2, 2])
    experts = GroupedLinear(2, D, D, bias=False)
    experts(x, [1, 3])
    experts.weight1 = ShardedWeight.from_full(torch.randn(D, D), param_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="parameters compute in different dtypes"):
        experts(x, [1, 3])
