"""Sharded and replicated weights against a single-process ``torch.nn`` reference (gloo, 2 and 3 ranks).

Each rank trains on its own slice of a global batch; the weights' default reduction is the average over
the group. The reference computes each rank's gradients with plain ``torch.nn.Linear`` modules and
combines them in the order the weights reduce ([Note: contribution accounting] in weights/base.py):
per microbatch, ``sum over ranks / world``, added to the step's gradient. With 2 ranks that order is
exact (a two-term sum is commutative and dividing by 2 is exact), so 2-rank comparisons are bit-exact.
With 3 ranks gloo's summation order of three terms is its own and ``/3`` rounds, so 3-rank comparisons
allow, elementwise, 6 fp32 epsilons of ``S``, the sum over microbatches of ``sum over ranks |term| / world``: each
order's three-term sum errs by at most ``2u S``, the division by ``u S``, the microbatches' additions by ``3u S``
(u = eps / 2), and the two orders differ by at most twice that. The terms' magnitudes, not the result's: ranks'
gradients can cancel. Each 3-rank step starts from the reference's weights, so no earlier step's rounding
reaches its gradients. The 2-rank sweep also runs with CUDA tensors over NCCL
where two GPUs are present (``gpu``-marked): the reference then runs on the same GPU, so the same
argument makes it bit-exact there too.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import distwgrad
from distwgrad import ReducePolicy, ReplicatedWeight, ShardedWeight
from distwgrad.nn import Linear
from distwgrad.testing.multiprocess import for_each_case, run_distributed

pytestmark = pytest.mark.distributed

K, N, B = 8, 10, 8  # in-features, out-features (10 rows: uneven on 3 ranks), tokens per rank


def _full_params(seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    full = {
        "w0": torch.randn(N, K, generator=g) * 0.3, "b0": torch.randn(N, generator=g) * 0.1,
        "w1": torch.randn(N, N, generator=g) * 0.3, "b1": torch.randn(N, generator=g) * 0.1,
        "w2": torch.randn(N, N, generator=g) * 0.3, "b2": torch.randn(N, generator=g) * 0.1,
    }
    return {k: v.to(device) for k, v in full.items()}


def _wrap(kind, t, policy, async_reduce=False):
    if kind == "sharded" and t.dim() == 2:
        return ShardedWeight.from_full(t, reduce_policy=policy, async_reduce=async_reduce)
    return ReplicatedWeight.from_full(t, reduce_policy=policy, async_reduce=async_reduce)


def _build(case, full):
    """Linear(K,N) -> Linear(N,N) -> Linear(N,N); with ``tied`` the last two share weight and bias."""
    policy = ReducePolicy(case["policy"])
    kw = dict(delay_wgrad_compute=case["delay"], fuse_wgrad_accumulation=case["fuse"])
    p = {k: _wrap(case["kind"], v, policy, case["async"]) for k, v in full.items()}
    layers = [Linear(K, N, weight=p["w0"], bias=p["b0"], **kw), Linear(N, N, weight=p["w1"], bias=p["b1"], **kw)]
    if case["tied"]:
        layers.append(Linear(N, N, weight=p["w1"], bias=p["b1"], **kw))
    else:
        layers.append(Linear(N, N, weight=p["w2"], bias=p["b2"], **kw))
    return torch.nn.Sequential(*layers)


def _reference(case, full):
    ref = torch.nn.Sequential(torch.nn.Linear(K, N), torch.nn.Linear(N, N), torch.nn.Linear(N, N)).to(
        case.get("device", "cpu"))
    names = [("w0", "b0"), ("w1", "b1"), ("w1", "b1") if case["tied"] else ("w2", "b2")]
    params = {k: torch.nn.Parameter(v.clone()) for k, v in full.items()}
    for layer, (w, b) in zip(ref, names):
        layer.weight, layer.bias = params[w], params[b]
    return ref, params


def _loss(model, x, microbatches):
    return model(x).tanh().square().mean() / microbatches


def _reference_step(case, ref, params, xs, world):
    """Gradients in the weights' reduction order, the sums of their terms' magnitudes (``S`` of the module
    docstring) and the per-rank losses."""
    mbs = case["microbatches"]
    total = {k: None for k in params}
    magnitude = {k: 0 for k in params}
    losses = [0.0] * world
    chunks = [torch.chunk(x, mbs) for x in xs]
    for m in range(mbs):
        per_rank = []
        for r in range(world):
            loss = _loss(ref, chunks[r][m], mbs)
            losses[r] += loss.item()
            per_rank.append(torch.autograd.grad(loss, list(params.values()), allow_unused=True))
        for i, k in enumerate(params):
            terms = [g[i] for g in per_rank if g[i] is not None]
            if not terms:
                continue
            reduced = terms[0]
            for t in terms[1:]:
                reduced = reduced + t
            reduced = reduced / world
            total[k] = reduced if total[k] is None else total[k] + reduced
            magnitude[k] = magnitude[k] + sum(t.abs() for t in terms) / world
    return total, magnitude, losses


def _local_rows(p):
    return slice(p.shard_offset, p.shard_offset + p.shape[0]) if isinstance(p, ShardedWeight) else slice(None)


def _parity_case(case, rank, world):
    dev = case.get("device", "cpu")
    full = _full_params(device=dev)
    model = _build(case, full)
    ref, ref_params = _reference(case, full)
    ours = dict(zip(ref_params, [model[0].weight, model[0].bias, model[1].weight, model[1].bias,
                                 model[2].weight, model[2].bias]))
    opt = torch.optim.SGD(list({id(p): p for p in model.parameters()}.values()), lr=0.5)
    ref_opt = torch.optim.SGD(list(ref_params.values()), lr=0.5)
    exact = world == 2
    for step in range(3):
        g = torch.Generator().manual_seed(100 + step)
        xs = [torch.randn(B, K, generator=g).to(dev) for _ in range(world)]
        ref_grads, ref_magnitude, ref_losses = _reference_step(case, ref, ref_params, xs, world)
        loss_sum = 0.0
        for microbatch in torch.chunk(xs[rank], case["microbatches"]):
            loss = _loss(model, microbatch, case["microbatches"])
            loss.backward()
            loss_sum += loss.item()
            if case["delay"]:
                distwgrad.drain_deferred_wgrads(model)
        assert loss_sum == pytest.approx(ref_losses[rank], rel=0, abs=0) if exact else True
        assert distwgrad.finalize_model_grads([model]) > 0
        assert distwgrad.finalize_model_grads([model]) == 0  # a second call is a no-op
        for name, p in ours.items():
            if case["tied"] and name in ("w2", "b2"):
                continue
            want = ref_grads[name][_local_rows(p)]
            assert p.main_grad.dtype == torch.float32
            for got in (p.grad, p.main_grad):
                if exact:
                    assert torch.equal(got, want), (name, step, (got - want).abs().max())
                else:
                    bound = 6 * torch.finfo(torch.float32).eps * ref_magnitude[name][_local_rows(p)]
                    assert ((got - want).abs() <= bound).all(), (name, step, ((got - want).abs() / bound).max())
        for name, p in ref_params.items():
            p.grad = ref_grads[name]
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        ref_opt.zero_grad()
        for name, p in ours.items():
            if case["tied"] and name in ("w2", "b2"):
                assert p is ours[name.replace("2", "1")]  # still one object
                continue
            want = ref_params[name].detach()[_local_rows(p)]
            if exact:
                assert torch.equal(p.detach(), want), (name, step)
            else:
                assert torch.allclose(p.detach(), want, rtol=0, atol=1e-6), (name, step)
                with torch.no_grad():  # the next step starts from the same weights: only the orders differ
                    p.copy_(want)


def _parity_rank(rank, world, cases):
    for_each_case(cases, _parity_case, rank, world)


def _cases(**fixed):
    grid = dict(kind=["sharded", "replicated"], tied=[False, True], delay=[False, True], fuse=[False, True],
                microbatches=[1, 4], policy=["per_microbatch", "per_step"], **{"async": [False, True]})
    grid.update({k: [v] for k, v in fixed.items()})
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def _policy_matches_order(case):
    # The reference sums per microbatch then over the step; PER_STEP sums the step first. Those agree
    # exactly only with one microbatch, so PER_STEP runs with microbatches=1 in the exact sweep.
    return case["policy"] == "per_microbatch" or case["microbatches"] == 1


def test_parity_two_ranks_bit_exact():
    cases = [c for c in _cases() if _policy_matches_order(c)]
    run_distributed(_parity_rank, 2, cases, timeout=300)


@pytest.mark.gpu
def test_parity_two_ranks_bit_exact_over_nccl():
    """The 2-rank sweep with CUDA tensors, over NCCL (skipped with fewer than two GPUs)."""
    cases = [dict(c, device="cuda") for c in _cases() if _policy_matches_order(c)]
    run_distributed(_parity_rank, 2, cases, timeout=300, device="cuda")


def test_parity_three_ranks_uneven_shards():
    cases = [c for c in _cases(fuse=False, policy="per_microbatch")]
    run_distributed(_parity_rank, 3, cases, timeout=300)


def _async_overlap_rank(rank, world, dev="cpu"):
    """An async reduction is in flight after backward and lands in main_grad when the step ends."""
    w = ShardedWeight.from_full(torch.ones(N, K, device=dev), async_reduce=True)
    lin = Linear(K, N, bias=False, weight=w)
    lin(torch.ones(2, K, device=dev)).sum().backward()
    assert len(w._life.inflight) == 1 and (not hasattr(w, "main_grad") or not w.main_grad.any())
    assert distwgrad.finalize_model_grads([lin]) == 1 and not w._life.inflight
    return torch.equal(w.grad, torch.full_like(w, 2.0)) and torch.equal(w.main_grad, w.grad)


def test_async_reductions_land_at_the_end_of_the_step():
    assert run_distributed(_async_overlap_rank, 2, timeout=120) == [True, True]


# --- accounting and errors -----------------------------------------------------------------------------

def _missing_backward_dw_rank(rank, world, dev="cpu"):
    w = ShardedWeight.from_full(torch.randn(N, K, generator=torch.Generator().manual_seed(0)).to(dev))
    model = torch.nn.Sequential(Linear(K, N, bias=False, weight=w, delay_wgrad_compute=True))
    model(torch.randn(3, K, device=dev)).sum().backward()
    with pytest.raises(distwgrad.MissingContributionError, match=r"never drained.*Linear '0'.*1 queued"):
        distwgrad.finalize_model_grads([model])
    model[0].backward_dw()
    assert distwgrad.finalize_model_grads([model]) == 1
    # A forward whose backward never ran, while its graph is alive, is a missing contribution too
    # (a dropped graph withdraws its use: tests/test_accounting_patterns.py).
    kept = model(torch.randn(3, K, device=dev))
    with pytest.raises(distwgrad.MissingContributionError, match=r"0.weight: 1 of 1"):
        distwgrad.finalize_model_grads([model])
    del kept
    return True


def test_finalize_refuses_missing_contributions():
    assert run_distributed(_missing_backward_dw_rank, 2, timeout=120) == [True, True]


def _shape_mismatch_rank(rank, world, dev="cpu"):
    full = torch.zeros(N + rank, K, device=dev)
    with pytest.raises(ValueError, match=r"ranks disagree on the full tensor.*\(10, 8\).*\(11, 8\)"):
        ShardedWeight.from_full(full)
    return True


def test_group_disagreeing_on_shapes_raises_on_every_rank():
    assert run_distributed(_shape_mismatch_rank, 2, timeout=120) == [True, True]


def _uneven_layout_rank(rank, world):
    full = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3)
    w = ShardedWeight.from_full(full)
    assert w.shard_rows == [4, 4, 2]  # torch.chunk / DTensor Shard(0) layout
    assert torch.equal(w.detach(), full[w.shard_offset:w.shard_offset + w.shape[0]])
    assert torch.equal(w.materialize_group_for_forward()[0], full)
    tiny = ShardedWeight.from_full(full[:2])  # rank 2 holds zero rows
    assert tiny.shape[0] == [1, 1, 0][rank]
    assert torch.equal(tiny.materialize_group_for_backward()[0], full[:2])
    return tuple(w.shape)


def test_uneven_shards_gather_exactly():
    assert run_distributed(_uneven_layout_rank, 3, timeout=120) == [(4, 3), (4, 3), (2, 3)]


def _fp32_reduction_rank(rank, world, dev="cpu"):
    """bf16 weights reduce in fp32: the sum of two bf16 wgrads that bf16 cannot hold survives."""
    w = ShardedWeight.from_full(torch.zeros(2, 1, dtype=torch.bfloat16, device=dev))
    buf = w.grad_buffer()
    assert buf.dtype == torch.float32 and buf.shape == (2, 1)
    w.expect_contribution()
    buf.fill_(1.0 if rank == 0 else 2.0 ** -9)  # 1 + 2^-9 is not a bf16 number
    w.finalize_group_grads([buf])
    assert w.main_grad.dtype == torch.float32
    assert w.main_grad.item() == (1.0 + 2.0 ** -9) / 2
    return True


def test_reduction_runs_in_fp32():
    assert run_distributed(_fp32_reduction_rank, 2, timeout=120) == [True, True]


def _token_scaling_rank(rank, world, dev="cpu"):
    w = ReplicatedWeight.from_full(torch.zeros(3, device=dev))
    w.expect_contribution()
    w.grad_buffer().fill_(float(rank + 1))  # per-rank SUM of per-token grads
    w.finalize_group_grads([w.grad_buffer()])
    distwgrad.finalize_model_grads([torch.nn.ParameterList([w])], num_tokens=rank + 2)  # 2 + 3 tokens
    return w.grad.tolist()


def test_num_tokens_scaling_matches_megatron():
    # Megatron: sum over ranks of the per-token-summed grads / total tokens = (1 + 2) / 5.
    expected = torch.full((3,), 3.0) * (2 / 5) / 2  # the same fp32 operations: average, then * world/tokens
    for got in run_distributed(_token_scaling_rank, 2, timeout=120):
        assert got == expected.tolist()


def _per_group_scaling_rank(rank, world, dev="cpu"):
    """Token scaling uses each weight's own group: a world-group weight and a one-rank-group weight."""
    import torch.distributed as dist

    solo_groups = [dist.new_group([r]) for r in range(world)]
    a = ReplicatedWeight.from_full(torch.zeros(2, device=dev))
    b = ReplicatedWeight.from_full(torch.zeros(2, device=dev), group=solo_groups[rank])
    for w in (b, a):  # b first: the first weight's group must not decide for the others
        w.expect_contribution()
        w.grad_buffer().fill_(1.0)
        w.finalize_group_grads([w.grad_buffer()])
    distwgrad.finalize_model_grads([torch.nn.ParameterList([b, a])], num_tokens=4)
    return a.grad.tolist(), b.grad.tolist()


