"""``distwgrad.integrations.megatron`` driven the way megatron-core's schedules drive it.

The model (legend: K in-features, H hidden, E experts, T tokens of a microbatch, M microbatches, W ranks)
is ``Linear(K,H) -> relu -> GroupedLinear(E,H,H) -> relu -> head_a(H,H) -> relu -> head_b(H,H)`` with
``head_a`` and ``head_b`` sharing one weight; ``_no_pipelining`` is megatron-core 0.16's
``forward_backward_no_pipelining`` body (microbatches 0..M-2 under ``config.no_sync_func()``, the last
outside, then ``config.finalize_model_grads_func([model], num_tokens, pg_collection=...)``), and
``test_real_megatron_schedule_cpu`` runs megatron-core's own function when it is importable.

Tolerances. The oracle is a single-process ``torch.nn`` model fed every rank's microbatches.
* Exact data (most tests): weights, inputs and loss weights are small dyadic numbers (multiples of 1/2
  with |v| <= 1, inputs in {-1, 0, 1}) and every divisor is a power of two, so every product and every
  partial sum is exactly representable in fp32 (``_reference`` asserts it: the fp32 oracle equals the
  fp64 one). Any summation order then gives the same bits, so comparisons are ``torch.equal`` although
  distwgrad adds microbatches and tied uses in another order than autograd; a lost, duplicated or
  mis-scaled contribution changes the result by a whole term.
* Random data (``test_random_data_within_reassociation_bound``) catches what exact data cannot (a
  reduction or buffer in a low precision, a scale rounded early): the per-use terms are the same fp32
  GEMMs on both sides, only their summation order differs, so the bound is the reassociation error of
  n terms, ``n * eps * sum(|term|)``, plus one rounding of the result.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distwgrad import ReducePolicy, ShardedWeight
from distwgrad.integrations import megatron as dw_megatron
from distwgrad.nn import GroupedLinear, Linear
from distwgrad.testing.multiprocess import for_each_case, run_distributed
from distwgrad.wgrad.scheduler import deferred_modules

K, H, E = 4, 6, 2  # H = 6 rows: 3 per rank on 2 ranks
# Tokens per [rank][microbatch]: powers of two, and each rank's total is the same power of two so that
# the per-token scale (W / total tokens) is exact; unequal per microbatch so per-token loss differs from
# Megatron's default per-microbatch averaging.
_TOKENS = {(1, 1): [[4]], (1, 4): [[4, 8, 2, 2]], (2, 1): [[4], [4]], (2, 4): [[4, 4, 4, 4], [8, 4, 2, 2]]}
_SPLITS = {8: [[5, 3]], 4: [[1, 3], [0, 4]], 2: [[2, 0]]}  # expert token splits; includes empty groups


# --- data, model, oracle ---------------------------------------------------------------------------------

def _values(shape, g, exact, scale=0.5, lo=-2, hi=3):
    if exact:
        return torch.randint(lo, hi, shape, generator=g).float() * scale
    return torch.randn(shape, generator=g) * scale


def _full(exact=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w_in": _values((H, K), g, exact), "b_in": _values((H,), g, exact),
            "w_exp": _values((E, H, H), g, exact), "b_exp": _values((E, H), g, exact),
            "w_tied": _values((H, H), g, exact)}


def _data(step, world, microbatches, exact=True):
    """Every rank's microbatches ``(x_TK, splits, c_TH)``: the global batch, known to every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for tokens in _TOKENS[(world, microbatches)]:
        out.append([(_values((t, K), g, exact, scale=1.0, lo=-1, hi=2), _SPLITS[t][m % len(_SPLITS[t])],
                     _values((t, H), g, exact)) for m, t in enumerate(tokens)])
    return out


