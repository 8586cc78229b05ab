"""A step's first wgrad written as the buffer instead of added into zeros ([Note: a fresh first
contribution] in ``distwgrad/wgrad/accumulate.py``).

Where it applies (a distributed weight with nothing accumulated, the module's GEMM opting in) the fresh
tensor becomes ``main_grad`` itself and the gradient is the same bits as plain autograd's; where it does
not (an attached ``main_grad``, a later microbatch, the embedding's row scatter, a weight twice in one
call, a CUDA graph capturing) the contribution is an add, as before. Each test counts the adoptions, so
a path that silently stopped (or started) writing fresh fails here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import distwgrad
from distwgrad.nn import Embedding, GroupedLinear, Linear
from distwgrad.weights.base import DistributedParameter
from distwgrad.wgrad import accumulate


@pytest.fixture
def adopted(monkeypatch):
    """The fresh tensors weights adopted, in order."""
    seen: list[torch.Tensor] = []
    adopt = DistributedParameter.adopt_grad_buffer

    def spy(self, wgrad):
        seen.append(wgrad)
        return adopt(self, wgrad)
    monkeypatch.setattr(DistributedParameter, "adopt_grad_buffer", spy)
    return seen


def _shapes(tensors: list[torch.Tensor]) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in tensors]


def _finish(*modules) -> None:
    for m in modules:
        distwgrad.drain_deferred_wgrads(m)
    distwgrad.finalize_model_grads(list(modules))


@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_a_linear_writes_its_first_contribution_fresh(adopted, delay, param_dtype):
    torch.manual_seed(0)
    full, xs = torch.randn(8, 6), [torch.randn(5, 6) for _ in range(2)]
    w = distwgrad.ShardedWeight.from_full(full.clone(), param_dtype=param_dtype)
    m = Linear(6, 8, bias=False, weight=w, delay_wgrad_compute=delay)
    ref = full.clone().requires_grad_()
    dtype = param_dtype or torch.float32
    for step, x in enumerate(xs):
        w.grad = ref.grad = None
        m(x.to(dtype)).float().square().sum().backward()
        _finish(m)
        F.linear(x.to(dtype), ref.to(dtype)).float().square().sum().backward()
        assert _shapes(adopted) == [(8, 6)] * (step + 1), "the first contribution was not written fresh"
        assert w.grad is w.main_grad is adopted[-1], "the fresh product is main_grad itself: nothing else zeroed"
        assert torch.equal(w.grad, ref.grad)


def test_later_microbatches_add_into_the_fresh_main_grad(adopted):
    torch.manual_seed(1)
    full, xs = torch.randn(8, 6), [torch.randn(5, 6) for _ in range(3)]
    w = distwgrad.ShardedWeight.from_full(full.clone())
    m = Linear(6, 8, bias=False, weight=w, delay_wgrad_compute=True)
    ref = full.clone().requires_grad_()
    for x in xs:  # three microbatches of one step
        m(x).square().sum().backward()
        distwgrad.drain_deferred_wgrads(m)
        F.linear(x, ref).square().sum().backward()
    distwgrad.finalize_model_grads(m)
    assert _shapes(adopted) == [(8, 6)], "only the step's first contribution is fresh; the others add"
    assert w.main_grad is adopted[0]
    assert torch.equal(w.grad, ref.grad)


def test_an_attached_main_grad_is_added_into(adopted):
    torch.manual_seed(2)
    full, x = torch.randn(8, 6), torch.randn(5, 6)
    w = distwgrad.ShardedWeight.from_full(full.clone())
    attached = w.main_grad = torch.full((8, 6), 3.0)
    m = Linear(6, 8, bias=False, weight=w)
    ref = full.clone().requires_grad_()
    m(x).square().sum().backward()
    _finish(m)
    F.linear(x, ref).square().sum().backward()
    assert adopted == [] and w.main_grad is attached  # zeroed when the step opened, then added into
    assert torch.equal(attached, ref.grad)


@pytest.mark.parametrize("embedding_first", [False, True])
def test_a_tied_weight_takes_one_fresh_contribution(adopted, embedding_first):
    """The lm_head's dense wgrad may be fresh, the embedding's row scatter is an add; whichever arrives
    first, the gradient is the tied weight's plain-autograd gradient."""
    torch.manual_seed(3)
    V, D = 11, 6
    full, ids = torch.randn(V, D), torch.tensor([[3, 5, 7, 0, 10]])
    w = distwgrad.ShardedWeight.from_full(full.clone())
    emb, head = Embedding(V, D, weight=w), Linear(D, V, bias=False, weight=w, delay_wgrad_compute=embedding_first)
    head(emb(ids).tanh()).square().mean().backward()  # deferred: the head's wgrad comes after the scatter
    _finish(emb, head)
    ref = full.clone().requires_grad_()
    F.linear(F.embedding(ids, ref).tanh(), ref).square().mean().backward()
    assert _shapes(adopted) == ([] if embedding_first else [(V, D)])
    assert torch.equal(w.grad, ref.grad)


