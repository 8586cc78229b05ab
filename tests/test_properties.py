"""Property-based tests: random models of distwgrad weights against a single-process plain-torch oracle.

Legend: S rows of a square weight (the chain's width), E experts, V vocabulary rows, T tokens.

A *case* is a small dict that hypothesis draws (``_cases``): a world size; a pool of fp32 master weights
(square ``[S, S]``, biases ``[S]``, packed experts ``[E, S, S]`` and ``[E, S]``, an embedding table
``[V, S]``), each sharded or replicated, with row counts around the world size so shards come out uneven
and empty (``S < world``, ``E < world``); a chain of calls into Linear, GroupedLinear (discrete experts,
any of which may be the same weight) and packed GroupedLinear modules, where a module may be called
more than once and modules share weights and biases; an optional Embedding in front and an output
Linear whose weight is the table (tied) or its own; per-rank token counts and ``m_splits`` with zeros;
1-4 microbatches; the reduce policy, async reductions, per-module ``delay_wgrad_compute`` and
``fuse_wgrad_accumulation``, a caller-attached fp32 ``main_grad``, ``param_dtype`` (none or bf16 on
fp32 masters), the drain order and when to drain, what happens to ``.grad`` between two steps, and
whether some of the modules are ``distwgrad.coalesce`` units (the rest, and weights two units share, the
root's): units change when and in how many collectives weights gather and reduce, never the values, so
the oracle is the same (only the gathered-bytes count, which depends on what the units learned, is not
checked for them).

How cases are drawn. World 1 runs in this process: a plain ``@given`` test, so hypothesis shrinks a
failure to its smallest case. Spawning gloo ranks costs seconds, so worlds 2-4 never spawn per example:
``_draw`` runs a ``@given`` collector with ``derandomize=True`` (a fixed seed, the same cases on every
run and machine) that only records the cases, and one ``run_distributed`` per world size sweeps them
all; a failure names its case (``for_each_case``), to be replayed at world 1 or pasted into a
regression test. ``pytest --full`` (``tests/conftest.py``) raises every count (``_COUNTS``).

The oracle. ``F.linear``, ``F.embedding`` and a per-expert loop on the full fp32 masters, every rank's
batch in one process with the same microbatch split; under bf16 each use casts its master with
``.to(torch.bfloat16)`` inside autograd. Every use gets its own leaf copy of the master, so autograd
hands back each contribution separately (the lookup's as the rows of its output gradient, added in fp32
with ``index_add_``: torch's bf16 lookup backward would sum duplicate ids in bf16). The oracle then
replays what the weights do with them ([Note: contribution accounting] in ``weights/base.py``): per
rank, contributions are added into an fp32 buffer in the order backward and the drain deliver them (a
chain's backward runs its calls in reverse; a drain runs modules in the chosen order, each FIFO oldest
first); a buffer is reduced when deliveries catch up with the uses recorded so far (``PER_MICROBATCH``)
or at the end (``PER_STEP``), as ``sum over ranks / world`` added to ``main_grad``; with one rank the
buffer is ``main_grad`` itself ([Note: a group of one]). Each rank compares its ``.grad`` with the
oracle's rows of its shard.

Tolerances. Every product and every fp32 add is the same call on the same values in the same order
(and on the same layout: discrete experts are stacked as the module stacks them, since a one-token
``F.linear`` on CPU rounds differently at another offset in memory), so worlds 1 and 2 are bit-exact
(two ranks: a two-term sum is commutative and ``/2`` is exact), and so is every loss at any world size.
With 3 or 4 ranks gloo sums the ranks' buffers in its own order and ``/3`` rounds: element-wise, each
reduction can differ by ``eps * sum_r |B_r|`` (the first-order bound of a ``world``-term sum and a
division, rounded in both) and each of the ``n`` additions into ``main_grad`` by one more rounding, so
``|ours - oracle| <= (world + n) / world * eps * sum |B|`` over every rank's buffers (``_bound``).
Where that sum is zero the gradient must be exactly zero.

Invariants checked for every case and step: the finalize count, ``pending_contributions == 0``, a
second ``finalize_model_grads`` is a no-op that leaves ``.grad`` as it was, ``main_grad`` is fp32 of
the shard's shape (the caller's own tensor when attached), ``bytes_gathered`` is what the shard layout
predicts for the gathers the model does, and ``bytes_reduced`` says every buffer was reduced exactly
once per reduction point.
"""

