"""``distwgrad.make_graphed_callables`` on CUDA: graph replay against the same modules run eagerly, bit for bit.

Every case builds a two-layer model twice from one seed, graphs one copy and runs the other eagerly,
then runs two steps of ``microbatches`` forward / backward / ``drain_deferred_wgrads``, an in-place SGD update
and ``zero_grad(set_to_none)``, comparing every ``.grad`` (and ``main_grad``) with ``torch.equal``: the graph
replays the kernels eager distwgrad runs, in the same order (not a TF32 cuBLAS reference). After
``zero_grad(set_to_none=True)`` tensors filled with a sentinel are allocated into the freed gradient blocks;
they must be untouched by the replays ([Note: graphed deferred wgrads] in ``distwgrad/graphs.py``).

The grid (schedule x set_to_none x dtype x bias x tied x microbatches x fused x layer; grouped layers in bf16
only, see ``test_grouped_fp32``) has 256 cases; a fixed seed (``random.Random(0)``) picks 28 of them, covering
every value of every axis; the rest are marked ``full`` (``pytest --full`` runs them). Grouped layers need the
Triton kernels (``distwgrad.kernels``, an installed checkout): the reference route reads offsets on the host.
"""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distwgrad
from distwgrad.nn import GroupedLinear, Linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

K, T, E = 64, 48, 3  # width, tokens, experts
SPLITS = [16, 8, 24]


class _Chain(nn.Module):
    """Two layers in sequence; grouped layers take ``splits`` (a CUDA tensor: no host sync)."""

    def __init__(self, a: nn.Module, b: nn.Module, grouped: bool) -> None:
        super().__init__()
        self.a, self.b, self.grouped = a, b, grouped

    def forward(self, x, splits=None):
        if self.grouped:
            return self.b(self.a(x, splits), splits)
        return self.b(self.a(x))


def _need_kernels(kind: str) -> None:
    from distwgrad.ops.grouped_gemm import kernels_available

    if kind != "linear" and not kernels_available(torch.empty(0, device="cuda")):
        pytest.skip("grouped layers in bf16 need distwgrad.kernels (pip install -e .); the reference route reads "
                    "the offsets on the host, which make_graphed_callables refuses")


def _layer(kind: str, dtype, bias: bool, fuse: bool) -> nn.Module:
    common = dict(params_dtype=dtype, device="cuda", delay_wgrad_compute=True, fuse_wgrad_accumulation=fuse)
    if kind == "linear":
        return Linear(K, K, bias=bias, **common)
    return GroupedLinear(E, K, K, bias=bias, single_grouped_weight=(kind == "packed"), **common)


def _tie(a: nn.Module, b: nn.Module) -> None:
    for name, p in list(a.named_parameters(recurse=False)):
        setattr(b, name, p)


def _build(kind, dtype, bias, tied, fuse, seed=0) -> _Chain:
    torch.manual_seed(seed)
    a, b = _layer(kind, dtype, bias, fuse), _layer(kind, dtype, bias, fuse)
    if tied:
        _tie(a, b)
    model = _Chain(a, b, grouped=kind != "linear")
    if fuse:
        for p in model.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device="cuda")
    return model


def _graph(model: _Chain, schedule: str, x: torch.Tensor, splits: torch.Tensor):
    """Returns ``run(x)`` replaying the graphs, for the whole model or layer by layer."""
    extra = (splits,) if model.grouped else ()
    if schedule == "whole":
        g = distwgrad.make_graphed_callables(model, (x, *extra))
        return lambda inp: g(inp, *extra), g
    with torch.no_grad():
        h = model.a(x, *extra).detach().requires_grad_()
    ga, gb = distwgrad.make_graphed_callables((model.a, model.b), ((x, *extra), (h, *extra)))
    return lambda inp: gb(ga(inp, *extra), *extra), ga


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    out = {}
    for name, p in model.named_parameters():
        out[name] = None if p.grad is None else p.grad.clone()
        if getattr(p, "main_grad", None) is not None:
            out[name + ".main_grad"] = p.main_grad.clone()
    return out


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name in want:
        g, w = got[name], want[name]
        assert (g is None) == (w is None), f"{what}: {name} is {g is None and 'None' or 'set'} (eager: {w is None})"
        if w is not None:
            diff = (g.float() - w.float()).abs().max().item()
            assert torch.equal(g, w), f"{what}: {name} differs from eager by up to {diff:.3g} ({w.dtype})"