class _Net(nn.Module):
    """A Megatron model chunk: ``config``, ``model_type`` and ``set_input_tensor`` as the schedules expect."""

    def __init__(self, case, full):
        super().__init__()
        policy = ReducePolicy(case.get("policy", "per_microbatch"))
        sharded = case["kind"] == "sharded"
        kw = dict(delay_wgrad_compute=case["delay"], fuse_wgrad_accumulation=case["fuse"])

        def weight(t):
            if sharded:
                return ShardedWeight.from_full(t, reduce_policy=policy)
            return nn.Parameter(t.clone())

        plain = lambda t: nn.Parameter(t.clone())  # biases stay plain: the data-parallel all-reduce path
        self.inp = Linear(K, H, weight=weight(full["w_in"]), bias=plain(full["b_in"]), **kw)
        self.experts = GroupedLinear(E, H, H, single_grouped_weight=case["packed"], **kw)
        if case["packed"]:
            self.experts.weight, self.experts.bias = weight(full["w_exp"]), plain(full["b_exp"])
        else:
            for e in range(E):
                setattr(self.experts, f"weight{e}", weight(full["w_exp"][e]))
                setattr(self.experts, f"bias{e}", plain(full["b_exp"][e]))
        tied = weight(full["w_tied"])
        self.head_a = Linear(H, H, bias=False, weight=tied, **kw)
        self.head_b = Linear(H, H, bias=False, weight=tied, **kw)
        self.model_type = None  # the real-schedule test sets megatron's ModelType

    def set_input_tensor(self, input_tensor):
        pass

    def forward(self, x, splits):
        h = F.relu(self.inp(x))
        h = F.relu(self.experts(h, splits))
        return self.head_b(F.relu(self.head_a(h)))

    def by_reference_name(self):
        """``(oracle name, index into it or None, parameter)`` for every distinct parameter."""
        out = [("w_in", None, self.inp.weight), ("b_in", None, self.inp.bias), ("w_tied", None, self.head_a.weight)]
        if self.experts.single_grouped_weight:
            out += [("w_exp", None, self.experts.weight), ("b_exp", None, self.experts.bias)]
        else:
            out += [(n, e, getattr(self.experts, f"{a}{e}")) for e in range(E)
                    for n, a in (("w_exp", "weight"), ("b_exp", "bias"))]
        return out


class _RefNet(nn.Module):
    def __init__(self, full, dtype, untie):
        super().__init__()
        self.inp = nn.Linear(K, H).to(dtype)
        self.experts = nn.ModuleList(nn.Linear(H, H).to(dtype) for _ in range(E))
        self.head_a, self.head_b = nn.Linear(H, H, bias=False).to(dtype), nn.Linear(H, H, bias=False).to(dtype)
        with torch.no_grad():
            self.inp.weight.copy_(full["w_in"])
            self.inp.bias.copy_(full["b_in"])
            for e, lin in enumerate(self.experts):
                lin.weight.copy_(full["w_exp"][e])
                lin.bias.copy_(full["b_exp"][e])
            self.head_a.weight.copy_(full["w_tied"])
            self.head_b.weight.copy_(full["w_tied"])
        if not untie:
            self.head_b.weight = self.head_a.weight

    def forward(self, x, splits):
        h = F.relu(self.inp(x))
        parts, start = [], 0
        for lin, n in zip(self.experts, splits):
            parts.append(lin(h[start:start + n]))
            start += n
        h = F.relu(torch.cat(parts))
        return self.head_b(F.relu(self.head_a(h)))

    def sources(self):
        """Oracle name -> its gradient sources: one per use of the tensor (two for the untied heads); the
        experts' source is the list of per-expert weights (their gradients are stacked)."""
        tied = [self.head_a.weight] + ([self.head_b.weight] if self.head_b.weight is not self.head_a.weight else [])
        return {"w_in": [self.inp.weight], "b_in": [self.inp.bias], "w_tied": tied,
                "w_exp": [[lin.weight for lin in self.experts]], "b_exp": [[lin.bias for lin in self.experts]]}


def _grad_with_lists(loss, sources):
    """``autograd.grad`` over sources that may be lists (the experts), stacked back per source."""
    flat = [s for src in sources for s in (src if isinstance(src, list) else [src])]
    grads = iter(torch.autograd.grad(loss, flat))
    return [torch.stack([next(grads) for _ in src]) if isinstance(src, list) else next(grads) for src in sources]


def _reference(full, data, per_token):
    """The oracle's gradients, checked exact: fp32 oracle == fp64 oracle (see the module docstring)."""
    want = {n: torch.stack(t).sum(0) for n, t in _terms(full, data, per_token, torch.float32).items()}
    want64 = {n: torch.stack(t).sum(0) for n, t in _terms(full, data, per_token, torch.float64).items()}
    for n in want:
        assert torch.equal(want[n].double(), want64[n]), f"test data not exact for {n}"
    return want