@pytest.mark.parametrize("delay", [False, True])
def test_a_packed_expert_weight_with_an_idle_expert(adopted, delay):
    """An expert with no tokens gets exact zeros in the fresh buffer, never memory nobody wrote."""
    torch.manual_seed(4)
    E, K, N, splits = 3, 6, 5, [4, 0, 3]
    full, x = torch.randn(E, N, K), torch.randn(sum(splits), K)
    w = distwgrad.ShardedWeight.from_full(full.clone())
    layer = GroupedLinear(E, K, N, bias=False, single_grouped_weight=True, delay_wgrad_compute=delay)
    layer.weight = w
    layer(x, splits).square().sum().backward()
    _finish(layer)
    ref = full.clone().requires_grad_()
    parts = x.split(splits)
    torch.cat([F.linear(p, ref[e]) for e, p in enumerate(parts)]).square().sum().backward()
    assert _shapes(adopted) == [(E, N, K)] and w.main_grad is adopted[0]
    assert torch.equal(w.grad[1], torch.zeros(N, K))
    assert torch.equal(w.grad, ref.grad)


def test_expert_weights_each_take_their_slice(adopted):
    torch.manual_seed(5)
    E, K, N, splits = 3, 6, 5, [2, 3, 0]
    fulls, x = [torch.randn(N, K) for _ in range(E)], torch.randn(5, K)
    layer = GroupedLinear(E, K, N, bias=False)
    ws = [distwgrad.ShardedWeight.from_full(f.clone()) for f in fulls]
    for e, wt in enumerate(ws):
        setattr(layer, f"weight{e}", wt)
    layer(x, splits).square().sum().backward()
    _finish(layer)
    refs = [f.clone().requires_grad_() for f in fulls]
    torch.cat([F.linear(p, refs[e]) for e, p in enumerate(x.split(splits))]).square().sum().backward()
    assert _shapes(adopted) == [(N, K)] * E
    assert all(wt.main_grad is a for wt, a in zip(ws, adopted))
    for wt, r in zip(ws, refs):
        assert torch.equal(wt.grad, r.grad)


def test_a_weight_twice_in_one_call_is_not_fresh():
    w = distwgrad.ShardedWeight.from_full(torch.zeros(4, 3))
    w.expect_contribution(2)
    assert not accumulate._fresh_first([w, w])  # adopting twice would drop the first wgrad
    assert accumulate._fresh_first([w])
    assert not accumulate._fresh_first([torch.nn.Parameter(torch.zeros(4, 3))])  # plain: a fresh .grad anyway


def test_a_weight_with_something_accumulated_is_not_fresh():
    w = distwgrad.ShardedWeight.from_full(torch.zeros(4, 3))
    assert not w.ready_for_fresh_grad(), "no step is open"
    w.expect_contribution(2)
    assert w.ready_for_fresh_grad()
    w.finalize_group_grads(torch.ones(4, 3))
    assert not w.ready_for_fresh_grad(), "main_grad exists: the second contribution adds"