def _pressure(model: nn.Module) -> list[torch.Tensor]:
    """Sentinel tensors the size of every parameter, allocated after .grad was freed (they reuse its blocks)."""
    return [torch.full_like(p, 7.0) for p in model.parameters() for _ in range(2)]


def _step(run, model, xs, probes):
    for x, probe in zip(xs, probes):
        (run(x).float() * probe).sum().backward()
        distwgrad.drain_deferred_wgrads(model)


def _compare(kind, schedule, set_to_none, dtype, bias, tied, microbatches, fuse):
    _need_kernels(kind)
    eager, graphed = _build(kind, dtype, bias, tied, fuse), _build(kind, dtype, bias, tied, fuse)
    splits = torch.tensor(SPLITS, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    sample = torch.randn(T, K, device="cuda", dtype=dtype, generator=gen)
    run, handle = _graph(graphed, schedule, sample, splits)
    extra = (splits,) if eager.grouped else ()
    assert all(p.grad is None for p in graphed.parameters()), "graphing must not touch .grad"
    for step in range(2):
        xs = [torch.randn(T, K, device="cuda", dtype=dtype, generator=gen) for _ in range(microbatches)]
        probes = [torch.randn(T, K, device="cuda", generator=gen) for _ in range(microbatches)]
        _step(lambda x: eager(x, *extra), eager, xs, probes)
        sentinels = _pressure(graphed) if step and set_to_none else []
        _step(run, graphed, xs, probes)
        what = f"step {step}"
        _assert_same(_grads(graphed), _grads(eager), what)
        assert all(bool((s == 7.0).all()) for s in sentinels), f"{what}: a replay wrote outside the gradients"
        with torch.no_grad():
            for m in (eager, graphed):
                for p in m.parameters():
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-0.01)
                    if getattr(p, "main_grad", None) is not None:
                        p.add_(p.main_grad.to(p.dtype), alpha=-0.01)
                        p.main_grad.zero_()
                m.zero_grad(set_to_none=set_to_none)
    handle.reset()


_AXES = dict(kind=["linear", "grouped", "packed"], schedule=["whole", "per_module"], set_to_none=[True, False],
             dtype=[torch.float32, torch.bfloat16], bias=[False, True], tied=[False, True], microbatches=[1, 3],
             fuse=[False, True])


def _cases():
    grid = [dict(zip(_AXES, values)) for values in itertools.product(*_AXES.values())
            if values[0] == "linear" or values[3] != torch.float32]  # fp32 grouped: test_grouped_fp32
    picked = random.Random(0).sample(range(len(grid)), 28)
    for axis, values in _AXES.items():  # every value of every axis at least once
        for v in values:
            if not any(grid[i][axis] == v for i in picked):
                picked.append(next(i for i, c in enumerate(grid) if c[axis] == v))
    for i, case in enumerate(grid):
        marks = () if i in picked else (pytest.mark.full,)
        name = "-".join(f"{k}={str(v).replace('torch.', '')}" for k, v in case.items())
        yield pytest.param(case, id=name, marks=marks)


@pytest.mark.parametrize("case", list(_cases()))
def test_graph_replay_matches_eager(case):
    _compare(**case)


