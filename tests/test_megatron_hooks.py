"""``distwgrad.integrations.megatron``'s hook API: ``no_sync``, ``grad_sync_func`` / ``param_sync_func``
and ``register_grad_ready_hook``.

On two gloo ranks: Megatron's GTP bug (a weight used by three heads must get all three contributions
before its grad-ready hook fires) and the no_sync / grad_sync semantics; on one process: when a
grad-ready hook fires for parameters tied across deferring and non-deferring users, and that
``backward_dw()`` records no graph under grad mode. Data: ``megatron_cases.py``'s exact values.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from megatron_cases import H, K, _values
from torch import nn

from distwgrad import ReducePolicy, ShardedWeight
from distwgrad.integrations import megatron as dw_megatron
from distwgrad.nn import Linear
from distwgrad.testing.multiprocess import run_distributed

# --- Megatron's GTP bug: a weight used by three heads --------------------------------------------------

def _three_heads_rank(rank, world):
    g = torch.Generator().manual_seed(11)
    w_full, p_full = _values((H, K), g, True), _values((H, K), g, True)
    w = ShardedWeight.from_full(w_full)  # PER_MICROBATCH: reduces itself when its uses complete
    p = nn.Parameter(p_full.clone())
    heads = nn.ModuleList(Linear(K, H, bias=False, weight=w, delay_wgrad_compute=i == 1) for i in range(3))
    plain_heads = nn.ModuleList(Linear(K, H, bias=False, weight=p, delay_wgrad_compute=i == 1) for i in range(3))
    model = nn.ModuleDict(dict(heads=heads, plain_heads=plain_heads))
    data = [[(_values((4, K), g, True, 1.0, -1, 2), [_values((4, H), g, True) for _ in range(3)])
             for _ in range(2)] for _ in range(world)]  # [rank][microbatch] = (x, one c per head)
    seen = []
    handle = dw_megatron.register_grad_ready_hook([model], lambda name, q: seen.append(
        (name, (q.main_grad if isinstance(q, ShardedWeight) else q.grad).clone())))

    def loss_of(x, cs, weights):
        return sum((F.linear(x, wi) * c).sum() for wi, c in zip(weights, cs)) / 8

    # The schedule: microbatch 0 under no_sync, microbatch 1 outside, finalize.
    for i, (x, cs) in enumerate(data[rank]):
        ctx = dw_megatron.no_sync([model]) if i == 0 else contextlib.nullcontext()
        with ctx:
            # The plain heads see the same loss weights: a wgrad does not depend on the weight's values,
            # so the plain weight's gradient equals the sharded weight's.
            loss = sum((h(x) * c).sum() + (ph(x) * c).sum() for h, ph, c in zip(heads, plain_heads, cs)) / 8
            loss.backward()
            with torch.no_grad():
                heads[1].backward_dw()
                plain_heads[1].backward_dw()
    dw_megatron.finalize_model_grads([model])
    # Oracle: every head's contribution, every microbatch, every rank.
    ws = [nn.Parameter(w_full.clone()) for _ in range(3)]
    per_head = [torch.zeros(H, K) for _ in range(3)]
    local_plain = torch.zeros(H, K)
    for r in range(world):
        for x, cs in data[r]:
            grads = torch.autograd.grad(loss_of(x, cs, ws), ws)
            for acc, gr in zip(per_head, grads):
                acc += gr / world
            if r == rank:
                local_plain += sum(grads)
    want = sum(per_head)
    assert not torch.equal(want, per_head[2])  # the bug's result (last head only) would fail below
    assert [n for n, _ in seen] == ["heads.0.weight", "plain_heads.0.weight"]  # once each
    assert torch.equal(seen[0][1], want[w.shard_offset:w.shard_offset + w.shape[0]])  # complete at the hook
    assert torch.equal(w.grad, seen[0][1])
    assert torch.equal(seen[1][1], local_plain)  # this rank's three heads, before the data-parallel average
    assert torch.equal(p.grad, want)  # the data-parallel average of the plain weight
    handle.remove()
    assert "finalize_group_grads" not in w.__dict__
    return True


@pytest.mark.distributed
def test_weight_used_by_three_heads_gets_all_three_contributions():
    assert run_distributed(_three_heads_rank, 2, timeout=120) == [True, True]


# --- no_sync, grad_sync_func, param_sync_func on two ranks ---------------------------------------------

def _semantics_rank(rank, world):
    g = torch.Generator().manual_seed(5)
    w_full = _values((H, K), g, True)
    xs = [_values((4, K), g, True, 1.0, -1, 2) for _ in range(2 * world)]  # [use * world + rank]
    w = ShardedWeight.from_full(w_full, reduce_policy=ReducePolicy.PER_STEP)
    model = nn.Sequential(Linear(K, H, bias=False, weight=w))
    one = w.full_shape.numel() * 4  # bytes of one reduce-scatter

    # no_sync: nested and overlapping entries count per weight; an exception restores the policy.
    w.reduce_policy = ReducePolicy.PER_MICROBATCH
    with dw_megatron.no_sync([model]):
        with dw_megatron.no_sync(model):
            assert w.reduce_policy is ReducePolicy.PER_STEP
        assert w.reduce_policy is ReducePolicy.PER_STEP
    assert w.reduce_policy is ReducePolicy.PER_MICROBATCH
    with pytest.raises(RuntimeError, match="boom"), dw_megatron.no_sync([model]):
        raise RuntimeError("boom")
    assert w.reduce_policy is ReducePolicy.PER_MICROBATCH
    w.reduce_policy = ReducePolicy.PER_STEP

    # grad_sync_func: a no-op inside no_sync and while a use is pending; reduces once complete.
    base = w.bytes_reduced
    with dw_megatron.no_sync([model]):
        model(xs[rank]).sum().backward()
        dw_megatron.grad_sync_func(model.parameters())
    assert w.bytes_reduced == base
    y = model(xs[world + rank])  # a second use, not yet backpropagated
    dw_megatron.grad_sync_func(model.parameters())
    assert w.bytes_reduced == base and w.pending_contributions == 1
    y.sum().backward()
    dw_megatron.grad_sync_func(iter([w, w]))  # any iterable; duplicates count once
    assert w.bytes_reduced == base + one
    model(xs[rank]).sum().backward()  # one more use after the early reduction: buffered, reduced at finalize
    dw_megatron.finalize_model_grads([model])
    assert w.bytes_reduced == base + 2 * one
    # loss = y.sum(): each use's wgrad is ones(H, T) @ x; three uses per rank, averaged over ranks.
    want = sum(torch.ones(H, 4).mm(x) for r in range(world) for x in (xs[r], xs[world + r], xs[r])) / world
    assert torch.equal(w.grad, want[w.shard_offset:w.shard_offset + w.shape[0]])

    for fn in (dw_megatron.grad_sync_func, dw_megatron.param_sync_func):
        with pytest.raises(TypeError, match="single tensor of shape"):
            fn(w)
        with pytest.raises(TypeError, match=r"\(0, 'int'\)"):
            fn([1])
        fn(p for p in model.parameters())

    # A plain parameter Megatron marks expert-parallel must not be averaged over the data-parallel group.
    expert = Linear(K, H, bias=False)
    expert.weight.allreduce = False
    expert(xs[rank]).sum().backward()
    with pytest.raises(ValueError, match=r"\['weight'\] are marked allreduce=False"):
        dw_megatron.finalize_model_grads([expert])
    return True


@pytest.mark.distributed
def test_no_sync_and_grad_sync_semantics():
    assert run_distributed(_semantics_rank, 2, timeout=120) == [True, True]


# --- grad-ready hooks, single process ------------------------------------------------------------------

def test_grad_ready_plain_param_tied_across_deferring_and_not():
    w = nn.Parameter(torch.ones(H, H))
    model = nn.Sequential(Linear(H, H, bias=False, weight=w),
                          Linear(H, H, bias=False, weight=w, delay_wgrad_compute=True))
    fired = []
    handle = dw_megatron.register_grad_ready_hook([model], lambda name, p: fired.append((name, p.grad.clone())))
    x = torch.ones(2, H)
    for step in range(2):
        with dw_megatron.no_sync([model]):  # everything under no_sync: fires at finalize, once
            model(x).sum().backward()
            with torch.no_grad():
                model[1].backward_dw()
        assert fired == [] if step == 0 else len(fired) == 1
        model(x).sum().backward()
        assert len(fired) == step  # the deferred use is still queued: not ready
        with torch.no_grad():
            model[1].backward_dw()
        assert len(fired) == step + 1 and fired[-1][0] == "0.weight"
        dw_megatron.finalize_model_grads([model])
        assert len(fired) == step + 1  # not again at finalize
        w.grad = None
    handle.remove()
    assert not model[1].wgrad_accumulation_and_reduce_hooks and not hasattr(w, "_distwgrad_grad_ready")
    model(x).sum().backward()
    assert len(fired) == 2


def test_grad_ready_fires_at_finalize_when_the_whole_step_ran_under_no_sync():
    w = ShardedWeight.from_full(torch.ones(H, K))
    model = nn.Sequential(Linear(K, H, bias=False, weight=w))
    fired = []
    dw_megatron.register_grad_ready_hook([model], lambda name, p: fired.append(p.pending_contributions))
    with dw_megatron.no_sync([model]):
        model(torch.ones(2, K)).sum().backward()
    assert fired == []
    dw_megatron.finalize_model_grads([model])
    assert fired == [0]


def test_backward_dw_under_grad_mode_records_no_graph():
    a, b = Linear(K, H, delay_wgrad_compute=True), Linear(H, H, delay_wgrad_compute=True)
    for _ in range(2):
        b(a(torch.ones(2, K))).sum().backward()
        b.backward_dw()  # grad mode on, as a schedule calling backward_dw() from Python has it
        a.backward_dw()
    assert b.weight.grad.grad_fn is None and not b.weight.grad.requires_grad