def test_capturing_weights_are_never_fresh(monkeypatch):
    w = distwgrad.ShardedWeight.from_full(torch.zeros(4, 3))
    w.expect_contribution()
    monkeypatch.setattr(type(w), "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not w.ready_for_fresh_grad(), "a capture bakes in its buffers"


def test_a_fresh_tensor_of_the_wrong_kind_is_refused():
    w = distwgrad.ShardedWeight.from_full(torch.zeros(4, 3))
    w.expect_contribution()
    for bad in (torch.zeros(3, 4), torch.zeros(4, 3, dtype=torch.bfloat16), torch.zeros(3, 4).t()):
        with pytest.raises(RuntimeError, match=r"a fresh first contribution must be a contiguous float32 tensor "
                                               r"of the full shape \(4, 3\)"):
            w.adopt_grad_buffer(bad)
    assert w._life.buffer is None and getattr(w, "main_grad", None) is None


def test_a_fresh_product_for_the_wrong_number_of_weights_is_refused():
    w = distwgrad.ShardedWeight.from_full(torch.zeros(4, 3))
    w.expect_contribution()
    with pytest.raises(RuntimeError, match=r"run_wgrad: fresh\(\) gave 2 wgrads for 1 weights"):
        accumulate.run_wgrad([w], lambda t: t, fuse=False, deferred=False,
                             fresh=lambda: [torch.zeros(4, 3), torch.zeros(4, 3)])


def _accumulation_bound(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Twice the fp32 bound on a T-term dot product, gamma_T |dy|^T |x| (T u / (1 - T u)): each of the two
    results is within gamma_T of the exact product of the 16-bit operands, so they are within 2 gamma_T."""
    T, u = dy.shape[0], 2.0 ** -24
    return 2 * (T * u / (1 - T * u)) * dy.double().abs().t().mm(x.double().abs())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fresh_products_match_the_adds_into_zeros(adopted):
    """On CUDA the fresh dense wgrad is cuBLAS's fp32 output (``mm`` with ``out_dtype``) and the added one
    its epilogue add (``addmm``, beta 1), possibly another algorithm; the fresh grouped wgrad runs the
    Triton kernel and the added one the Gluon kernel (512 tokens per expert), another order of the same
    fp32 sums. So each is within the accumulation bound of the other, and the idle expert is exact zeros."""
    torch.manual_seed(6)
    T, E, K, N = 2048, 4, 512, 256
    splits = [512, 0, 1024, 512]
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)

    def grads():
        dense = distwgrad.ShardedWeight.from_full(torch.full((N, K), 0.01, device="cuda"), param_dtype=torch.bfloat16)
        experts = distwgrad.ShardedWeight.from_full(torch.full((E, N, K), 0.01, device="cuda"),
                                                    param_dtype=torch.bfloat16)
        lin = Linear(K, N, bias=False, weight=dense)
        layer = GroupedLinear(E, K, N, bias=False, single_grouped_weight=True)
        layer.weight = experts
        xr = x.clone().requires_grad_()
        (lin(xr) * dy).float().sum().backward()
        (layer(xr, splits) * dy).float().sum().backward()
        _finish(lin, layer)
        return dense.grad, experts.grad

    fresh_dense, fresh_experts = grads()
    assert len(adopted) == 2, "both wgrads were written fresh"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DistributedParameter, "ready_for_fresh_grad", lambda self: False)
        added_dense, added_experts = grads()
    assert len(adopted) == 2, "the second build added into zeros"
    assert ((fresh_dense.double() - added_dense.double()).abs() <= _accumulation_bound(dy, x)).all()
    for e, (dy_e, x_e) in enumerate(zip(dy.split(splits), x.split(splits))):
        if splits[e]:
            diff = (fresh_experts[e].double() - added_experts[e].double()).abs()
            assert (diff <= _accumulation_bound(dy_e, x_e)).all(), f"expert {e}"
    assert torch.equal(fresh_experts[1], torch.zeros(N, K, device="cuda"))