from __future__ import annotations

import collections
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

import distwgrad
from distwgrad import ReducePolicy, ReplicatedWeight, ShardedWeight
from distwgrad.nn import Embedding, GroupedLinear, Linear
from distwgrad.testing import sweep
from distwgrad.testing.multiprocess import for_each_case, run_distributed

F32, BF16 = torch.float32, torch.bfloat16
STEPS = 2
# examples per world size: (CI, --full)
_COUNTS = {1: (60, 600), 2: (30, 300), 3: (16, 150), 4: (10, 100)}


def _count(world: int) -> int:
    return _COUNTS[world][1 if sweep.full() else 0]


# --- the case description ------------------------------------------------------------------------------

_KIND = st.sampled_from(["sharded", "sharded", "sharded", "replicated"])


def _module(draw, pools, E):
    kind = draw(st.sampled_from(["linear", "grouped", "packed"]))
    spec = dict(kind=kind, delay=draw(st.booleans()), fuse=draw(st.booleans()))
    pick = lambda pool: f"{pool}{draw(st.integers(0, len(pools[pool]) - 1))}"  # noqa: E731
    if kind == "linear":
        spec.update(w=pick("sq"), b=draw(st.sampled_from([None, pick("b")])))
    elif kind == "grouped":
        spec.update(experts=[pick("sq") for _ in range(E)])
    else:
        spec.update(w=pick("pk"), b=draw(st.sampled_from([None, pick("pb")])))
    return spec


def _split(draw, tokens, E):
    cuts = sorted(draw(st.lists(st.integers(0, tokens), min_size=E - 1, max_size=E - 1)))
    return [b - a for a, b in zip([0, *cuts], [*cuts, tokens])]


@st.composite
def _cases(draw, world):
    S, E, V = draw(st.integers(1, world + 2)), draw(st.integers(1, 3)), draw(st.integers(1, world + 3))
    pools = {p: draw(st.lists(_KIND, min_size=1, max_size=n)) for p, n in (("sq", 3), ("b", 2), ("pk", 2), ("pb", 2))}
    embed = draw(st.booleans())
    modules = [_module(draw, pools, E) for _ in range(draw(st.integers(0 if embed else 1, 3)))]
    chain = draw(st.lists(st.integers(0, len(modules) - 1), min_size=0 if embed else 1, max_size=4)) if modules else []
    head = draw(st.sampled_from(["none", "tied", "untied"] if embed else ["none", "untied"]))
    mbs = draw(st.integers(1, 4))
    tokens = [[draw(st.integers(0, 4)) for _ in range(mbs)] for _ in range(world)]
    splits = [[[_split(draw, t, E) if modules[c]["kind"] != "linear" else None for c in chain] for t in row]
              for row in tokens]
    n_deferred = sum(s["delay"] for s in modules) + (head != "none" and draw(st.booleans()))
    drain = draw(st.sampled_from(["reverse", "forward", "perm"]))
    n_parts = int(embed) + len(modules) + (head != "none")
    coalesce = draw(st.one_of(st.none(), st.lists(st.integers(0, n_parts - 1), unique=True)))
    return dict(
        world=world, S=S, E=E, V=V, kinds={f"{p}{i}": k for p, ks in pools.items() for i, k in enumerate(ks)}
        | {"emb": draw(_KIND), "head": draw(_KIND)},
        embed=embed, modules=modules, chain=chain, head=head,
        head_delay=n_deferred > sum(s["delay"] for s in modules), head_fuse=draw(st.booleans()),
        mbs=mbs, tokens=tokens, splits=splits,
        policy=draw(st.sampled_from(["per_microbatch", "per_step"])), async_reduce=draw(st.booleans()),
        dtype=draw(st.sampled_from(["fp32", "bf16"])), attach=draw(st.booleans()),
        drain=draw(st.permutations(range(n_deferred))) if drain == "perm" else drain,
        drain_at=draw(st.sampled_from(["each", "end"])), zero=draw(st.sampled_from(["none", "zeros", "keep"])),
        seed=draw(st.integers(0, 2**16)), coalesce=coalesce)


