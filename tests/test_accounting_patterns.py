"""PyTorch's gradient semantics under the contribution accounting ([Note: contribution accounting]).

Each pattern runs the same code on a distwgrad model and on a plain-torch twin (same weights, same ops,
``.grad`` accumulated by autograd); the distwgrad gradient must equal torch's. Patterns: a forward whose
output is never backpropagated (a metric), two backwards through one retained graph, a graph kept
across a step, and errors followed by ``finalize_model_grads(..., discard=True)``, after which the next
step must match a fresh model. Errors name weights by their path in the model. One process (a group of
one, where every reduction is the identity: bit-exact) and 2 gloo ranks (a sweep in one spawn).
"""

from __future__ import annotations

import gc
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distwgrad
from distwgrad import ReducePolicy, ReplicatedWeight, ShardedWeight
from distwgrad.nn import Linear
from distwgrad.testing import sweep
from distwgrad.testing.multiprocess import for_each_case, run_distributed
from distwgrad.wgrad.finalize import name_weights

K = 6  # square weights, so one weight can be tied across both blocks
QKV0, QKV1 = "blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight"


class _Attn(nn.Module):
    def __init__(self, weight, delay: bool) -> None:
        super().__init__()
        self.qkv = Linear(K, K, bias=False, weight=weight, delay_wgrad_compute=delay)


class _Block(nn.Module):
    def __init__(self, weight, delay: bool) -> None:
        super().__init__()
        self.attn = _Attn(weight, delay)


class _Net(nn.Module):
    """Two blocks; with ``tied`` both use one weight. ``forward`` is the same function as ``_Ref``'s."""

    def __init__(self, weights, delay: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(w, delay) for w in weights])

    def forward(self, x):
        return self.blocks[1].attn.qkv(self.blocks[0].attn.qkv(x).tanh())

    def drain(self) -> None:
        distwgrad.drain_deferred_wgrads(self)


class _Ref(nn.Module):
    def __init__(self, weights) -> None:
        super().__init__()
        self.ws = weights

    def forward(self, x):
        return F.linear(F.linear(x, self.ws[0]).tanh(), self.ws[1])

    def drain(self) -> None:
        pass


def _full(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(K, K, generator=g) * 0.5 for _ in range(2)]


def _pair(case):
    """The distwgrad model and its torch twin, and (ours, theirs) per distinct weight."""
    full = _full()
    n_distinct = 1 if case["tied"] else 2
    kw = dict(reduce_policy=ReducePolicy(case.get("policy", "per_microbatch")), async_reduce=case.get("async", False))
    make = ShardedWeight.from_full if case["kind"] == "sharded" else ReplicatedWeight.from_full
    ours = [make(full[i], **kw) for i in range(n_distinct)]
    theirs = [nn.Parameter(full[i].clone()) for i in range(n_distinct)]
    pick = [0, 0] if case["tied"] else [0, 1]
    return (_Net([ours[i] for i in pick], case["delay"]), _Ref([theirs[i] for i in pick]), list(zip(ours, theirs)))


def _x(seed, rows=4):
    return torch.randn(rows, K, generator=torch.Generator().manual_seed(seed))


# --- the patterns: each runs on either model, as plain torch code would --------------------------------

def _metric_forward(model, seed):
    logged = model(_x(seed)).square().mean().item()  # grad enabled, never backpropagated
    _ = model(_x(seed + 1)).detach()  # a kept value, detached: its graph goes at once
    del logged
    model(_x(seed + 2)).square().sum().backward()
    model.drain()


def _retained_graph(model, seed):
    y = model(_x(seed))
    y.square().sum().backward(retain_graph=True)
    model.drain()
    y.sum().backward()  # a second loss through the same graph: torch accumulates both
    model.drain()


def _retained_deferred_queued_twice(model, seed):
    y = model(_x(seed))
    y.square().sum().backward(retain_graph=True)
    y.sum().backward()  # two queued wgrads of one use, drained after both backwards
    model.drain()


def _microbatches_with_a_metric_between(model, seed):
    for m in range(3):
        model(_x(seed + m)).square().sum().backward()
        model.drain()
        model(_x(seed + 10 + m)).sum().item()


PATTERNS = {"metric_forward": _metric_forward, "retained_graph": _retained_graph,
            "retained_deferred_queued_twice": _retained_deferred_queued_twice,
            "microbatches_with_a_metric_between": _microbatches_with_a_metric_between}


def _check_grads(pairs, world=1, rank=0, exact=True):
    for ours, theirs in pairs:
        want = theirs.grad
        if isinstance(ours, ShardedWeight):
            want = want[ours.shard_offset:ours.shard_offset + ours.shape[0]]
        if exact:
            assert torch.equal(ours.grad, want), (ours.grad - want).abs().max()
        else:  # several reductions of an fp32 sum over ranks in another order: a few ulps
            bound = 8 * torch.finfo(torch.float32).eps * want.abs().max()
            assert (ours.grad - want).abs().max() <= bound


def _one_process_case(case):
    net, ref, pairs = _pair(case)
    PATTERNS[case["pattern"]](net, 1)
    PATTERNS[case["pattern"]](ref, 1)
    assert distwgrad.finalize_model_grads(net) == len(pairs)
    # A tied weight sums its two uses in another order than autograd: per use into one buffer across
    # microbatches (PER_STEP), or per use again on a retained graph's second backward (the Note's rule),
    # where torch adds each backward's pair first. Equal up to fp32 rounding; untied weights are exact.
    _check_grads(pairs, exact=not case["tied"])


