"""FP8 weights kept across microbatches in CUDA graphs ([Note: fp8 weights kept in CUDA graphs] in
``distwgrad/fp8/graph_kept.py``).

On CPU: what a graph records and its capture reads, when the host refreshes the copies, and the graphs' wiring under
modelled CUDA. On a GPU: graphs that keep copies give the bits of graphs that quantize at every use, over steps of
three microbatches with fused AdamW, two graphed modules alive at once (so a replay of one could overwrite what the
other keeps), and hold the bytes they promise.
"""

from __future__ import annotations

import pytest
import torch
from test_graphs import modelled_cuda  # noqa: F401  (a fixture)

import distwgrad
from distwgrad import ShardedWeight
from distwgrad.fp8 import BlockwiseScaling, PerTensorScaling, fp8_autocast
from distwgrad.fp8 import graph_kept as gk
from distwgrad.fp8.graph_kept import GraphKept
from distwgrad.fp8.weights import _materialize_quantized
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


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_bits(a), _bits(b), strict=True))


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
    m, x = _module("linear", 32, 48), torch.randn(8, 32, dtype=torch.bfloat16)
    kept = GraphKept()
    with fp8_autocast(recipe), gk.recording(kept):
        m(x)
    with fp8_autocast(recipe), gk.capturing(kept):
        m(x)
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
    m, x = _module("linear", 32, 48), torch.randn(8, 32, dtype=torch.bfloat16)
    kept = GraphKept()
    with fp8_autocast(recipe), gk.recording(kept):
        m(x)
    with fp8_autocast(recipe), gk.capturing(kept):
        m(x)
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
    m, x = _module("linear", 32, 48), torch.randn(8, 32, dtype=torch.bfloat16)
    kept = GraphKept()
    with fp8_autocast(recipe), gk.recording(kept):
        m(x)
    with fp8_autocast(recipe), gk.capturing(kept):
        m(x)
    (copy,) = kept.copies.values()
    copy.make = lambda: _materialize_quantized(ShardedWeight.from_full(torch.randn(16, 32)), recipe, backward=False)
    with pytest.raises(RuntimeError, match=r"changed its layout: \[\(\(48, 32\), torch.float8_e4m3fn\), .*the weights "
                                           r"now give \[\(\(16, 32\)"):
        kept.before_replay(False)


def test_kept_values_own_their_tensors_and_keep_their_strides():
    value = [torch.arange(12.0).view(3, 4).t(), (torch.zeros(2), 3)]
    owned = gk._map(value, torch.clone)
    assert owned[0].stride() == value[0].stride() and owned[0].data_ptr() != value[0].data_ptr()
    assert owned[1][1] == 3 and type(owned[1]) is tuple and len(gk._tensors(owned)) == 2


# --- the graphs, CUDA modelled ---------------------------------------------------------------------------------
def _graph_kept(mod) -> list[tuple[GraphKept, GraphKept, torch.nn.Module]]:
    """Each callable's forward and backward ``GraphKept`` (``reset`` is the graphed set's)."""
    return [(c.kept_fwd, c.kept_bwd, c.module) for c in mod.reset.__self__.callables]


def _call(mod, kind, x, **kw):
    return mod(x, torch.tensor([4, 0, 4]), **kw) if "grouped" in kind else mod(x, **kw)


@pytest.mark.parametrize("recipe", RECIPES, ids=["per_tensor", "blockwise"])
@pytest.mark.parametrize("kind", ["linear", "grouped", "grouped_discrete", "mlp"])
def test_graphs_keep_each_weight_once_a_layout_and_refresh_once_a_step(modelled_cuda, kind, recipe):  # noqa: F811
    m = _module(kind, 32, 48)
    extra = (torch.tensor([4, 0, 4]),) if "grouped" in kind else ()
    x = torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=True)
    graphed = distwgrad.make_graphed_callables(m, (x, *extra), fp8_enabled=True, fp8_recipe=recipe,
                                               cache_quantized_params=True)
    ((fwd, bwd, module),) = _graph_kept(m)
    weights = [p for name, p in module.named_parameters() if p.dim() >= 2 and "bias" not in name]
    copies = 2 if kind == "mlp" else 1  # fc1 and fc2; a group of experts is one copy
    assert len(fwd.copies) == len(bwd.copies) == copies and fwd.misses == bwd.misses == 0
    for g in (fwd, bwd):  # the promised bytes: one an element per layout (plus the scales)
        fp8 = sum(t.numel() for c in g.copies.values() for t in gk._tensors(c.value) if t.element_size() == 1)
        assert fp8 == sum(w.numel() for w in weights)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    for _ in range(3):
        for first in (True, False, False):
            y = _call(graphed, kind, x, is_first_microbatch=first)
            y.backward(torch.ones_like(y))
            distwgrad.drain_deferred_wgrads(m)
        distwgrad.finalize_model_grads([m])
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert (fwd.replays, fwd.refreshes) == (9, 3) and (bwd.replays, bwd.refreshes) == (9, 3)
    assert all(c.captured for g in (fwd, bwd) for c in g.copies.values())
    for g in (fwd, bwd):  # a refresh leaves the bits of the weights now
        g.before_replay(False)
        for c in g.copies.values():
            assert _same(c.value, c.make())
    m.reset()
    assert not fwd.copies and not bwd.copies


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
    for fwd, bwd, _ in _graph_kept(mods[0]):
        # each step's first replay of each graph refreshes; the others reuse
        assert (fwd.replays, fwd.refreshes, fwd.misses) == (9, 3, 0)
        assert (bwd.replays, bwd.refreshes, bwd.misses) == (9, 3, 0)
    mods[0].reset()
    plain[0].reset()