# --- the model: a list of modules and a chain of calls into them ----------------------------------------

def _parts(case):
    """``(kind, spec)`` per module in model order: the embedding, the chain's modules, the head."""
    parts = [("embedding", {})] if case["embed"] else []
    parts += [(s["kind"], s) for s in case["modules"]]
    if case["head"] != "none":
        w = "emb" if case["head"] == "tied" else "head"
        parts.append(("linear", dict(w=w, b=None, delay=case["head_delay"], fuse=case["head_fuse"])))
    return parts


def _calls(case):
    """``(model index, position in the chain or None)`` per call, in forward order."""
    first = int(case["embed"])
    calls = [(0, None)] if case["embed"] else []
    calls += [(first + c, pos) for pos, c in enumerate(case["chain"])]
    if case["head"] != "none":
        calls.append((len(_parts(case)) - 1, None))
    return calls


def _slots(kind, spec):
    """The keys of one call's parameters, as run_wgrad groups in the order backward delivers them."""
    if kind == "embedding":
        return [["emb"]]
    if kind == "grouped":
        return [list(spec["experts"])]
    return [[spec["w"]]] + ([[spec["b"]]] if spec["b"] is not None else [])


def _masters(case):
    g = torch.Generator().manual_seed(case["seed"])
    S, E, V = case["S"], case["E"], case["V"]
    shapes = {"sq": (S, S), "b": (S,), "pk": (E, S, S), "pb": (E, S), "emb": (V, S), "head": (V, S)}
    used = sorted({k for kind, spec in _parts(case) for grp in _slots(kind, spec) for k in grp})
    return {k: torch.randn(*shapes[k.rstrip("0123456789")], generator=g) * 0.5 for k in used}


def _dtype(case):
    return BF16 if case["dtype"] == "bf16" else F32


def _build(case, masters):
    kw = dict(reduce_policy=ReducePolicy(case["policy"]), async_reduce=case["async_reduce"],
              param_dtype=BF16 if case["dtype"] == "bf16" else None)
    W = {k: (ShardedWeight if case["kinds"][k] == "sharded" else ReplicatedWeight).from_full(t, **kw)
         for k, t in masters.items()}
    S, E, V = case["S"], case["E"], case["V"]
    mods = []
    for kind, spec in _parts(case):
        wg = dict(delay_wgrad_compute=spec.get("delay", False), fuse_wgrad_accumulation=spec.get("fuse", False))
        if kind == "embedding":
            mods.append(Embedding(V, S, weight=W["emb"]))
        elif kind == "linear":
            out = V if spec["w"] in ("emb", "head") else S
            mods.append(Linear(S, out, weight=W[spec["w"]], bias=False if spec["b"] is None else W[spec["b"]], **wg))
        else:
            packed = kind == "packed"
            gl = GroupedLinear(E, S, S, bias=packed and spec["b"] is not None, single_grouped_weight=packed, **wg)
            if packed:
                gl.weight = W[spec["w"]]
                if spec["b"] is not None:
                    gl.bias = W[spec["b"]]
            else:
                for e, k in enumerate(spec["experts"]):
                    setattr(gl, f"weight{e}", W[k])
            mods.append(gl)
    return nn.ModuleList(mods), W


def _inputs(case, step, rank, m):
    g = torch.Generator().manual_seed(case["seed"] * 1000 + 100 * step + 10 * rank + m)
    T = case["tokens"][rank][m]
    if case["embed"]:
        return torch.randint(0, case["V"], (T,), generator=g)
    return (torch.randn(T, case["S"], generator=g) * 0.8).to(_dtype(case))


def _loss(case, y):
    return y.float().tanh().square().sum() / (4 * case["mbs"])


def _forward(case, model, inp, splits):
    h, parts = inp, _parts(case)
    for i, pos in _calls(case):
        h = model[i](h, splits[pos]) if parts[i][0] in ("grouped", "packed") else model[i](h)
    return _loss(case, h)


