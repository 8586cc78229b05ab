"""``distwgrad.coalesce``: one all-gather and one reduce-scatter per unit, gradients bit-identical.

[Note: coalesced units] in ``weights/units.py``. The reference is the same model without units: every
weight its own collectives. On 2 gloo ranks every reduction is a two-term fp32 sum, commutative, and a
coalesced reduce-scatter sums each element over the same two terms, so ``main_grad`` must be identical
bit for bit; on 3 ranks (uneven and empty shards) gloo may sum three terms in another order, which
allows 4 fp32 ulps at the gradient's magnitude (the bound of ``tests/test_distributed_weights.py``).
Collectives are counted with torch.profiler's ``c10d::`` operators (``qa/bench/_trace.py``'s rule), so a
collective the units forgot to coalesce shows up.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

import distwgrad
from distwgrad import ReducePolicy, ShardedWeight
from distwgrad.models import MoEGPT, MoEGPTConfig
from distwgrad.nn import Linear
from distwgrad.testing import sweep
from distwgrad.testing.multiprocess import for_each_case, run_distributed
from distwgrad.weights import _accounting

pytestmark = pytest.mark.distributed

TINY = dict(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, n_experts=4, top_k=2, d_ff=48)


def _count_collectives(fn) -> tuple[int, object]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    names = [e.name for e in prof.events() if e.name.startswith("c10d::") and "barrier" not in e.name]
    return len(names), out


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.clone() for n, p in distwgrad.wgrad.finalize.distributed_parameters(model)}


def _moe_step(model: nn.Module, tokens: torch.Tensor, microbatches: int, drain_each: bool) -> None:
    for mb in tokens.chunk(microbatches):
        model.loss(mb[:, :-1], mb[:, 1:]).backward()
        if drain_each:
            distwgrad.drain_deferred_wgrads(model)
    distwgrad.drain_deferred_wgrads(model)
    distwgrad.finalize_model_grads([model])


def _moe_case(case, rank, world):
    cfg = MoEGPTConfig(**TINY)
    dtype = {"bf16": torch.bfloat16, "fp32": None}[case["param_dtype"]]
    plain = MoEGPT(cfg, param_dtype=dtype)
    coal = MoEGPT(cfg, param_dtype=dtype)
    units = distwgrad.coalesce(coal)
    assert [u.name for u in units] == ["blocks.0", "blocks.1", ""]
    assert {n for n, _ in coal.named_parameters()} >= {"embedding.weight"}
    assert units[-1].weights == [coal.embedding.weight]  # the tied embedding / head: the root's
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(coal.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1234 + rank)
    ulps = 0 if world == 2 else 4
    counts = []
    for step in range(3):
        tokens = torch.randint(0, cfg.vocab_size, (2 * case["mb"], cfg.seq_len + 1), generator=gen)
        n_p, _ = _count_collectives(lambda t=tokens: _moe_step(plain, t, case["mb"], case["drain_each"]))
        n_c, _ = _count_collectives(lambda t=tokens: _moe_step(coal, t, case["mb"], case["drain_each"]))
        gp, gc = _grads(plain), _grads(coal)
        for name in gp:
            a, b = gp[name], gc[name]
            if ulps == 0:
                assert torch.equal(a, b), f"step {step} {name}: max diff {(a - b).abs().max().item()}"
            elif a.numel():
                tol = ulps * torch.finfo(torch.float32).eps * a.abs().max().clamp_min(1e-30)
                assert (a - b).abs().max() <= tol, f"step {step} {name}"
        for (n1, p1), (_, p2) in zip(plain.named_parameters(), coal.named_parameters()):
            assert p1.bytes_reduced == p2.bytes_reduced, n1
            if n1 == "embedding.weight":  # the root gathers the tied weight once for the embedding and the head
                assert p2.bytes_gathered < p1.bytes_gathered or step == 0, (p1.bytes_gathered, p2.bytes_gathered)
            else:  # each block weight: its share of each coalesced gather, what its own would have moved
                assert p1.bytes_gathered == p2.bytes_gathered, n1
        opt_p.step(), opt_c.step()
        opt_p.zero_grad(), opt_c.zero_grad()
        counts.append((n_p, n_c, units.collectives))
        assert not _accounting._LAUNCHED
    if rank == 0:
        print("collectives per step (uncoalesced, coalesced, coalesced counter):", case, counts)
    # From the second step on, each block gathers its weights once in forward and once in backward per
    # microbatch and reduces once per microbatch (drained each) or once per step: far fewer collectives.
    n_p, n_c, _ = counts[-1]
    assert n_c < n_p, counts
    blocks, mb = TINY["n_layers"], case["mb"]
    per_mb_reductions = mb if case["drain_each"] else 1
    # root: its weight is gathered for the embedding and for the head (forward), and re-gathered for the
    # head's backward; each block: one gather in forward, one in backward, its reductions.
    expect = mb * (2 + 1) + blocks * (2 * mb + per_mb_reductions) + per_mb_reductions
    assert n_c <= expect, (n_c, expect, counts)
    return counts


def _rank_fn(rank, world, cases):
    return for_each_case(cases, _moe_case, rank, world)


CASES = [dict(param_dtype=d, mb=mb, drain_each=de)
         for d, mb, de in itertools.product(("fp32", "bf16"), (1, 3), (True, False))]


def test_moe_gpt_coalesced_is_bit_identical_2_ranks():
    run_distributed(_rank_fn, 2, sweep.sample(CASES, 2), timeout=240)  # all 8 with --full


def test_moe_gpt_coalesced_3_ranks():
    run_distributed(_rank_fn, 3, [CASES[6]] if not sweep.full() else [CASES[1], CASES[6]], timeout=240)


# --- smaller models: uneven / empty shards, policies, async, prefetch freshness -------------------------
class _Stack(nn.Module):
    def __init__(self, rows: list[int], k: int, policy: ReducePolicy, async_reduce: bool, delay: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList()
        for n in rows:
            w = ShardedWeight.from_full(torch.randn(n, k), reduce_policy=policy, async_reduce=async_reduce)
            w2 = ShardedWeight.from_full(torch.randn(k, n), reduce_policy=policy, async_reduce=async_reduce)
            blk = nn.Sequential(Linear(k, n, bias=False, weight=w, delay_wgrad_compute=delay),
                                nn.GELU(), Linear(n, k, bias=False, weight=w2))
            self.blocks.append(blk)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def _stack_case(case, rank, world):
    policy = ReducePolicy(case["policy"])
    plain = _Stack(case["rows"], 6, policy, case["async"], case["delay"])
    coal = copy.deepcopy(plain)
    units = distwgrad.coalesce(coal)
    gen = torch.Generator().manual_seed(rank)
    for step in range(3):
        for _ in range(case["mb"]):
            x = torch.randn(5, 6, generator=gen)
            plain(x).square().mean().backward()
            coal(x).square().mean().backward()
            if case["delay"]:
                distwgrad.drain_deferred_wgrads(plain)
                distwgrad.drain_deferred_wgrads(coal)
        distwgrad.finalize_model_grads(plain)
        distwgrad.finalize_model_grads(coal)
        for (n, a), (_, b) in zip(plain.named_parameters(), coal.named_parameters()):
            assert torch.isfinite(a.grad).all(), f"step {step} {n}: the reference diverged"
            assert torch.equal(a.grad, b.grad), f"step {step} {n}"
            assert torch.equal(a.main_grad, b.main_grad), f"step {step} {n}"
        with torch.no_grad():  # the masters move: the next forward must see the new values
            for a, b in zip(plain.parameters(), coal.parameters()):
                a.sub_(0.01 * a.grad)
                b.sub_(0.01 * b.grad)
                a.grad = b.grad = None
        assert not _accounting._LAUNCHED
    assert units.collectives > 0


def _stack_rank_fn(rank, world, cases):
    return for_each_case(cases, _stack_case, rank, world)


STACK_CASES = [dict(rows=r, policy=p, async_=a, delay=d, mb=mb)
               for r, p, a, d, mb in itertools.product(([7, 5], [2, 9]), ("per_microbatch", "per_step"),
                                                       (False, True), (False, True), (1, 2))]
for c in STACK_CASES:
    c["async"] = c.pop("async_")


def test_stack_coalesced_policies_async_deferred_2_ranks():
    run_distributed(_stack_rank_fn, 2, sweep.sample(STACK_CASES, 6), timeout=240)  # all 32 with --full


def test_stack_coalesced_uneven_and_empty_shards_3_ranks():
    # rows 2 over 3 ranks: 1 + 1 + 0 (an empty shard); rows 7: 3 + 3 + 1
    cases = [c for c in STACK_CASES if c["mb"] == 2 and c["async"]]
    run_distributed(_stack_rank_fn, 3, sweep.sample(cases, 2), timeout=240)  # all 8 with --full


# --- the rules around the gathers: freshness, prefetch order, live copies, explicit units, refusals -------
def _live_units(units) -> int:
    """Units holding gathered copies outside their forward (backward sets and prefetches)."""
    return sum(bool(u._backward or u._prefetched_bwd or u._prefetched_fwd) for u in units)


def _rules_case(case, rank, world):
    torch.manual_seed(0)
    model = _Stack([4, 6, 8, 2], 6, ReducePolicy.PER_MICROBATCH, False, False)
    ref = copy.deepcopy(model)
    if case["what"] == "explicit":
        units = distwgrad.coalesce(model, units=[model.blocks[0], model.blocks[2]])
        assert [u.name for u in units] == ["blocks.0", "blocks.2", ""]
        assert len(units[-1].weights) == 4  # blocks 1 and 3 fall to the root
        units[0].set_modules_to_forward_prefetch([model.blocks[2]])
        units[1].set_modules_to_backward_prefetch([model.blocks[0]])
    else:
        units = distwgrad.coalesce(model)
    if case["what"] == "graphs":  # a unit's own module already refuses (its hooks); a module inside it too
        with pytest.raises(ValueError, match="is in a distwgrad.coalesce unit"):
            distwgrad.make_graphed_callables(model.blocks[0][0], (torch.randn(3, 6),))
        return
    peak_live = 0

    def watch(*_):
        nonlocal peak_live
        peak_live = max(peak_live, _live_units(units))
    for blk in model.blocks:
        for lin in (blk[0], blk[2]):
            lin.register_full_backward_hook(watch)
    gen = torch.Generator().manual_seed(rank)
    for step in range(3):
        x = torch.randn(3, 6, generator=gen)
        for m in (ref, model):
            m(x).square().mean().backward()
            distwgrad.finalize_model_grads(m)
        for a, b in zip(ref.parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad)
        with torch.no_grad():  # a change of the masters between steps, the way an optimizer makes it
            for a, b in zip(ref.parameters(), model.parameters()):
                a.add_(a.grad.sign()), b.add_(b.grad.sign())
                a.grad = b.grad = None
        y_ref = ref(x).detach()
        y = model(x).detach()  # prefetched gathers: each must see the new masters
        assert torch.equal(y, y_ref), f"step {step}: a gather predates the update"
        assert _live_units(units) <= 2
    if case["what"] == "learned":
        assert [u.name for u in units._fwd_order] == ["", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]
        assert [u.name for u in units._bwd_order] == ["blocks.3", "blocks.2", "blocks.1", "blocks.0"]
        assert 1 <= peak_live <= 2, peak_live  # the current unit's backward copies and the next's prefetch
    if case["what"] == "deepcopy":  # a deep copy is coalesced like the original, with its own units
        twin = copy.deepcopy(model)
        assert twin.blocks[0][0].weight._unit is not model.blocks[0][0].weight._unit
        twin(x).square().mean().backward()
        model(x).square().mean().backward()
        distwgrad.finalize_model_grads(twin), distwgrad.finalize_model_grads(model)
        for a, b in zip(twin.parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad)


def _rules_rank_fn(rank, world, cases):
    return for_each_case(cases, _rules_case, rank, world)


def test_coalesced_gathers_are_fresh_bounded_and_ordered():
    run_distributed(_rules_rank_fn, 2, [dict(what=w) for w in ("learned", "explicit", "deepcopy")], timeout=240)


def test_coalesced_weights_refuse_graphs():
    run_distributed(_rules_rank_fn, 2, [dict(what="graphs")], timeout=120)


# --- a 2 x 2 (replicate, shard) mesh: reduce-scatter within the shard group, all-reduce across replicas ----
def _mesh_case(case, rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def build():
        torch.manual_seed(0)
        blocks = nn.ModuleList()
        for n in (5, 4):
            w1 = ShardedWeight.from_full(torch.randn(n, 6), mesh=mesh, async_reduce=case["async"])
            w2 = ShardedWeight.from_full(torch.randn(6, n), mesh=mesh, async_reduce=case["async"])
            blocks.append(nn.Sequential(Linear(6, n, bias=False, weight=w1), nn.GELU(),
                                        Linear(n, 6, bias=False, weight=w2)))
        root = nn.Module()
        root.blocks = blocks
        root.forward = lambda x: blocks[1](x + blocks[0](x))
        return root
    ref, model = build(), build()
    distwgrad.coalesce(model)
    gen = torch.Generator().manual_seed(rank)
    for step in range(3):
        for _ in range(2):
            x = torch.randn(3, 6, generator=gen)
            ref(x).square().mean().backward()
            model(x).square().mean().backward()
        distwgrad.finalize_model_grads(ref), distwgrad.finalize_model_grads(model)
        for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
            assert torch.equal(a.grad, b.grad), f"step {step} {n}"
            a.grad = b.grad = None


def _mesh_rank_fn(rank, world, cases):
    return for_each_case(cases, _mesh_case, rank, world)


def test_coalesced_on_a_two_by_two_mesh():
    run_distributed(_mesh_rank_fn, 4, [dict(**{"async": a}) for a in (False, True)], timeout=240)
