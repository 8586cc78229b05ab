"""FP8 weights kept across microbatches in CUDA graphs ([Note: fp8 weights kept in CUDA graphs] in
``distwgrad/fp8/graph_kept.py``).

On CPU: what a graph records and its capture reads, when the host refreshes the copies, the bytes they hold, and the
graphs' wiring under modelled CUDA. On a GPU: graphs that keep copies give the bits of graphs that quantize at every
use, over steps of three microbatches with fused AdamW, two graphed modules alive at once (so a replay of one could
overwrite what the other keeps).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_graphs import modelled_cuda  # noqa: F401  (a fixture)

import distwgrad
from distwgrad import ShardedWeight
from distwgrad.fp8 import BlockwiseScaling, PerTensorScaling, fp8_autocast
from distwgrad.fp8 import graph_kept as gk
from distwgrad.fp8 import weights as fp8_weights
from distwgrad.fp8.graph_kept import GraphKept
from distwgrad.fp8.weights import _materialize_quantized, _materialize_quantized_group
from distwgrad.nn import GroupedLinear, LayerNormMLP, Linear

RECIPES = [PerTensorScaling(), BlockwiseScaling(act_block=(1, 16), weight_block=(16, 16))]


def _module(kind: str, k: int, n: int, seed: int = 0, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(seed)
    kw = dict(params_dtype=torch.bfloat16, device=device)
    if kind == "linear":
        m = Linear(k, n, **kw)
    elif kind == "mlp":
        m = LayerNormMLP(k, n, **kw)
    else:
        m = GroupedLinear(3, k, n, single_grouped_weight=kind == "grouped", delay_wgrad_compute=True, **kw)
    for name, p in list(m.named_parameters()):  # held whole on one rank: what is kept
        if p.dim() >= 2:
            setattr(m, name, ShardedWeight.from_full(p.detach().clone()))
    return m


def _bits(value) -> list[torch.Tensor]:
    return [t.contiguous().view(torch.uint8) if t.element_size() == 1 else t for t in gk._tensors(value)]


def _fresh_quantization(weights, key):
    """What quantizing ``weights`` now gives for a kept copy's key, from nothing an earlier call left."""
    with gk.fresh():
        if key[0] == "matrices":
            return _materialize_quantized(weights[0], key[1], backward=key[2])
        return _materialize_quantized_group(weights, key[1], backward=key[2], stacked=key[3])


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_bits(a), _bits(b), strict=True))


def _linear_captured(recipe):
    """A ``Linear`` of one held-whole weight, its input, and a ``GraphKept`` that recorded, then captured, its call."""
    m, x = _module("linear", 32, 48), torch.randn(8, 32, dtype=torch.bfloat16)
    kept = GraphKept()
    for open_ in (gk.recording, gk.capturing):
        with fp8_autocast(recipe), open_(kept):
            m(x)
    return m, x, kept


# --- a graph's copies, on the host ---------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", RECIPES, ids=["per_tensor", "blockwise"])
def test_a_graph_records_its_copies_and_its_capture_reads_them(recipe):
    m, x = _module("linear", 32, 48), torch.randn(8, 32, dtype=torch.bfloat16)
    kept = GraphKept()
    with fp8_autocast(recipe), gk.recording(kept):
        recorded = m(x)
    (copy,) = kept.copies.values()
    assert copy.weights == [m.weight] and not copy.captured
    assert _same(copy.value, _materialize_quantized(m.weight, recipe, backward=False))
    with fp8_autocast(recipe), gk.capturing(kept):
        assert torch.equal(m(x), recorded)  # read from the copy: nothing new is recorded
    assert copy.captured and kept.misses == 0 and len(kept.copies) == 1
    other = GraphKept()
    with fp8_autocast(recipe), gk.capturing(other):  # recorded nothing: quantized in the graph, counted
        assert torch.equal(m(x), recorded)
    assert other.misses == 1 and not other.copies


def test_the_host_refreshes_a_copy_only_where_it_cannot_be_reused():
    recipe = PerTensorScaling()
    m, x, kept = _linear_captured(recipe)
    (copy,) = kept.copies.values()
    read = [t.data_ptr() for t in gk._tensors(copy.value)]

    def replay(reuse: bool) -> bool:
        before = kept.refreshes
        kept.before_replay(reuse)
        return kept.refreshes > before

    assert replay(True)  # a graph's first replay refreshes
    assert not replay(True) and replay(False) and not replay(True)
    opt = torch.optim.AdamW([m.weight], lr=0.1, fused=True)  # a fused step moves no _version: the epoch does
    m.weight.grad = torch.ones_like(m.weight)
    opt.step()
    assert not _same(copy.value, _materialize_quantized(m.weight, recipe, backward=False))
    assert replay(True) and not replay(True)
    assert _same(copy.value, _materialize_quantized(m.weight, recipe, backward=False))
    m.weight.discard_step()  # any boundary of the lifecycle
    assert replay(True)
    with torch.no_grad():
        m.weight.add_(1.0)  # an in-place write moves _version
    assert replay(True) and not replay(True)
    assert _same(copy.value, _materialize_quantized(m.weight, recipe, backward=False))
    assert [t.data_ptr() for t in gk._tensors(copy.value)] == read  # in place: the graphs' addresses
    assert (kept.replays, kept.refreshes) == (9, 5)