def _terms(full, data, per_token, dtype, untie=False):
    ref = _RefNet({k: v.to(dtype) for k, v in full.items()}, dtype, untie)
    world, mbs = len(data), len(data[0])
    total_tokens = sum(x.shape[0] for rank in data for x, _, _ in rank)
    names = [n for n, srcs in ref.sources().items() for _ in srcs]
    sources = [src for srcs in ref.sources().values() for src in srcs]
    terms: dict[str, list[torch.Tensor]] = {}
    for rank in data:
        for x, splits, c in rank:
            loss = (ref(x.to(dtype), splits) * c.to(dtype)).sum()
            if not per_token:  # forward_step_calc_loss: / num_tokens, then / num_microbatches
                loss = loss / x.shape[0]
                loss = loss / mbs
            for n, gr in zip(names, _grad_with_lists(loss, sources)):
                terms.setdefault(n, []).append(gr / total_tokens if per_token else gr / world)
    return terms


def _local(p, t):
    return t[p.shard_offset:p.shard_offset + p.shape[0]] if isinstance(p, ShardedWeight) else t


def _result_of(p):
    """Where the step's gradient lives: weights: main_grad and .grad agree; plain: main_grad if any."""
    main_grad = getattr(p, "main_grad", None)
    if isinstance(p, ShardedWeight):
        assert torch.equal(p.grad, main_grad.to(p.dtype))
        return main_grad
    if main_grad is not None:
        assert p.grad is None, "plain parameter with main_grad: .grad must be folded into it"
        return main_grad
    return p.grad


def _assert_matches(net, want):
    for name, index, p in net.by_reference_name():
        expected = want[name] if index is None else want[name][index]
        got = _result_of(p)
        assert got is not None and got.dtype == torch.float32, (name, index)
        assert torch.equal(got, _local(p, expected)), (name, index, (got - _local(p, expected)).abs().max())


# --- the schedule --------------------------------------------------------------------------------------

def _forward_step_func(data_iterator, model):
    """Megatron's ``forward_step_func(data_iterator, model) -> (output, loss_func)``."""
    x, splits, c = next(data_iterator)
    y = model(x, splits)

    def loss_func(output):
        loss = (output * c).sum()
        return loss, torch.tensor(x.shape[0], dtype=torch.int), {"loss": loss.detach()}
    return y, loss_func


def _no_pipelining(config, model, microbatches, *, drain_per_microbatch, trace):
    """megatron-core 0.16 ``forward_backward_no_pipelining`` (no timers, CPU token counter).

    ``drain_per_microbatch`` emulates Megatron's delay-wgrad schedules, which call ``backward_dw()`` on
    each layer after the microbatch's backward; otherwise the finalize func drains.
    """
    n = len(microbatches)
    it = iter(microbatches)
    total = torch.zeros([], dtype=torch.int)

    def one_microbatch():
        nonlocal total
        output, loss_func = _forward_step_func(it, model)
        loss, num_tokens, _ = loss_func(output)
        if not config.calculate_per_token_loss:
            loss /= torch.clamp(num_tokens, min=1)
            loss /= n
        total += num_tokens
        torch.autograd.backward(loss)
        if drain_per_microbatch:
            with torch.no_grad():  # see test_core_backward_dw_under_grad_mode_records_a_graph
                for m in reversed(deferred_modules(model)):
                    m.backward_dw()

    with config.no_sync_func():
        trace["no_sync"] = True
        for _ in range(n - 1):
            one_microbatch()
        trace["no_sync"] = False
    one_microbatch()
    return config.finalize_model_grads_func([model], total if config.calculate_per_token_loss else None,
                                            pg_collection=types.SimpleNamespace(dp_cp=None), force_all_reduce=False)