def test_num_tokens_scaling_is_per_group():
    # a: (1 + 1) / 8 tokens over 2 ranks; b: 1 / 4 tokens on its own rank.
    assert run_distributed(_per_group_scaling_rank, 2, timeout=120) == [([0.25, 0.25], [0.25, 0.25])] * 2


def _accounting_rank(rank, world, dev):
    """The accounting and reduction checks above on one device, in one spawn."""
    return [_async_overlap_rank(rank, world, dev), _missing_backward_dw_rank(rank, world, dev),
            _shape_mismatch_rank(rank, world, dev), _fp32_reduction_rank(rank, world, dev),
            _token_scaling_rank(rank, world, dev), _per_group_scaling_rank(rank, world, dev)]


@pytest.mark.gpu
def test_accounting_and_reductions_over_nccl():
    """With CUDA tensors over NCCL (skipped with fewer than two GPUs): async reductions land at the end
    of the step, missing contributions are refused, ranks disagreeing on shapes fail on every rank,
    reductions run in fp32, token scaling per group; the same results as on gloo."""
    want = [True, True, True, True, (torch.full((3,), 3.0) * (2 / 5) / 2).tolist(), ([0.25, 0.25], [0.25, 0.25])]
    assert run_distributed(_accounting_rank, 2, "cuda", timeout=180, device="cuda") == [want] * 2


def test_activation_checkpointing_counts_each_use_once():
    """Non-reentrant checkpointing recomputes the forward inside backward: still one contribution."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    full = torch.randn(N, K)
    x = torch.randn(4, K)
    for delay in (False, True):
        w = ReplicatedWeight.from_full(full)
        lin = Linear(K, N, bias=False, weight=w, delay_wgrad_compute=delay)
        checkpoint(lin, x, use_reentrant=False).square().sum().backward()
        distwgrad.drain_deferred_wgrads(lin)
        assert distwgrad.finalize_model_grads([lin]) == 1
        ref = torch.nn.Linear(K, N, bias=False)
        ref.weight.data.copy_(full)
        ref(x).square().sum().backward()
        assert torch.equal(w.grad, ref.weight.grad)
    w = ReplicatedWeight.from_full(full)
    lin = Linear(K, N, bias=False, weight=w)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        checkpoint(lin, x.requires_grad_(), use_reentrant=True).sum().backward()
