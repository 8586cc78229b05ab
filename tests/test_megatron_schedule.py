"""``distwgrad.integrations.megatron`` driven the way megatron-core's schedules drive it.

``_no_pipelining`` is megatron-core 0.16's ``forward_backward_no_pipelining`` body (microbatches 0..M-2
under ``config.no_sync_func()``, the last outside, then ``config.finalize_model_grads_func([model],
num_tokens, pg_collection=...)``). It runs the case grid bit-exact (plain parameters on one process,
sharded weights on two gloo ranks: a fixed sample of the grid in CI, all of it with ``--full``), random
data within the reassociation bound, and reduce policies flipped at random points of a step;
``test_real_megatron_schedule_cpu`` runs megatron-core's own function when it is importable. The model,
data, oracle and tolerances are ``megatron_cases.py``'s.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import types

import pytest
import torch
from megatron_cases import H, _assert_matches, _data, _full, _local, _Net, _reference, _result_of, _terms

from distwgrad import ReducePolicy, ShardedWeight
from distwgrad.integrations import megatron as dw_megatron
from distwgrad.testing import sweep
from distwgrad.testing.multiprocess import for_each_case, run_distributed
from distwgrad.wgrad.scheduler import deferred_modules

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
    """64 of the grid's 192 cases in CI (a fixed sample with the first and the last), all with ``--full``."""
    run_distributed(_schedule_rank, 2, sweep.sample(_cases(kind="sharded"), 64), timeout=300)


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