def test_grouped_fp32():
    """fp32 grouped GEMMs take ``torch._grouped_mm``, whose fp32 path may read the offsets on the host: then
    graphing is refused with the host-sync error; where it does not, replay must match eager."""
    try:
        _compare("grouped", "whole", True, torch.float32, True, False, 1, False)
    except RuntimeError as e:
        assert "synchronizes with the host" in str(e), e


def test_fp16_linear():
    _compare("linear", "whole", True, torch.float16, True, True, 3, False)


def test_layernorm_mlp():
    from distwgrad.nn import LayerNormMLP

    torch.manual_seed(0)
    eager = nn.Sequential(*[LayerNormMLP(K, 2 * K, params_dtype=torch.bfloat16, device="cuda",
                                         delay_wgrad_compute=True) for _ in range(2)])
    graphed = copy.deepcopy(eager)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    g = distwgrad.make_graphed_callables(graphed, (x,))
    for step in range(2):
        for m in (eager, g):
            m(x).float().square().sum().backward()
            distwgrad.drain_deferred_wgrads(m)
        _assert_same(_grads(graphed), _grads(eager), f"step {step}")
        eager.zero_grad(set_to_none=True)
        graphed.zero_grad(set_to_none=True)
    g.reset()


@pytest.mark.parametrize("kind", ["linear", "grouped"])
def test_fp8_recipe(kind):
    _need_kernels(kind)
    recipe = distwgrad.fp8.PerTensorScaling()
    eager = _build(kind, torch.bfloat16, True, False, False)
    graphed = copy.deepcopy(eager)
    splits = torch.tensor(SPLITS, device="cuda")
    extra = (splits,) if eager.grouped else ()
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    g = distwgrad.make_graphed_callables(graphed, (x, *extra), fp8_enabled=True, fp8_recipe=recipe)
    for _ in range(2):
        with distwgrad.fp8.fp8_autocast(recipe):
            eager(x, *extra).float().square().sum().backward()
        distwgrad.drain_deferred_wgrads(eager)
        g(x, *extra).float().square().sum().backward()
        distwgrad.drain_deferred_wgrads(graphed)
    _assert_same(_grads(graphed), _grads(eager), "fp8")
    g.reset()