# --- the oracle -----------------------------------------------------------------------------------------

def _oracle_microbatch(case, masters, inp, splits):
    """The loss and, per call in forward order, its run_wgrad groups: lists of ``(key, add)`` where
    ``add(buffer)`` adds this use's contribution in fp32 as the weight's buffer receives it."""
    dtype, parts = _dtype(case), _parts(case)
    cast = (lambda t: t.to(dtype)) if dtype != F32 else (lambda t: t)  # noqa: E731
    leaves, uses = [], []

    def leaf(key):
        t = masters[key].clone().requires_grad_()
        leaves.append(t)
        return t

    h = inp
    for i, pos in _calls(case):
        kind, spec = parts[i]
        if kind == "embedding":
            out = F.embedding(inp, masters["emb"]).to(dtype).requires_grad_()  # fp32 rows, then one cast
            leaves.append(out)
            uses.append([[("emb", out, inp)]])
            h = out
            continue
        if kind == "linear":
            lw = leaf(spec["w"])
            lb = None if spec["b"] is None else leaf(spec["b"])
            h = F.linear(h, cast(lw), None if lb is None else cast(lb))
            uses.append([[(spec["w"], lw, None)]] + ([[(spec["b"], lb, None)]] if lb is not None else []))
            continue
        split = splits[pos]
        if kind == "grouped":
            lws = [leaf(k) for k in spec["experts"]]
            # stacked as the module stacks them: a BLAS call's rounding may depend on its operands' alignment
            ws, bs = torch.stack([cast(w) for w in lws]), None
            groups = [[(k, w, None) for k, w in zip(spec["experts"], lws)]]
        else:
            lw = leaf(spec["w"])
            lb = None if spec["b"] is None else leaf(spec["b"])
            ws, bs = cast(lw), None if lb is None else cast(lb)
            groups = [[(spec["w"], lw, None)]] + ([[(spec["b"], lb, None)]] if lb is not None else [])
        out, start = [], 0
        for e, n in enumerate(split):
            out.append(F.linear(h[start:start + n], ws[e], None if bs is None else bs[e]))
            start += n
        h = torch.cat(out)
        uses.append(groups)
    loss = _loss(case, h)
    grads = dict(zip(map(id, leaves), torch.autograd.grad(loss, leaves, allow_unused=True)))

    def adder(t, ids):
        g = grads[id(t)]
        if g is None:
            return lambda buf: buf
        if ids is not None:
            return lambda buf: buf.index_add_(0, ids, g.to(F32))
        return lambda buf: buf.add_(g.to(F32))
    calls = [[[(k, adder(t, ids)) for k, t, ids in grp] for grp in groups] for groups in uses]
    return loss.detach(), calls


class _Replay:
    """One rank's accumulation as the weights do it: [Note: contribution accounting]."""

    def __init__(self, case, masters):
        self.per_mb = case["policy"] == "per_microbatch"
        self.solo = case["world"] == 1
        self.masters = masters
        self.expected, self.delivered = collections.Counter(), collections.Counter()
        self.buf: dict[str, torch.Tensor] = {}
        self.windows: dict[str, list[torch.Tensor]] = collections.defaultdict(list)

    def forward(self, calls):
        for groups in calls:
            for grp in groups:
                for key, _ in grp:
                    self.expected[key] += 1

    def run(self, groups):
        """One call's wgrads: per group, every add, then one delivery per member."""
        for grp in groups:
            for key, add in grp:
                if key not in self.buf:
                    self.buf[key] = torch.zeros(self.masters[key].shape)
                add(self.buf[key])
            for key, _ in grp:
                self.delivered[key] += 1
                if self.per_mb and self.delivered[key] == self.expected[key]:
                    self.close(key)

    def close(self, key):
        """A reduction point; with one rank the buffer is main_grad itself, one running sum to the end."""
        if key in self.buf and not self.solo:
            self.windows[key].append(self.buf.pop(key))

    def finish(self):
        for key in list(self.buf):
            self.windows[key].append(self.buf.pop(key))


def _deferred(case):
    parts = _parts(case)
    return [i for i, (_, spec) in enumerate(parts) if spec.get("delay", False)]