def test_a_refresh_reads_no_cached_amax():
    """A ``.data`` write moves no token; a refresh the replay's flag asks for still sees it (the amax is fresh)."""
    recipe = PerTensorScaling()
    m, x, kept = _linear_captured(recipe)
    kept.before_replay(False)
    with fp8_autocast(recipe):
        m(x)  # an eager call caches this epoch's amax
    m.weight.data.mul_(4.0)
    kept.before_replay(False)
    (copy,) = kept.copies.values()
    with gk.fresh():
        assert _same(copy.value, _materialize_quantized(m.weight, recipe, backward=False))
    assert copy.value[0].scale_inv.item() == pytest.approx(m.weight.detach().abs().max().item() / 448.0)


def test_a_copy_whose_layout_changed_is_refused():
    recipe = PerTensorScaling()
    m, x, kept = _linear_captured(recipe)
    (copy,) = kept.copies.values()
    copy.make = lambda: _materialize_quantized(ShardedWeight.from_full(torch.randn(16, 32)), recipe, backward=False)
    with pytest.raises(RuntimeError, match=r"changed its layout: \[\(\(48, 32\), torch.float8_e4m3fn\), .*the weights "
                                           r"now give \[\(\(16, 32\)"):
        kept.before_replay(False)


def test_a_kept_copy_carries_no_amax_from_the_call_that_recorded_it(monkeypatch):
    """A backward passes its forward's amax to skip that pass; a copy a graph keeps is re-made steps later, when
    that amax is stale, so it is made from the weights alone (recorded, captured and refreshed)."""
    seen = []
    real = fp8_weights._materialize_quantized_group

    def spy(*args, **kwargs):
        seen.append(kwargs.get("amax"))
        return real(*args, **kwargs)
    monkeypatch.setattr(fp8_weights, "_materialize_quantized_group", spy)
    w = ShardedWeight.from_full(torch.randn(3, 48, 32, dtype=torch.bfloat16))
    kept, stale = GraphKept(), torch.full((3,), 1e6)
    for ctx in (gk.recording, gk.capturing):
        with ctx(kept):
            fp8_weights.materialize_quantized_group([w], PerTensorScaling(), backward=True, stacked=True, amax=stale)
    kept.before_replay(False)
    assert len(seen) == 2 and all(a is None for a in seen)  # recorded, then refreshed (the capture reads the copy)
    fp8_weights.materialize_quantized_group([w], PerTensorScaling(), backward=True, stacked=True, amax=stale)
    assert seen[-1] is stale  # outside a graph the call's amax is used


def test_kept_values_own_their_tensors_and_keep_their_strides():
    value = [torch.arange(12.0).view(3, 4).t(), (torch.zeros(2), 3)]
    owned = gk._map(value, torch.clone)
    assert owned[0].stride() == value[0].stride() and owned[0].data_ptr() != value[0].data_ptr()
    assert owned[1][1] == 3 and type(owned[1]) is tuple and len(gk._tensors(owned)) == 2


# --- the graphs, CUDA modelled ---------------------------------------------------------------------------------
def _graph_kept(mod) -> list[tuple[GraphKept, torch.nn.Module]]:
    """Each callable's ``GraphKept`` (``reset`` is the graphed set's)."""
    return [(c.kept, c.module) for c in mod.reset.__self__.callables]


def _call(mod, kind, x, **kw):
    return mod(x, torch.tensor([4, 0, 4]), **kw) if "grouped" in kind else mod(x, **kw)