def test_host_sync_is_refused():
    class Syncs(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = Linear(K, K, device="cuda", delay_wgrad_compute=True)

        def forward(self, x):
            return self.lin(x) * float(x.abs().max().item())

    with pytest.raises(RuntimeError, match="synchronizes with the host"):
        distwgrad.make_graphed_callables(Syncs(), (torch.randn(T, K, device="cuda"),))


def test_replaced_main_grad_is_refused_and_nothing_written():
    model = _build("linear", torch.float32, False, False, True)
    x = torch.randn(T, K, device="cuda")
    g = distwgrad.make_graphed_callables(model, (x,))
    g(x).sum().backward()
    old = model.a.weight.main_grad
    model.a.weight.main_grad = torch.zeros_like(old)
    before = old.clone()
    with pytest.raises(RuntimeError, match="main_grad was replaced"):
        distwgrad.drain_deferred_wgrads(model)
    torch.cuda.synchronize()
    assert torch.equal(old, before) and not model.a.weight.main_grad.any()
    model.a.weight.main_grad = old
    distwgrad.drain_deferred_wgrads(model)
    g.reset()


def test_uncloned_parameter_grads_and_warmup_hooks():
    """``clone_param_grads_on_return=False`` hands autograd the graph's static parameter gradients (autograd
    copies what it keeps as ``.grad`` while the graph holds them): the same values as eager; the warm-up hooks
    run once each, around all the warm-up iterations. The loss weights the output by a probe, as ``_step`` does: a
    plain ``.sum()`` hands eager backward a stride-0 gradient, which ``mm`` copies into another layout than the
    graph's contiguous static one, so cuBLAS would run another kernel and sum in another order."""
    torch.manual_seed(0)
    eager = nn.Sequential(Linear(K, K, params_dtype=torch.float32, device="cuda"))
    graphed_model = copy.deepcopy(eager)
    calls = []
    x = torch.randn(T, K, device="cuda")
    g = distwgrad.make_graphed_callables(graphed_model, (x.clone().requires_grad_(),), num_warmup_iters=2,
                                         clone_param_grads_on_return=False,
                                         pre_warmup_hook=lambda: calls.append("pre"),
                                         post_warmup_hook=lambda: calls.append("post"))
    assert calls == ["pre", "post"]
    for step in range(2):
        xi, probe = torch.randn(T, K, device="cuda"), torch.randn(T, K, device="cuda")
        for m in (eager, graphed_model):
            m.zero_grad(set_to_none=True)
        (eager(xi.clone().requires_grad_()) * probe).sum().backward()
        (g(xi.clone().requires_grad_()) * probe).sum().backward()
        _assert_same(_grads(graphed_model), _grads(eager), f"step {step}")  # the same kernels: bit-exact
    g.reset()


def test_reset_frees_the_pool_and_replay_after_reset_raises():
    model = _build("linear", torch.bfloat16, True, False, False)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_reserved()
    g = distwgrad.make_graphed_callables(model, (x,))
    g(x).float().sum().backward()
    distwgrad.drain_deferred_wgrads(model)
    model.zero_grad(set_to_none=True)
    held = torch.cuda.memory_reserved()
    g.reset()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the released pool's blocks go back to the allocator's cache, then to the device
    assert torch.cuda.memory_reserved() < held, (base, held, torch.cuda.memory_reserved())
    with pytest.raises(RuntimeError, match=r"reset\(\)"):
        g(x)


def _run_schedule(order, forward, xs):
    """Runs ``order`` ([Note: capture in schedule order]) for two chunks, one rank: chunk 2 takes chunk 1's
    output detached (a pipeline's send), its backward hands chunk 1 the input gradient (the receive)."""
    outs, inputs, fwd, bwd = {}, {}, [0, 0], [0, 0]
    for c in order:
        k = abs(c) - 1
        if c > 0:
            m, fwd[k] = fwd[k], fwd[k] + 1
            inputs[k, m] = xs[m] if k == 0 else outs[0, m].detach().requires_grad_()
            outs[k, m] = forward(k, m, inputs[k, m])
        else:
            m, bwd[k] = bwd[k], bwd[k] + 1
            if k == 1:
                outs[1, m].float().square().sum().backward()
            else:
                outs[0, m].backward(inputs[1, m].grad)


@pytest.mark.parametrize("fuse", [False, True])
def test_capture_in_schedule_order_matches_eager(fuse):
    """Two chunks of one layer over two microbatches, captured and replayed in an interleaved 1F1B order
    (``_order``), against the same schedule run eagerly: every gradient bit for bit."""
    torch.manual_seed(0)
    order = [1, 1, 2, -2, 2, -2, -1, -1]
    chunks = [Linear(K, K, device="cuda", delay_wgrad_compute=True, fuse_wgrad_accumulation=fuse) for _ in range(2)]
    eager = copy.deepcopy(chunks)
    samples = tuple((torch.randn(T, K, device="cuda", requires_grad=True),) for _ in range(4))
    fns = distwgrad.make_graphed_callables(tuple(chunks), samples, _order=order)
    assert len(fns) == 4
    for step in range(2):
        xs = [torch.randn(T, K, device="cuda", requires_grad=True) for _ in range(2)]
        _run_schedule(order, lambda k, m, h: fns[2 * k + m](h), xs)
        _run_schedule(order, lambda k, m, h: eager[k](h), [x.detach().clone().requires_grad_() for x in xs])
        distwgrad.drain_deferred_wgrads(chunks)
        distwgrad.drain_deferred_wgrads(eager)
        for g, e in zip(chunks, eager):
            for (name, p), q in zip(g.named_parameters(), e.parameters()):
                got, want = (p.main_grad, q.main_grad) if fuse and name == "weight" else (p.grad, q.grad)
                assert torch.equal(got, want), (step, name)
        for m in chunks + eager:
            m.zero_grad(set_to_none=True)
            if fuse:
                m.weight.main_grad.zero_()
    fns[0].reset()


@pytest.fixture
def nccl_world(tmp_path):
    if not dist.is_nccl_available():
        pytest.skip("no NCCL")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("delay", [True, False])
def test_sharded_weight_one_rank_nccl(nccl_world, delay):
    """A ShardedWeight on a one-rank NCCL group: the graph-owned buffer and the replayed accounting."""
    torch.manual_seed(0)
    full = torch.randn(K, K, device="cuda")

    def build():
        w = distwgrad.ShardedWeight.from_full(full, group=nccl_world)
        return _Chain(Linear(K, K, bias=False, weight=w, device="cuda", delay_wgrad_compute=delay),
                      Linear(K, K, bias=False, weight=w, device="cuda", delay_wgrad_compute=delay), grouped=False)

    eager, graphed = build(), build()
    x = torch.randn(T, K, device="cuda")
    g = distwgrad.make_graphed_callables(graphed, (x,))
    for step in range(2):
        for m, run in ((eager, eager), (graphed, g)):
            for _ in range(2):
                run(x).square().sum().backward()
                distwgrad.drain_deferred_wgrads(m)
            distwgrad.finalize_model_grads(m)
        _assert_same(_grads(graphed), _grads(eager), f"step {step}")
        eager.zero_grad(set_to_none=True)
        graphed.zero_grad(set_to_none=True)
    g.reset()


@pytest.mark.parametrize("kind", ["linear", "packed"])
def test_fp8_per_tensor_scales_follow_the_weights(nccl_world, kind):
    """Per-tensor FP8 on tied ShardedWeights (bf16 compute on fp32 masters), graphed: every replay quantizes
    with the amax of the weights it reads ([Note: amax under capture] in ``distwgrad/fp8/weights.py``). The
    weights grow 4x between steps, their amax with them, and ``sync_weight_amax`` refreshes the eager cache as
    the job's step does; the graphed gradients stay eager's, bit for bit. A graph that read the capture's
    cached amax (freed by the next refresh) would quantize with a stale scale and saturate."""
    _need_kernels(kind)
    from distwgrad.fp8 import PerTensorScaling, fp8_autocast
    from distwgrad.fp8.weights import sync_weight_amax

    recipe = PerTensorScaling()
    torch.manual_seed(0)
    full = torch.randn(*((E,) if kind == "packed" else ()), K, K, device="cuda") / 8

    def layer(w):
        if kind == "linear":
            return Linear(K, K, bias=False, weight=w, device="cuda", delay_wgrad_compute=True)
        m = GroupedLinear(E, K, K, bias=False, single_grouped_weight=True, delay_wgrad_compute=True, device="meta")
        m.weight = w
        return m

    def build():
        w = distwgrad.ShardedWeight.from_full(full, group=nccl_world, param_dtype=torch.bfloat16)
        return _Chain(layer(w), layer(w), grouped=kind == "packed")

    eager, graphed = build(), build()
    extra = (torch.tensor(SPLITS, device="cuda"),) if kind == "packed" else ()
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    g = distwgrad.make_graphed_callables(graphed, (x, *extra), fp8_enabled=True, fp8_recipe=recipe)
    for step in range(3):
        for m, run in ((eager, eager), (graphed, g)):
            sync_weight_amax(m)
            with fp8_autocast(recipe):
                run(x, *extra).float().square().sum().backward()
            distwgrad.drain_deferred_wgrads(m)
            distwgrad.finalize_model_grads(m)
        _assert_same(_grads(graphed), _grads(eager), f"step {step}")
        with torch.no_grad():
            for m in (eager, graphed):
                for p in m.parameters():
                    p.mul_(4.0)
                m.zero_grad(set_to_none=True)
    g.reset()