def _schedule_case(case, rank, world):
    full = _full()
    net = _Net(case, full)
    config = dw_megatron.install(types.SimpleNamespace(calculate_per_token_loss=case["per_token"]), [net])
    net.config = config
    if case["buffer"]:
        buffer = dw_megatron.attach_main_grads([net])
    weights = [p for p in net.parameters() if isinstance(p, ShardedWeight)]
    plain = [p for p in net.parameters() if not isinstance(p, ShardedWeight)]
    trace = {"no_sync": False}
    fired = []
    owners = {id(p): [m for m in deferred_modules(net) if any(q is p for q in m.parameters())] for p in plain}

    def on_ready(name, p):
        pending = p.pending_contributions if isinstance(p, ShardedWeight) else sum(
            m.pending_backward_dw for m in owners[id(p)])
        fired.append((name, pending, trace["no_sync"]))

    dw_megatron.register_grad_ready_hook([net], on_ready)
    ddp_hook_calls = []  # Megatron's DDP registers its grad hook here for skip_backward_post_hook params
    for m in deferred_modules(net):
        assert all(getattr(p, "skip_backward_post_hook", False) for p in m.parameters())
        m.register_wgrad_accumulation_and_reduce_hooks(lambda m=m: ddp_hook_calls.append(m))
    mbs = case["microbatches"]
    for step in range(2):
        data = _data(step, world, mbs)
        reduced_before = [w.bytes_reduced for w in weights]
        fired.clear()
        ddp_hook_calls.clear()
        result = _no_pipelining(config, net, data[rank], drain_per_microbatch=case["drain"] == "schedule",
                                trace=trace)
        _assert_matches(net, _reference(full, data, case["per_token"]))
        n_deferring = len(deferred_modules(net))
        assert len(ddp_hook_calls) == n_deferring * mbs
        assert result.drained == (n_deferring * mbs if case["drain"] == "finalize" else 0)
        assert result.weights == len(weights) and result.plain == len(plain)
        assert dw_megatron.finalize_model_grads([net]).plain == 0  # a second finalize is a no-op
        for w, before in zip(weights, reduced_before):
            assert w.reduce_policy is ReducePolicy(case["policy"])  # restored after no_sync
            if world > 1:  # one reduce-scatter per weight per step: no_sync held back the others
                assert w.bytes_reduced - before == w.full_shape.numel() * 4, w
        names = sorted(n for n, _ in net.named_parameters())
        assert sorted(n for n, _, _ in fired) == names  # every parameter once
        assert all(pending == 0 and not in_no_sync for _, pending, in_no_sync in fired)
        if case["buffer"]:
            assert all(p.main_grad._base is buffer for p in net.parameters())  # used in place, never replaced
        dw_megatron.zero_grad_buffer([net])
        for p in net.parameters():
            p.grad = None


def _cases(**fixed):
    grid = dict(delay_drain=[(False, "none"), (True, "finalize"), (True, "schedule")], fuse=[False, True],
                policy=["per_microbatch", "per_step"], per_token=[False, True], buffer=[False, True],
                packed=[False, True], microbatches=[1, 4])
    grid.update({k: [v] for k, v in fixed.items()})
    cases = []
    for values in itertools.product(*grid.values()):
        case = dict(zip(grid, values))
        case["delay"], case["drain"] = case.pop("delay_drain")
        cases.append(case)
    return cases


def _schedule_rank(rank, world, cases):
    for_each_case(cases, _schedule_case, rank, world)


def test_schedule_plain_params_single_process():
    for_each_case(_cases(kind="plain", policy="per_microbatch"), _schedule_case, 0, 1)


@pytest.mark.distributed
def test_schedule_sharded_two_ranks_bit_exact():
    run_distributed(_schedule_rank, 2, _cases(kind="sharded"), timeout=300)


# --- random data: the same schedule, a reassociation bound ---------------------------------------------

def _random_case(case, rank, world):
    full = _full(exact=False, seed=3)
    net = _Net(case, full)
    config = dw_megatron.install(types.SimpleNamespace(calculate_per_token_loss=case["per_token"]), [net])
    net.config = config
    data = _data(7, world, case["microbatches"], exact=False)
    _no_pipelining(config, net, data[rank], drain_per_microbatch=False, trace={})
    terms = _terms(full, data, case["per_token"], torch.float32, untie=True)
    eps = torch.finfo(torch.float32).eps
    for name, index, p in net.by_reference_name():
        ts = [t if index is None else t[index] for t in terms[name]]
        want = torch.stack(ts).double().sum(0)
        bound = len(ts) * eps * torch.stack(ts).abs().double().sum(0) + eps * want.abs()
        err = (_result_of(p).double() - _local(p, want)).abs()
        assert (err <= _local(p, bound)).all(), (name, index, err.max().item())


def _random_rank(rank, world, cases):
    for_each_case(cases, _random_case, rank, world)


@pytest.mark.distributed
def test_random_data_within_reassociation_bound():
    cases = [dict(kind="sharded", delay=d, fuse=f, packed=True, per_token=t, microbatches=4)
             for d, f, t in itertools.product([False, True], [False, True], [False, True])]
    run_distributed(_random_rank, 2, cases, timeout=300)


# --- a weight's policy may change at any point of a step -----------------------------------------------

