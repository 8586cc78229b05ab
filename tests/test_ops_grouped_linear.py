"""``ops.GroupedLinear`` (TransformerEngine's ``te.ops.GroupedLinear``) against a per-group ``torch.nn.Linear``
oracle: seed 000's contract on the fusible-ops path (tied weights and microbatches accumulate, both drain
orders, both ``zero_grad`` settings), seed 004's on distributed weights (2 and 3 gloo ranks), fused
``main_grad``, FP8 and ``ops.Sequential``.

Values are dyadic (small integers over powers of two), so every sum is exact in fp32 and the comparisons
are bit-exact whatever order the contributions arrive in.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

import distwgrad
import distwgrad.nn as te
from distwgrad import ShardedWeight
from distwgrad.fp8.recipe import PerTensorScaling, fp8_autocast
from distwgrad.testing.multiprocess import for_each_case, run_distributed

G, K, N = 3, 8, 8
SPLITS = [[3, 0, 5], [1, 6, 1]]


def _dyadic(shape, seed: int, scale: float = 1 / 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).float() * scale


def _op(*, packed=False, bias=True, delay=False, fuse=False, seed=0) -> te.ops.GroupedLinear:
    op = te.ops.GroupedLinear(G, K, N, bias=bias, device="cpu", single_grouped_weight=packed,
                              single_grouped_bias=packed, delay_wgrad_compute=delay, accumulate_into_main_grad=fuse)
    with torch.no_grad():
        for i, w in enumerate(op._weights()):
            w.copy_(_dyadic(w.shape, seed + i))
        for i, b in enumerate(op._biases()):
            b.copy_(_dyadic(b.shape, seed + 100 + i))
    return op


def _per_group(op) -> list[dict[str, torch.Tensor]]:
    ws = op.weight.unbind(0) if op.single_grouped_weight else op._weights()
    bs = (op.bias.unbind(0) if op.single_grouped_weight else op._biases()) if op.use_bias else [None] * G
    return [dict(weight=w, bias=b) for w, b in zip(ws, bs)]


def _oracle(ops, *, tied) -> list[nn.ModuleList]:
    out = []
    for op in ops:
        lins = nn.ModuleList(nn.Linear(K, N, bias=op.use_bias) for _ in range(G))
        for lin, vals in zip(lins, _per_group(op)):
            lin.weight.data.copy_(vals["weight"].detach())
            if op.use_bias:
                lin.bias.data.copy_(vals["bias"].detach())
        out.append(lins)
    if tied:
        for e in range(G):
            out[1][e].weight, out[1][e].bias = out[0][e].weight, out[0][e].bias
    return out


def _tie(ops) -> None:
    for name, p in list(ops[0].named_parameters()):
        setattr(ops[1], name, p)


def _oracle_forward(lins, x, splits):
    return torch.cat([lin(chunk) for lin, chunk in zip(lins, torch.split(x, splits))])


def _oracle_grads(oracle_op) -> list[dict[str, torch.Tensor]]:
    return [dict(weight=lin.weight.grad, bias=lin.bias.grad if lin.bias is not None else None) for lin in oracle_op]


def _grads(op) -> list[dict[str, torch.Tensor | None]]:
    if op.single_grouped_weight:
        gw = [None] * G if op.weight.grad is None else list(op.weight.grad.unbind(0))
        gb = ([None] * G if op.bias.grad is None else list(op.bias.grad.unbind(0))) if op.use_bias else [None] * G
    else:
        gw = [w.grad for w in op._weights()]
        gb = [b.grad for b in op._biases()] if op.use_bias else [None] * G
    return [dict(weight=w, bias=b) for w, b in zip(gw, gb)]


def _assert_equal(got, want, what):
    for e, (g, w) in enumerate(zip(got, want)):
        for kind in ("weight", "bias"):
            if w[kind] is None:
                continue
            assert g[kind] is not None, (what, e, kind)
            assert torch.equal(g[kind], w[kind]), (what, e, kind, (g[kind] - w[kind]).abs().max())


def _x(tokens, seed):
    return _dyadic((tokens, K), 1000 + seed, scale=1.0)


CASES = [dict(packed=p, bias=b, delay=d, tied=t, order=o, microbatches=m)
         for p, b, d, t, o, m in itertools.product([False, True], [False, True], [False, True], [False, True],
                                                   [(0, 1), (1, 0)], [1, 2])
         if d or o == (0, 1)]


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_matches_per_group_linear(case, set_to_none):
    """Two ops in a row, tied or not; microbatches; drained in either order; two steps with a reset."""
    ops = [_op(packed=case["packed"], bias=case["bias"], delay=case["delay"], seed=s) for s in (0, 50)]
    if case["tied"]:
        _tie(ops)
    params = list({id(p): p for op in ops for p in op.parameters()}.values())
    opt = torch.optim.SGD(params, lr=0.0)
    for step in range(2):
        oracle = _oracle(ops, tied=case["tied"])
        splits = SPLITS[: case["microbatches"]]
        for mb, s in enumerate(splits):
            x = _x(sum(s), 10 * step + mb)
            h = x
            for op in ops:
                h = op(h, torch.tensor(s))
            h.square().sum().backward()
            if case["delay"]:  # the biases' gradients came from the main backward, the weights' wait
                if mb == 0 and (step == 0 or set_to_none):
                    assert all(g["weight"] is None for g in _grads(ops[0]))
                if case["bias"]:
                    assert all(g["bias"] is not None for g in _grads(ops[0]))
                for i in case["order"]:
                    ops[i].backward_dw()
            h = x
            for lins in oracle:
                h = _oracle_forward(lins, h, s)
            h.square().sum().backward()
        for op, lins in zip(ops, oracle):
            _assert_equal(_grads(op), _oracle_grads(lins), (step, case))
        opt.zero_grad(set_to_none=set_to_none)


def test_names_order_init_and_hooks():
    op = te.ops.GroupedLinear(G, K, N, device="cpu", delay_wgrad_compute=True)
    names = [n for n, _ in op.named_parameters()]
    assert names == [f"weight{e}" for e in range(G)] + [f"bias{e}" for e in range(G)]  # TE's order
    assert [getattr(p, "skip_backward_post_hook", False) for p in op.parameters()] == [True] * G + [False] * G
    assert all(torch.equal(b, torch.zeros(N)) for b in op._biases())
    bound = 1 / math.sqrt(K)  # kaiming_uniform_(a=sqrt(5))
    assert all(w.abs().max() <= bound and w.std() > bound / 4 for w in op._weights())
    assert op.has_bias and op.num_groups == G and op.need_backward_dw()
    packed = te.ops.GroupedLinear(G, K, N, device="cpu", dtype=torch.bfloat16, single_grouped_weight=True,
                                  single_grouped_bias=True)
    assert [(n, tuple(p.shape), p.dtype) for n, p in packed.named_parameters()] == [
        ("weight", (G, N, K), torch.bfloat16), ("bias", (G, N), torch.bfloat16)]


def test_rng_state_tracker_forks_each_groups_init():
    forks = []

    class Tracker:
        def fork(self):
            forks.append(1)
            return torch.random.fork_rng()

    te.ops.GroupedLinear(G, K, N, device="cpu", rng_state_tracker_function=Tracker)
    assert len(forks) == G


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(single_grouped_weight=True), "single_grouped_weight=True with single_grouped_bias=False"),
    (dict(scale_bias=True), "scale_bias=True"),
    (dict(dtype=torch.float64), "dtype must be one of"),
    (dict(rng_state_tracker_function=3), "rng_state_tracker_function must be callable"),
])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        te.ops.GroupedLinear(G, K, N, device="cpu", **kwargs)


def test_reset_parameters_refuses_distributed_weights():
    op = _op()
    op.weight1 = ShardedWeight.from_full(torch.randn(N, K))
    with pytest.raises(ValueError, match="a distributed weight is initialised from its full value"):
        op.reset_parameters()


def test_split_sizes_forms():
    op = _op()
    x = _x(8, 0)
    y = op(x, [3, 0, 5])
    for splits in (torch.tensor([3, 0, 5]), torch.tensor([3, 0, 5], dtype=torch.int32)):
        assert torch.equal(op(x, splits), y)
    with pytest.raises(ValueError, match="m_splits must have 3 entries"):
        op(x, torch.tensor([3, 5]))


@pytest.mark.parametrize("megatron", [False, True])
@pytest.mark.parametrize("delay", [False, True])
def test_accumulate_into_main_grad(delay, megatron):
    op = _op(delay=delay, fuse=True)
    for w in op._weights():
        w.main_grad = torch.full(w.shape, 0.5)
        if megatron:
            w.grad_added_to_main_grad = False
    (oracle,) = _oracle([op], tied=False)
    x = _x(8, 3)
    op(x, SPLITS[0]).square().sum().backward()
    op.backward_dw()
    _oracle_forward(oracle, x, SPLITS[0]).square().sum().backward()
    for w, lin, b in zip(op._weights(), oracle, op._biases()):
        assert torch.equal(w.main_grad, lin.weight.grad + 0.5)
        assert torch.equal(b.grad, lin.bias.grad)
        if megatron:
            assert w.grad_added_to_main_grad is True and torch.equal(w.grad, torch.zeros_like(w))
        else:
            assert w.grad is None and not hasattr(w, "grad_added_to_main_grad")
    op.weight1.overwrite_main_grad = True
    with pytest.raises(ValueError, match="overwrite_main_grad=True"):
        op(x, SPLITS[0])


@pytest.mark.parametrize("packed", [False, True])
def test_fp8_matches_the_grouped_linear_module(packed):
    """Under a recipe the ops path runs the module's FP8 GEMMs: the same outputs and gradients, bit for bit."""
    op = _op(packed=packed, delay=True)
    ref = te.GroupedLinear(G, K, N, device="cpu", single_grouped_weight=packed, delay_wgrad_compute=True)
    ref.load_state_dict(op.state_dict())
    x = torch.randn(8, K)
    with fp8_autocast(PerTensorScaling()):
        y_op, y_ref = op(x, SPLITS[0]), ref(x, SPLITS[0])
    with torch.no_grad():
        y_plain = op(x, SPLITS[0])  # no recipe
    assert torch.equal(y_op, y_ref) and not torch.equal(y_op, y_plain)
    for y, m in ((y_op, op), (y_ref, ref)):
        y.square().sum().backward()
        m.backward_dw()
    for (n, p), (_, q) in zip(sorted(op.named_parameters()), sorted(ref.named_parameters())):
        assert torch.equal(p.grad, q.grad), n


