"""[Note: a cast one weight ahead] in ``distwgrad/weights/cast_ahead.py``: a group of one casts the weight it
expects next on a side stream; what it hands out must be exactly the inline cast.

On the CPU the tests switch on the module's test mode (``_CASTS.on_cpu``): the same bookkeeping (learned
successors, the version and pointer checks, one copy ahead), with each cast ahead done at once instead of on
a stream. Every comparison is bit for bit: a copy cast ahead is the same conversion of the same values, so
the gradients of steps with and without the casts ahead must be identical. The GPU tests run the side
stream itself.
"""

from __future__ import annotations

import copy

import pytest
import torch

import distwgrad
from distwgrad import ShardedWeight
from distwgrad.nn import GroupedLinear, Linear
from distwgrad.weights import cast_ahead

BF16 = torch.bfloat16


@pytest.fixture
def on_cpu():
    """The module's CPU test mode, casts ahead on, a fresh pass; restored afterwards."""
    casts = cast_ahead._CASTS
    old = casts.on_cpu, casts.enabled
    cast_ahead.reset()
    casts.on_cpu = True
    cast_ahead.enabled(True)
    yield casts
    cast_ahead.reset()
    casts.on_cpu, casts.enabled = old


def _weight(*shape, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return ShardedWeight.from_full((torch.randn(*shape, generator=g) * 0.3).to(device), param_dtype=BF16)


def _model(device="cpu"):
    """Linear layers with a weight used twice (tied) and packed experts: every kind of use in a pass."""
    w = [_weight(8, 8, seed=s, device=device) for s in range(3)]
    experts = _weight(3, 8, 8, seed=3, device=device)
    grouped = GroupedLinear(3, 8, 8, bias=False, params_dtype=BF16, single_grouped_weight=True, device=device)
    grouped.weight = experts
    layers = torch.nn.ModuleList([Linear(8, 8, weight=w[0], bias=False), Linear(8, 8, weight=w[1], bias=False),
                                  grouped, Linear(8, 8, weight=w[0], bias=False), Linear(8, 8, weight=w[2], bias=False)])
    return layers, w + [experts]


def _steps(enabled, steps=3, device="cpu"):
    """Grads and updated masters over ``steps`` SGD steps, with the casts ahead on or off."""
    cast_ahead.enabled(enabled)
    layers, weights = _model(device)
    out = []
    for step in range(steps):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step)).to(device, BF16)
        for layer in layers:
            x = layer(x, [2, 3, 1]) if isinstance(layer, GroupedLinear) else layer(x)
        x.float().square().sum().backward()
        distwgrad.finalize_model_grads(layers)
        out.append([w.main_grad.clone() for w in weights])
        with torch.no_grad():
            for w in weights:
                w.sub_(1e-2 * w.main_grad)
        out.append([w.detach().clone() for w in weights])
    return out


def test_steps_with_casts_ahead_are_bit_equal_to_inline_casts(on_cpu):
    inline = _steps(False)
    launched, taken = on_cpu.launched, on_cpu.taken
    ahead = _steps(True)
    for a, b in zip(inline, ahead):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    # steps 2 and 3 each: forward w0 -> w1 -> experts -> w0 (tied) -> w2 (4 successors), backward w2 -> w0 ->
    # experts -> w1 (3; the first layer's input needs no gradient, so w0's first use has no dgrad)
    assert (on_cpu.launched - launched, on_cpu.taken - taken) == (14, 14)


def _pass(weights, backward=False):
    return [cast_ahead.materialize(w, backward) for w in weights]


def _new_pass():
    """Ends the current pass: a change of direction starts the next one."""
    cast_ahead._CASTS.direction = None


def test_a_master_changed_after_its_cast_ahead_is_cast_again(on_cpu):
    a, b = _weight(4, 4, seed=0), _weight(4, 4, seed=1)
    _pass([a, b])  # learns a -> b
    _new_pass()
    cast_ahead.materialize(a, False)  # casts b ahead
    assert on_cpu.ahead is not None and on_cpu.ahead.weight() is b
    with torch.no_grad():
        b.add_(1.0)  # an update the copy ahead predates (its _version moved)
    taken = on_cpu.taken
    got = cast_ahead.materialize(b, False)
    assert on_cpu.taken == taken and torch.equal(got, b.detach().to(BF16))


def test_a_master_replaced_through_data_is_cast_again(on_cpu):
    a, b = _weight(4, 4, seed=0), _weight(4, 4, seed=1)
    _pass([a, b])
    _new_pass()
    cast_ahead.materialize(a, False)
    b.data = torch.full((4, 4), 3.0)  # a new tensor: same _version counter value possible, another pointer
    got = cast_ahead.materialize(b, False)
    assert torch.equal(got, torch.full((4, 4), 3.0, dtype=BF16))


