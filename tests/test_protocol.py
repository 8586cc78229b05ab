"""The DistributedWeight protocol's wiring, seen from the modules.

A conformance fake scales by powers of two (exact in fp32) so each hook shows in the numbers:
forward materialization x2, backward materialization x4, and ``finalize_group_grads`` returns x8 of
what it received. A module that skipped a hook, reused the forward copy in backward, or dropped or
double-used finalize's return value fails its own assertion.
"""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch

import distwgrad
from distwgrad import ShardedWeight
from distwgrad.nn import GroupedLinear, Linear
from distwgrad.testing.multiprocess import run_distributed


class ScalingFake(torch.nn.Parameter):
    """Follows TransformerEngine's documented contract; is not one of distwgrad's own weights. A group of
    one exchanges bare tensors ([Note: one-member groups exchange bare tensors])."""

    is_distributed_weight = True

    def materialize_group_for_forward(self):
        self.calls.append("fwd")
        return self.detach() * 2

    def materialize_group_for_backward(self):
        self.calls.append("bwd")
        return self.detach() * 4

    def grad_buffer(self):
        if self.buffer is None:
            self.buffer = torch.zeros(self.shape, dtype=torch.float32)
        return self.buffer

    def finalize_group_grads(self, wgrads):
        self.calls.append("finalize")
        assert isinstance(wgrads, torch.Tensor), "a one-member group receives a bare tensor"
        # grad_buffer() is the fused path's scratch (TE's contract); unfused, a fresh allocation
        assert (wgrads is self.buffer) == self.fused, "fused modules pass the buffer they accumulated into"
        out = (wgrads * 8).to(self.dtype)
        self.buffer = None
        return out


def _fake(t, fused=False):
    p = ScalingFake(t.clone())
    p.calls, p.buffer, p.fused = [], None, fused
    return p


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("delay", [False, True])
def test_conformance_fake_in_linear(delay, fuse):
    torch.manual_seed(0)
    w = torch.randn(6, 5)
    lin = Linear(5, 6, bias=False, weight=_fake(w, fused=fuse), delay_wgrad_compute=delay,
                 fuse_wgrad_accumulation=fuse)
    x = torch.randn(3, 5, requires_grad=True)
    y = lin(x)
    assert torch.equal(y, x.detach() @ (2 * w).t())  # forward copy used in forward
    dy = torch.randn_like(y)
    y.backward(dy)
    assert torch.equal(x.grad, dy @ (4 * w))  # re-materialized in backward, not the x2 forward copy
    lin.backward_dw()
    # finalize's return value lands in .grad exactly once, on both paths.
    assert torch.equal(lin.weight.grad, (dy.t() @ x.detach()) * 8)
    assert lin.weight.calls == ["fwd", "bwd", "finalize"]


@pytest.mark.parametrize("delay", [False, True])
def test_conformance_fake_in_grouped_linear(delay):
    torch.manual_seed(0)
    g = GroupedLinear(2, 5, 6, bias=False, delay_wgrad_compute=delay)
    ws = [torch.randn(6, 5) for _ in range(2)]
    g.weight0, g.weight1 = _fake(ws[0]), _fake(ws[1])
    # A foreign leader acts for its group: give weight0 a group-level implementation.
    lead, other = g.weight0, g.weight1
    lead.materialize_group_for_forward = lambda: [lead.detach() * 2, other.detach() * 2]
    lead.materialize_group_for_backward = lambda: [lead.detach() * 4, other.detach() * 4]
    lead.finalize_group_grads = lambda wgrads: [(wg * 8).to(torch.float32) for wg in wgrads]
    lead.grad_buffer()
    other.grad_buffer()
    x = torch.randn(7, 5, requires_grad=True)
    y = g(x, [3, 4])
    assert torch.equal(y[:3], x.detach()[:3] @ (2 * ws[0]).t())
    dy = torch.randn_like(y)
    y.backward(dy)
    assert torch.equal(x.grad[3:], dy[3:] @ (4 * ws[1]))
    g.backward_dw()
    assert torch.equal(g.weight1.grad, (dy[3:].t() @ x.detach()[3:]) * 8)


def test_plain_leader_with_distributed_followers_is_rejected():
    with pytest.raises(TypeError, match="leader weights\\[0\\] is a plain tensor"):
        distwgrad.materialize_weight_for_forward([torch.zeros(2), _fake(torch.zeros(2))])


def test_plain_tensors_pass_through():
    t = torch.randn(3)
    assert distwgrad.materialize_weight_for_forward([t])[0] is t
    assert distwgrad.finalize_weight_grads([t], [t])[0] is t
    for single in (distwgrad.materialize_weight_for_forward, distwgrad.materialize_weight_for_backward):
        out = single(t)  # one weight, not a list: still a list back, the same object in it
        assert isinstance(out, list) and len(out) == 1 and out[0] is t