@pytest.mark.parametrize("recipe", RECIPES, ids=["per_tensor", "blockwise"])
@pytest.mark.parametrize("kind", ["linear", "grouped", "grouped_discrete", "mlp"])
def test_graphs_keep_each_weight_once_a_layout_and_refresh_once_a_step(modelled_cuda, monkeypatch, kind,  # noqa: F811
                                                                       recipe):
    m = _module(kind, 32, 48)
    extra = (torch.tensor([4, 0, 4]),) if "grouped" in kind else ()
    x = torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=True)
    graphed = distwgrad.make_graphed_callables(m, (x, *extra), fp8_enabled=True, fp8_recipe=recipe,
                                               cache_quantized_params=True)
    ((kept, module),) = _graph_kept(m)
    weights = [p for name, p in module.named_parameters() if p.dim() >= 2 and "bias" not in name]
    layouts = [full[-2 if full[1] == "group" else -1] for full in kept.copies]  # each copy's backward flag
    # forward's and dgrad's layout of fc1 and fc2 (an MLP), else of the weight or the group of experts
    n = 2 if kind == "mlp" else 1
    assert sorted(layouts) == [False] * n + [True] * n and kept.misses == 0
    fp8 = sum(t.numel() for c in kept.copies.values() for t in gk._tensors(c.value) if t.element_size() == 1)
    assert fp8 == 2 * sum(w.numel() for w in weights)  # the promised bytes: one an element per layout
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    for _ in range(3):
        for first in (True, False, False):
            y = _call(graphed, kind, x, is_first_microbatch=first)
            y.backward(torch.ones_like(y))
            distwgrad.drain_deferred_wgrads(m)
        distwgrad.finalize_model_grads([m])
        opt.step()
        opt.zero_grad(set_to_none=True)
    # each step's first forward refreshes forward's and dgrad's copies; its backwards, and the others, reuse
    assert (kept.replays, kept.refreshes) == (18, 3) and all(c.captured for c in kept.copies.values())
    weights[0].data.mul_(0.5)  # a write no token sees
    amaxes = []
    real = fp8_weights.compute_amax
    monkeypatch.setattr(fp8_weights, "compute_amax", lambda t: amaxes.append(1) or real(t))
    kept.before_replay(False)
    if recipe.family == "per_tensor" and kind in ("linear", "mlp"):
        assert len(amaxes) == len(weights)  # one a weight, for both layouts
    for full, c in kept.copies.items():  # a refresh leaves the bits of quantizing the weights now
        assert _same(c.value, _fresh_quantization(c.weights, full[1:])), full[1:]
    m.reset()
    assert not kept.copies


def test_plain_parameters_are_quantized_at_every_use(modelled_cuda):  # noqa: F811
    """A plain ``nn.Parameter`` (no finalize marks its steps, so a ``.data`` write could not be seen) is never kept:
    nothing is recorded for it, and its replays still take the flag, as TE's do."""
    torch.manual_seed(0)
    m, x = Linear(32, 48, params_dtype=torch.bfloat16, device="cpu"), torch.randn(8, 32, dtype=torch.bfloat16)
    graphed = distwgrad.make_graphed_callables(m, (x,), fp8_enabled=True, fp8_recipe=PerTensorScaling(),
                                               cache_quantized_params=True)
    ((kept, _),) = _graph_kept(m)
    assert not kept.copies and kept.misses == 0
    graphed(x, is_first_microbatch=True)
    assert (kept.replays, kept.refreshes) == (1, 0)
    with pytest.raises(TypeError, match="captured with cache_quantized_params=True"):
        graphed(x)
    m.reset()