def test_a_weight_out_of_order_drops_the_copy_ahead_and_is_learned(on_cpu):
    a, b, c = (_weight(4, 4, seed=s) for s in range(3))
    _pass([a, b])
    _new_pass()
    cast_ahead.materialize(a, False)  # b ahead
    taken = on_cpu.taken
    got = cast_ahead.materialize(c, False)  # another path: b's copy is dropped, c casts inline
    assert on_cpu.taken == taken and on_cpu.ahead is None and torch.equal(got, c.detach().to(BF16))
    _new_pass()
    cast_ahead.materialize(a, False)
    assert on_cpu.ahead.weight() is c  # a's successor is now c


def test_each_use_of_a_tied_weight_has_its_own_successor_and_directions_their_own(on_cpu):
    e, q, h = (_weight(4, 4, seed=s) for s in range(3))
    _pass([e, q, h, e])  # e's first use -> q; its second use ends the pass
    _pass([h, q], backward=True)
    _new_pass()
    cast_ahead.materialize(e, False)
    assert on_cpu.ahead.weight() is q and not on_cpu.ahead.backward
    _pass([q, h])
    cast_ahead.materialize(e, False)  # the second use: nothing learned after it
    assert on_cpu.ahead is None
    cast_ahead.materialize(h, True)  # a new pass (backward): h -> q
    assert on_cpu.ahead.weight() is q and on_cpu.ahead.backward


def test_one_copy_ahead_at_most_and_none_when_disabled(on_cpu):
    ws = [_weight(4, 4, seed=s) for s in range(4)]
    _pass(ws)
    _new_pass()
    for w in ws[:-1]:
        cast_ahead.materialize(w, False)
        assert isinstance(on_cpu.ahead, cast_ahead._Ahead)  # one object, replaced at each use
    _new_pass()
    cast_ahead.enabled(False)
    launched = on_cpu.launched
    got = _pass(ws)
    assert on_cpu.launched == launched and on_cpu.ahead is None
    assert all(torch.equal(g, w.detach().to(BF16)) for g, w in zip(got, ws))


def test_two_models_stepped_in_turn_keep_their_own_successors(on_cpu):
    m1 = [_weight(4, 4, seed=s) for s in range(3)]
    m2 = [_weight(4, 4, seed=10 + s) for s in range(3)]
    for _ in range(2):
        _pass(m1)
        _pass(m1[::-1], backward=True)
        _pass(m2)
        _pass(m2[::-1], backward=True)
    taken = on_cpu.taken
    _pass(m1)
    _pass(m1[::-1], backward=True)
    _pass(m2)
    assert on_cpu.taken - taken == 6  # two successors a pass, every one taken


def test_only_cuda_groups_of_one_that_cast_apply_and_deep_copies_forget_successors(on_cpu):
    a, b = _weight(4, 4, seed=0), _weight(4, 4, seed=1)
    assert cast_ahead.applies(a)
    assert not cast_ahead.applies(ShardedWeight.from_full(torch.ones(4, 4)))  # no param_dtype: nothing to cast
    assert not cast_ahead.applies(ShardedWeight.from_full(torch.ones(4, 4), param_dtype=torch.float32))
    assert not cast_ahead.applies(torch.nn.Parameter(torch.ones(4, 4)))
    on_cpu.on_cpu = False
    assert not cast_ahead.applies(a)  # a CPU weight casts inline outside the test mode
    on_cpu.on_cpu = True
    _pass([a, b])
    assert "_cast_next" in a.__dict__ and "_cast_next" not in copy.deepcopy(a).__dict__


def test_enabled_takes_a_bool():
    with pytest.raises(TypeError, match="got 1"):
        cast_ahead.enabled(1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_steps_with_casts_ahead_on_a_side_stream_are_bit_equal():
    casts = cast_ahead._CASTS
    cast_ahead.reset()
    try:
        inline = _steps(False, device="cuda")
        launched, taken = casts.launched, casts.taken
        ahead = _steps(True, device="cuda")
    finally:
        cast_ahead.enabled(True)
    for a, b in zip(inline, ahead):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert (casts.launched - launched, casts.taken - taken) == (14, 14)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_copy_ahead_waits_for_the_compute_streams_queued_update():
    """The cast ahead is launched after a long kernel queue that ends in an update of the master: the side
    stream must wait for it (``wait_stream``), so the copy holds the updated values."""
    cast_ahead.reset()
    a, b = _weight(4096, 4096, seed=0, device="cuda"), _weight(4096, 4096, seed=1, device="cuda")
    _pass([a, b])
    _new_pass()
    big = torch.randn(8192, 8192, device="cuda")
    for _ in range(20):  # keep the compute stream busy, then update b at the end of its queue
        big = big @ big.T * 1e-4
    with torch.no_grad():
        b.detach().add_(big[:4096, :4096])  # detach: the same storage, the version counter unmoved
    cast_ahead.materialize(a, False)  # casts b ahead (its version as at the launch)
    got = cast_ahead.materialize(b, False)
    torch.cuda.synchronize()
    assert torch.equal(got, b.detach().to(BF16))