def test_saved_tensors_hooks_keep_the_weight_object():
    """Activation offloading replaces saved tensors; the weight must still reach backward as itself."""
    torch.manual_seed(0)
    w = torch.randn(6, 5)
    x = torch.randn(3, 5)
    results = []
    for offload in (False, True):
        lin = Linear(5, 6, bias=False, weight=_fake(w))
        if offload:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t.clone()):
                y = lin(x.clone().requires_grad_())
        else:
            y = lin(x.clone().requires_grad_())
        y.sum().backward()
        assert lin.weight.calls == ["fwd", "bwd", "finalize"]
        results.append(lin.weight.grad)
    assert torch.equal(results[0], results[1])


def test_over_delivery_raises():
    w = ShardedWeight.from_full(torch.zeros(4, 2))
    w.expect_contribution()
    w.finalize_group_grads([w.grad_buffer()])
    with pytest.raises(RuntimeError, match="received contribution 2 but only 1 uses"):
        w.finalize_group_grads([w.grad_buffer()])


def _all_dead(refs, wait_s=2.0):
    """True once every referent is gone. gloo's worker thread may drop its reference to a collective's
    output a moment after the call returns, so poll briefly; a cached copy would never die."""
    deadline = time.monotonic() + wait_s
    while True:
        gc.collect()
        if all(r() is None for r in refs):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def _transient_rank(rank, world, delay, packed):
    torch.manual_seed(0)
    gathered: list[weakref.ref] = []
    original = ShardedWeight._gather

    def spy(self):
        full = original(self)
        gathered.append(weakref.ref(full))
        return full

    ShardedWeight._gather = spy
    try:
        if packed == "discrete":
            mod = GroupedLinear(2, 8, 6, bias=False, delay_wgrad_compute=delay)
            mod.weight0 = ShardedWeight.from_full(torch.randn(6, 8))
            mod.weight1 = ShardedWeight.from_full(torch.randn(6, 8))
            run = lambda x: mod(x, [3, 2])
        elif packed:
            mod = GroupedLinear(2, 8, 6, bias=False, single_grouped_weight=True, delay_wgrad_compute=delay)
            mod.weight = ShardedWeight.from_full(torch.randn(2, 6, 8))
            run = lambda x: mod(x, [3, 2])
        else:
            mod = Linear(8, 6, bias=False, delay_wgrad_compute=delay)
            mod.weight = ShardedWeight.from_full(torch.randn(6, 8))
            run = mod
        for _ in range(2):  # two microbatches: nothing cached from the first
            x = torch.randn(5, 8, requires_grad=True)
            y = run(x)
            assert gathered and _all_dead(gathered), "forward kept a gathered copy alive"
            y.sum().backward()
            assert _all_dead(gathered), "backward kept a gathered copy alive"
            mod.backward_dw()
        assert distwgrad.finalize_model_grads([mod]) == (2 if packed == "discrete" else 1)
        return len(gathered) // (2 if packed == "discrete" else 1)
    finally:
        ShardedWeight._gather = original


@pytest.mark.distributed
@pytest.mark.parametrize("packed", [False, True, "discrete"])
@pytest.mark.parametrize("delay", [False, True])
def test_gathered_copies_are_transient(delay, packed):
    # Two gathers per microbatch (forward, backward), two microbatches.
    assert run_distributed(_transient_rank, 2, delay, packed, timeout=120) == [4, 4]


def test_te_module_name_exposes_the_same_dispatchers():
    from distwgrad import distributed_weight, protocol

    for name in distributed_weight.__all__:
        assert getattr(distributed_weight, name) is getattr(protocol, name)
    assert isinstance(_fake(torch.zeros(2)), distributed_weight.DistributedWeight)


def test_deepcopy_keeps_state_group_and_ties():
    import copy

    torch.manual_seed(0)
    w = ShardedWeight.from_full(torch.randn(6, 6))
    model = torch.nn.Sequential(Linear(6, 6, weight=w, delay_wgrad_compute=True),
                                Linear(6, 6, weight=w, delay_wgrad_compute=True))
    clone = copy.deepcopy(model)
    cw = clone[0].weight
    assert cw is clone[1].weight and cw is not w and isinstance(cw, ShardedWeight)
    assert cw.group is w.group and cw.full_shape == w.full_shape and torch.equal(cw, w)
    x = torch.randn(3, 6)
    for m in (model, clone):
        m(x).sum().backward()
        distwgrad.drain_deferred_wgrads(m)
        assert distwgrad.finalize_model_grads([m]) == 1
    assert torch.equal(cw.grad, w.grad) and cw.main_grad is not w.main_grad