ONE_PROCESS = [dict(kind=k, tied=t, delay=d, pattern=p, policy=pol)
               for k, t, d, p, pol in itertools.product(["sharded", "replicated"], [False, True], [False, True],
                                                        PATTERNS, ["per_microbatch", "per_step"])]


@pytest.mark.parametrize("case", ONE_PROCESS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_patterns_match_torch(case):
    _one_process_case(case)


def test_retained_graph_across_a_step_counts_where_its_backward_runs():
    net, ref, pairs = _pair(dict(kind="sharded", tied=True, delay=False))
    y_net, y_ref = net(_x(0)), ref(_x(0))
    for y in (y_net, y_ref):
        y.square().sum().backward(retain_graph=True)
    assert distwgrad.finalize_model_grads(net) == 1
    _check_grads(pairs)
    for ours, theirs in pairs:
        ours.grad = theirs.grad = None
    for y in (y_net, y_ref):  # step 2 has no forward, only a backward through step 1's graph
        y.sum().backward()
    assert distwgrad.finalize_model_grads(net) == 1
    _check_grads(pairs)


# --- errors: named by path, with cause and fix, and the next step starts clean ---------------------------

def _next_step_is_clean(net, ref, pairs):
    for ours, theirs in pairs:
        ours.grad = theirs.grad = None
    for model in (net, ref):
        model(_x(7)).square().sum().backward()
        model.drain()
    assert distwgrad.finalize_model_grads(net) == len(pairs)
    _check_grads(pairs)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("delay", [False, True])
def test_held_output_is_missing_named_by_path_then_discard(tied, delay):
    net, ref, pairs = _pair(dict(kind="sharded", tied=tied, delay=delay))
    kept = net(_x(0))  # a grad-enabled output kept alive: its use is still owed
    name = f"{QKV0} = {QKV1}" if tied else QKV0
    with pytest.raises(distwgrad.MissingContributionError, match=rf"{name}: \d of \d missing.*detach.*discard=True"):
        distwgrad.finalize_model_grads(net)
    assert distwgrad.finalize_model_grads(net, discard=True) == 0
    del kept
    _next_step_is_clean(net, ref, pairs)


@pytest.mark.parametrize("tied", [False, True])
def test_undrained_deferred_wgrad_is_still_caught_then_discard(tied):
    net, ref, pairs = _pair(dict(kind="sharded", tied=tied, delay=True))
    net(_x(0)).square().sum().backward()  # the graph is freed; the queued wgrads hold the uses
    gc.collect()
    undrained = r"never drained.*discard=True.*'blocks\.0\.attn\.qkv'"
    with pytest.raises(distwgrad.MissingContributionError, match=undrained):
        distwgrad.finalize_model_grads(net)
    assert all(ours.pending_contributions for ours, _ in pairs)
    distwgrad.finalize_model_grads(net, discard=True)
    assert not net.blocks[0].attn.qkv.pending_backward_dw
    _next_step_is_clean(net, ref, pairs)


def test_error_inside_backward_names_the_weight_then_discard():
    from torch.utils.checkpoint import checkpoint

    net, ref, pairs = _pair(dict(kind="replicated", tied=False, delay=False))
    name_weights(net)
    x = _x(0).requires_grad_()
    with pytest.raises(RuntimeError, match=rf"{QKV1} \(.*use_reentrant=False.*discard=True"):
        checkpoint(net, x, use_reentrant=True).sum().backward()
    with pytest.raises(distwgrad.MissingContributionError, match=rf"{QKV1}: 1 arrived for 0 recorded uses"):
        distwgrad.finalize_model_grads(net)
    distwgrad.finalize_model_grads(net, discard=True)
    _next_step_is_clean(net, ref, pairs)


# --- two ranks ----------------------------------------------------------------------------------------

def _two_rank_case(case, rank, world):
    net, ref, pairs = _pair(case)
    PATTERNS[case["pattern"]](net, 100 * rank)
    for r in range(world):  # the reference: every rank's gradient, averaged
        PATTERNS[case["pattern"]](ref, 100 * r)
    for _, theirs in pairs:
        theirs.grad /= world
    assert distwgrad.finalize_model_grads(net) == len(pairs)
    _check_grads(pairs, world, rank, exact=False)
    kept = net(_x(5))  # an error, then discard, then a clean step (same on every rank)
    with pytest.raises(distwgrad.MissingContributionError, match=QKV0):
        distwgrad.finalize_model_grads(net)
    distwgrad.finalize_model_grads(net, discard=True)
    del kept
    for ours, theirs in pairs:
        ours.grad = theirs.grad = None
    net(_x(7 + rank)).square().sum().backward()
    net.drain()
    for r in range(world):
        ref(_x(7 + r)).square().sum().backward()
    for _, theirs in pairs:
        theirs.grad /= world
    distwgrad.finalize_model_grads(net)
    _check_grads(pairs, world, rank, exact=False)


def _two_rank_sweep(rank, world, cases):
    for_each_case(cases, _two_rank_case, rank, world)


@pytest.mark.distributed
def test_patterns_match_torch_on_two_ranks():
    grid = dict(kind=["sharded", "replicated"], tied=[False, True], delay=[False, True], pattern=list(PATTERNS),
                policy=["per_microbatch", "per_step"], **{"async": [False, True]})
    cases = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    run_distributed(_two_rank_sweep, 2, sweep.sample(cases, 16), timeout=300)  # all 64 with --full