def test_compiled_matches_eager():
    eager, compiled = _op(delay=True), _op(delay=True)
    run = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    x = _x(8, 4)
    for fwd, op in ((eager, eager), (run, compiled)):
        fwd(x, SPLITS[0]).square().sum().backward()
        assert op.bias0.grad is not None and op.weight0.grad is None  # biases from the main backward
        op.backward_dw()
    for (n, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_sequential_hands_each_op_its_split_sizes():
    a, b = _op(seed=0), _op(seed=7)
    seq = te.ops.Sequential(a, nn.Tanh(), b)
    x = _x(8, 5)
    want = b(torch.tanh(a(x, SPLITS[0])), SPLITS[1])
    assert torch.equal(seq(x, torch.tensor(SPLITS[0]), torch.tensor(SPLITS[1])), want)
    with pytest.raises(ValueError, match="module 2 .* takes 1 extra inputs, 0 are left of the 1 given"):
        seq(x, SPLITS[0])
    with pytest.raises(ValueError, match="1 of the 3 extra inputs were not taken"):
        seq(x, SPLITS[0], SPLITS[1], SPLITS[1])


def _distributed_case(case, rank, world):
    """Sharded weights (per group, or packed over the groups) and plain biases on ``world`` ranks: after
    finalize each rank's shard holds the oracle's gradient averaged over the ranks, and the biases the
    average (finalize reduces plain parameters beside the weights)."""
    op = _op(packed=case["packed"], delay=case["delay"], seed=1)
    full = [w.detach().clone() for w in op._weights()]
    if case["packed"]:
        op.weight = ShardedWeight.from_full(full[0])
    else:
        for e, f in enumerate(full):
            setattr(op, f"weight{e}", ShardedWeight.from_full(f))
    (oracle,) = _oracle([_op(packed=case["packed"], seed=1)], tied=False)
    splits = [[2, 3, 3], [0, 8, 0], [5, 1, 2]]
    xs = [_x(8, 20 + r) for r in range(world)]
    for _ in range(2):  # microbatches
        op(xs[rank], torch.tensor(splits[rank])).square().sum().backward()
        op.backward_dw()
    distwgrad.finalize_model_grads([op])
    for r in range(world):
        for _ in range(2):
            _oracle_forward(oracle, xs[r], splits[r]).square().sum().backward()
    for e, lin in enumerate(oracle):
        want_w, want_b = lin.weight.grad / world, lin.bias.grad / world
        if case["packed"]:
            w = op.weight
            got = w.grad[e - w.shard_offset] if w.shard_offset <= e < w.shard_offset + w.shape[0] else None
            want = want_w
        else:
            w = getattr(op, f"weight{e}")
            got, want = w.grad, want_w[w.shard_offset:w.shard_offset + w.shape[0]]
        if got is not None:
            assert torch.equal(got, want), (e, (got - want).abs().max())
        got_b = op.bias.grad[e] if case["packed"] else getattr(op, f"bias{e}").grad
        assert torch.equal(got_b, want_b), e
    return True


def _distributed_rank(rank, world, cases):
    return for_each_case(cases, _distributed_case, rank, world)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_distributed_weights(world):
    cases = [dict(packed=p, delay=d) for p, d in itertools.product([False, True], [False, True])]
    assert run_distributed(_distributed_rank, world, cases, timeout=300) == [[True] * len(cases)] * world