def _toggle_case(seed, rank, world):
    """Random policy flips, no_sync entries/exits and partial drains, identical on both ranks (seeded)."""
    rng = random.Random(seed)
    case = dict(kind="sharded", delay=True, fuse=rng.random() < 0.5, packed=rng.random() < 0.5, per_token=False)
    full = _full()
    net = _Net(case, full)
    weights = [p for p in net.parameters() if isinstance(p, ShardedWeight)]
    mods = deferred_modules(net)
    data = _data(seed, world, 4)

    def flip():
        for w in weights:
            if rng.random() < 0.5:
                w.reduce_policy = rng.choice(list(ReducePolicy))

    reductions = [w.bytes_reduced for w in weights]
    with contextlib.ExitStack() as stack:
        for x, splits, c in data[rank]:
            if rng.random() < 0.5:
                stack.enter_context(dw_megatron.no_sync([net]))
            flip()
            loss = (net(x, splits) * c).sum() / x.shape[0] / len(data[rank])
            flip()
            loss.backward()
            with torch.no_grad():
                for m in rng.sample(mods, rng.randint(0, len(mods))):
                    flip()
                    while m.pending_backward_dw and rng.random() < 0.7:
                        m.backward_dw()
            if rng.random() < 0.5:
                stack.close()
    dw_megatron.finalize_model_grads([net])
    _assert_matches(net, _reference(full, data, per_token=False))
    return [w.bytes_reduced - r for w, r in zip(weights, reductions)]


def _toggle_rank(rank, world, seeds):
    return for_each_case(seeds, _toggle_case, rank, world)


@pytest.mark.distributed
def test_policy_changes_mid_step_lose_nothing():
    results = run_distributed(_toggle_rank, 2, list(range(12)), timeout=300)
    reduced = {tuple(r) for r in results[0]}
    assert len(reduced) > 1  # the seeds did reduce at different points


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


def test_tied_fused_and_unfused_users_keep_both_contributions():
    g = torch.Generator().manual_seed(2)
    w_full, x = _values((H, H), g, True), _values((4, H), g, True, 1.0, -1, 2)
    w = nn.Parameter(w_full.clone())
    model = nn.Sequential(Linear(H, H, bias=False, weight=w, fuse_wgrad_accumulation=True),
                          Linear(H, H, bias=False, weight=w))
    model(x).sum().backward()
    assert w.grad_added_to_main_grad and not getattr(w, "zero_out_wgrad", False)
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


# --- megatron-core's own schedule (skipped unless megatron-core imports) -------------------------------

class _CpuTorch(types.ModuleType):
    """``torch`` as megatron-core's schedules module sees it, with ``device="cuda"`` mapped to the CPU.

    ``forward_backward_no_pipelining`` allocates its token counter with ``torch.zeros(..., device="cuda")``
    (megatron-core 0.16, schedules.py); that is its only CUDA dependency on this path, so the real
    schedule runs on CPU ranks with this one name swapped. qa/L2_gpu/megatron_real_schedule.py runs it
    unmodified on a GPU.
    """

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _real_schedule_case(case, rank, world):
    import torch.distributed as dist
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    full = _full()
    net = _Net(case, full)
    net.model_type = ModelType.encoder_or_decoder
    net.config = dw_megatron.install(TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1,
                                                       calculate_per_token_loss=case["per_token"],
                                                       cuda_graph_scope=[]), [net])
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    me = singles[rank]
    pg = ProcessGroupCollection(tp=me, cp=me, pp=me, embd=None, pos_embd=None, dp=dist.group.WORLD,
                                dp_cp=dist.group.WORLD)
    weights = [p for p in net.parameters() if isinstance(p, ShardedWeight)]
    for step in range(2):
        data = _data(step, world, case["microbatches"])
        reduced_before = [w.bytes_reduced for w in weights]
        saved, schedules.torch = schedules.torch, _CpuTorch("torch")
        try:
            losses = schedules.forward_backward_no_pipelining(
                forward_step_func=_forward_step_func, data_iterator=iter(data[rank]), model=[net],
                num_microbatches=case["microbatches"], seq_length=4, micro_batch_size=1, pg_collection=pg)
        finally:
            schedules.torch = saved
        assert len(losses) == case["microbatches"]
        _assert_matches(net, _reference(full, data, case["per_token"]))
        for w, before in zip(weights, reduced_before):  # the schedule's no_sync held back all but one
            assert w.bytes_reduced - before == w.full_shape.numel() * 4
        dw_megatron.zero_grad_buffer([net])
        for p in net.parameters():
            p.grad = None


def _real_schedule_rank(rank, world, cases):
    for_each_case(cases, _real_schedule_case, rank, world)


@pytest.mark.distributed
def test_real_megatron_schedule_cpu():
    pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    cases = [dict(kind="sharded", delay=d, fuse=f, packed=True, per_token=t, microbatches=4, policy="per_microbatch")
             for d, f, t in itertools.product([False, True], [False, True], [False, True])]
    run_distributed(_real_schedule_rank, 2, cases, timeout=300)