def test_a_modules_forward_passes_share_its_copies(modelled_cuda):  # noqa: F811
    """Graphed in a pipeline schedule's order (one callable per microbatch), a module keeps one set of copies,
    refreshed by its step's first replay whichever microbatch's it is."""
    m = _module("linear", 32, 48)
    xs = [torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    f0, f1 = distwgrad.make_graphed_callables((m,), ((xs[0],), (xs[1],)), _order=[1, 1, -1, -1],
                                              fp8_enabled=True, fp8_recipe=PerTensorScaling(),
                                              cache_quantized_params=True)
    (kept, _), (other, _) = _graph_kept(f0)
    assert kept is other and len(kept.copies) == 2 and kept.misses == 0  # forward's and dgrad's layout
    for _ in range(2):
        ys = [f(x, is_first_microbatch=i == 0) for i, (f, x) in enumerate(((f0, xs[0]), (f1, xs[1])))]
        for y in ys:
            y.sum().backward()
        distwgrad.finalize_model_grads([m])
    assert (kept.replays, kept.refreshes) == (8, 2)
    f0.reset()


def test_on_a_gpu_a_refresh_is_one_replay_of_a_graph_of_its_own(modelled_cuda, monkeypatch):  # noqa: F811
    """Weights on a GPU: the copies are the refresh graph's outputs, captured in a pool of its own between the
    warm-up and the captures, and a refresh replays it (never an eager copy); ``reset()`` frees it."""
    monkeypatch.setattr(gk, "_on_gpu", lambda w: True)
    pools = []
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None, stream=None: pools.append(pool) or
                        contextlib.nullcontext())
    m, x = _module("mlp", 32, 48), torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=True)
    recorded = []
    real_capture = GraphKept.capture_refresh

    def capture_refresh(self, stream):
        recorded.extend(t for c in self.copies.values() for t in gk._tensors(c.value))
        real_capture(self, stream)
    monkeypatch.setattr(GraphKept, "capture_refresh", capture_refresh)
    graphed = distwgrad.make_graphed_callables(m, (x,), fp8_enabled=True, fp8_recipe=PerTensorScaling(),
                                               cache_quantized_params=True)
    ((kept, _),) = _graph_kept(m)
    assert pools[0] is None  # the refresh graph first, in a pool of its own; then the captures, in theirs
    assert len(pools) > 1 and all(p is not None for p in pools[1:])
    assert len(kept.copies) == 4 and all(c.in_graph for c in kept.copies.values())
    now = [t for c in kept.copies.values() for t in gk._tensors(c.value)]  # the refresh graph's outputs
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(now, recorded, strict=True))
    monkeypatch.setattr(torch, "_foreach_copy_", lambda *a: pytest.fail("an eager refresh on a GPU"))
    for first in (True, False):
        y = graphed(x, is_first_microbatch=first)
        y.backward(torch.ones_like(y))
    assert kept.graph.replays == 1 and (kept.replays, kept.refreshes) == (4, 1)
    refresh = kept.graph
    distwgrad.finalize_model_grads([m])
    m.reset()
    assert refresh.was_reset and kept.graph is None and not kept.copies


# --- graphs on a GPU -----------------------------------------------------------------------------------------
K, N, T = 256, 384, 512


def _train(kind: str, recipe, cache: bool, flags, *, steps: int = 3, write_data: bool = False):
    """Two modules graphed as two callables, ``steps`` steps of ``len(flags)`` microbatches with fused AdamW;
    returns every output, input gradient and parameter gradient in order, and the modules."""
    second = (K, N) if kind == "mlp" else (N, K)  # an MLP maps K to K, the others K to N
    mods = [_module(kind, K, N, 0, "cuda"), _module(kind, *second, 1, "cuda")]
    extra = (torch.tensor([T // 2, 0, T - T // 2], device="cuda"),) if "grouped" in kind else ()
    gen = torch.Generator(device="cuda").manual_seed(1)
    samples = ((torch.randn(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True), *extra),
               (torch.randn(T, second[0], device="cuda", dtype=torch.bfloat16, requires_grad=True), *extra))
    a, b = distwgrad.make_graphed_callables(tuple(mods), samples, fp8_enabled=True, fp8_recipe=recipe,
                                            cache_quantized_params=cache)
    params = [p for m in mods for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
    seen = []
    for _ in range(steps):
        for first in flags:
            x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
            y = b(a(x, *extra, is_first_microbatch=first), *extra, is_first_microbatch=first)
            y.backward(torch.randn(y.shape, device="cuda", dtype=torch.bfloat16, generator=gen))
            for m in mods:
                distwgrad.drain_deferred_wgrads(m)
            seen += [y.detach().clone(), x.grad.clone()]
        distwgrad.finalize_model_grads(mods)
        seen += [p.grad.clone() for p in params]
        opt.step()
        opt.zero_grad(set_to_none=True)
        if write_data:  # a write no version counter sees, between steps
            with torch.no_grad():
                for p in params:
                    p.data.mul_(0.5)
    return seen, mods


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("recipe", [PerTensorScaling(), BlockwiseScaling()], ids=["per_tensor", "blockwise"])
@pytest.mark.parametrize("kind", ["linear", "grouped", "grouped_discrete", "mlp"])
@pytest.mark.parametrize("flags,write_data", [((True, False, False), False), ((False, False, False), True)],
                         ids=["first_then_not", "never_first_and_data_writes"])
def test_kept_in_graphs_gives_the_bits_of_quantizing_at_every_use(kind, recipe, flags, write_data):
    every_use, plain = _train(kind, recipe, False, flags, write_data=write_data)
    kept, mods = _train(kind, recipe, True, flags, write_data=write_data)
    assert len(kept) == len(every_use)
    bad = [i for i, (x, y) in enumerate(zip(kept, every_use)) if not torch.equal(x, y)]
    assert not bad, f"tensors {bad} of {len(kept)} differ"
    for kept_, _ in _graph_kept(mods[0]):  # each step's first forward refreshes; the other replays reuse
        assert (kept_.replays, kept_.refreshes, kept_.misses) == (18, 3, 0)
    mods[0].reset()
    plain[0].reset()