def _drain_order(case):
    mods = _deferred(case)
    if case["drain"] == "reverse":
        return mods[::-1]
    if case["drain"] == "forward":
        return mods
    return [mods[i] for i in case["drain"]]


def _oracle_step(case, masters, step):
    """Per key: the full fp32 gradient, the element-wise bound's sum of |buffers|, the number of reductions;
    and each rank's losses."""
    world = case["world"]
    delayed = set(_deferred(case))
    windows, losses = collections.defaultdict(list), []
    for r in range(world):
        replay, fifo, rank_losses = _Replay(case, masters), collections.defaultdict(list), []
        for m in range(case["mbs"]):
            loss, calls = _oracle_microbatch(case, masters, _inputs(case, step, r, m), case["splits"][r][m])
            rank_losses.append(loss)
            replay.forward(calls)
            for (i, _), groups in reversed(list(zip(_calls(case), calls))):
                if i in delayed:
                    fifo[i].append(groups)
                else:
                    replay.run(groups)
            if case["drain_at"] == "each" or m == case["mbs"] - 1:
                for i in _drain_order(case):
                    for groups in fifo.pop(i, []):
                        replay.run(groups)
        replay.finish()
        for key, ws in replay.windows.items():
            windows[key].append(ws)
        losses.append(rank_losses)
    out = {}
    for key, per_rank in windows.items():
        n = len(per_rank[0])
        assert all(len(ws) == n for ws in per_rank), (key, [len(ws) for ws in per_rank])
        main = torch.zeros(masters[key].shape)
        for w in range(n):
            total = per_rank[0][w]
            for ws in per_rank[1:]:
                total = total + ws[w]
            main = main + (total if world == 1 else total / world)
        out[key] = (main, sum(b.abs() for ws in per_rank for b in ws), n)
    return out, losses


# --- one case on one rank --------------------------------------------------------------------------------

def _rows(p):
    return slice(p.shard_offset, p.shard_offset + p.shape[0]) if isinstance(p, ShardedWeight) else slice(None)


def _bound(case, abs_sum, n):
    world = case["world"]
    if world <= 2:
        return None  # bit-exact
    return (world + n) / world * torch.finfo(F32).eps * abs_sum


def _gathers(case):
    """Materializations per key in one microbatch: forward, plus dgrad's re-gather of weights (not biases)
    wherever the call's input requires grad (every call but a first Linear/GroupedLinear on plain inputs)."""
    counts, parts = collections.Counter(), _parts(case)
    for n, (i, _) in enumerate(_calls(case)):
        kind, spec = parts[i]
        for g, grp in enumerate(_slots(kind, spec)):
            for key in grp:
                counts[key] += 1 + (kind != "embedding" and n > 0 and g == 0)
    return counts


def _gather_bytes(case, p):
    if not isinstance(p, ShardedWeight) or case["world"] == 1:
        return 0
    return case["world"] * max(p.shard_rows) * math.prod(p.full_shape[1:]) * _dtype(case).itemsize


def _reduce_bytes(case, p):
    if case["world"] == 1:
        return 0
    rows = case["world"] * max(p.shard_rows) if isinstance(p, ShardedWeight) else p.full_shape[0]
    return rows * math.prod(p.full_shape[1:]) * 4


def _run_step(case, model, rank, step, ref_losses):
    """One step of our model on this rank: every microbatch (each loss bit-exact with the oracle's), the
    drains, ``finalize_model_grads``; returns what it returned."""
    order = case["drain"] if isinstance(case["drain"], str) else list(case["drain"])
    for m in range(case["mbs"]):
        loss = _forward(case, model, _inputs(case, step, rank, m), case["splits"][rank][m])
        assert torch.equal(loss.detach(), ref_losses[rank][m]), (step, m, loss.item(), ref_losses[rank][m].item())
        loss.backward()
        if case["drain_at"] == "each" or m == case["mbs"] - 1:
            distwgrad.drain_deferred_wgrads(model, order=order)
    return distwgrad.finalize_model_grads(model)


def _check_grad(k, p, want, bound, step):
    if want is None:
        assert p.grad is None, (k, step)
        return
    assert p.grad is not None and p.grad.dtype == F32 and p.grad.shape == p.shape, (k, step, p.grad)
    if bound is None:
        assert torch.equal(p.grad, want), (k, step, (p.grad - want).abs().max())
    else:
        assert ((p.grad - want).abs() <= bound).all(), (k, step, (p.grad - want).abs().max(), bound.max())


def _check_second_finalize_is_a_noop(model, W):
    grads = {k: None if p.grad is None else (p.grad, p.grad.clone()) for k, p in W.items()}
    assert distwgrad.finalize_model_grads(model) == 0
    for k, p in W.items():
        assert p.grad is None if grads[k] is None else p.grad is grads[k][0] and torch.equal(p.grad, grads[k][1]), k


def _check_one(case, rank, world):
    assert world == case["world"]
    masters = _masters(case)
    model, W = _build(case, masters)
    if case["coalesce"] is not None:  # these modules as units, the rest the root's: [Note: coalesced units]
        distwgrad.coalesce(model, units=[model[i] for i in case["coalesce"]])
    attached = {k: torch.zeros(p.shape) for k, p in W.items()} if case["attach"] else {}
    for k, t in attached.items():
        W[k].main_grad = t  # a caller-owned buffer (Megatron's views into its flat buffer)
    gathers, gathered, reduced = _gathers(case), collections.Counter(), collections.Counter()
    want: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}  # key -> (.grad, its bound) on this rank
    for step in range(STEPS):
        ref, ref_losses = _oracle_step(case, masters, step)
        assert _run_step(case, model, rank, step, ref_losses) == len(ref), (step, sorted(ref))
        for k, p in W.items():
            assert p.pending_contributions == 0, (k, p.pending_contributions)
            if k in ref:
                main, abs_sum, n = ref[k]
                g, b = main[_rows(p)], _bound(case, abs_sum[_rows(p)], n)
                if k in want:  # .grad kept from the last step: the step's gradient is added to it
                    g0, b0 = want[k]
                    g, b = g0 + g, None if b is None else b0 + b + torch.finfo(F32).eps * (g0.abs() + g.abs())
                want[k] = (g, b)
                gathered[k] += gathers[k] * case["mbs"] * _gather_bytes(case, p)
                reduced[k] += n * _reduce_bytes(case, p)
            _check_grad(k, p, *want.get(k, (None, None)), step)
            if case["coalesce"] is None:  # units gather once per unit call, as they learned to
                assert p.bytes_gathered == gathered[k], (k, step, p.bytes_gathered, gathered[k])
            assert p.bytes_reduced == reduced[k], (k, step, p.bytes_reduced, reduced[k])
            assert k not in attached or p.main_grad is attached[k], k
            if hasattr(p, "main_grad"):
                assert p.main_grad.dtype == F32 and p.main_grad.shape == p.shape, (k, p.main_grad.shape, p.shape)
        _check_second_finalize_is_a_noop(model, W)
        if case["zero"] != "keep":  # zeros or None: either way the next step's .grad is its own gradient
            for p in W.values():
                if p.grad is not None:
                    p.grad = None if case["zero"] == "none" else p.grad.zero_()
            want = {}
    return True


# --- the tests -------------------------------------------------------------------------------------------

_SETTINGS = dict(derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@settings(max_examples=_count(1), **_SETTINGS)
@given(case=_cases(1))
def test_one_rank_matches_the_oracle(case):
    _check_one(case, 0, 1)


def _draw(world: int) -> list[dict]:
    """``_count(world)`` cases drawn with a fixed seed, without running them (one spawn runs them all)."""
    drawn: list[dict] = []

    @settings(max_examples=_count(world), phases=[Phase.generate], **_SETTINGS)
    @given(case=_cases(world))
    def collect(case):
        drawn.append(case)
    collect()
    return drawn


def _rank(rank, world, cases):
    return for_each_case(cases, _check_one, rank, world)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_match_the_oracle(world):
    cases = _draw(world)
    assert len(cases) == _count(world)
    assert all(all(r) for r in run_distributed(_rank, world, cases, timeout=600))
