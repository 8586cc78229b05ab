"""How long a distributed weight's ``main_grad`` lives ([Note: main_grad lifetime] in ``weights/base.py``).

One the weight created is released when its next step opens: nothing holds it (a weak reference dies)
between ``zero_grad()`` and the next backward, and the step's gradient is the same bits. One a caller
attached is the same tensor every step, zeroed in place. ``.grad`` keeps its values either way, and adds
the next step's gradient as torch does. The graphed case is in ``tests/test_graphs.py``.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F

import distwgrad
from distwgrad.nn import Linear


def _inputs():
    torch.manual_seed(0)
    return torch.randn(8, 6), [torch.randn(5, 6) for _ in range(3)]


def _module(weight_BA: torch.Tensor, delay: bool) -> tuple[Linear, distwgrad.ShardedWeight]:
    w = distwgrad.ShardedWeight.from_full(weight_BA.clone())
    return Linear(6, 8, bias=False, weight=w, delay_wgrad_compute=delay), w


def _step(m: Linear, x: torch.Tensor) -> None:
    m(x).square().sum().backward()
    distwgrad.drain_deferred_wgrads(m)
    distwgrad.finalize_model_grads(m)


def _torch_grads(weight_BA: torch.Tensor, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Plain autograd's gradient of each step's loss alone."""
    out = []
    for x in xs:
        w = weight_BA.clone().requires_grad_()
        F.linear(x, w).square().sum().backward()
        out.append(w.grad)
    return out


@pytest.mark.parametrize("delay", [False, True])
def test_an_own_main_grad_is_released_when_the_step_opens(delay):
    weight, xs = _inputs()
    m, w = _module(weight, delay)
    expected = _torch_grads(weight, xs)
    for x, g in zip(xs, expected):
        _step(m, x)
        assert w.grad is w.main_grad and torch.equal(w.grad, g)
        held = weakref.ref(w.main_grad)
        w.grad = None  # zero_grad(set_to_none=True)
        out = m(x)  # opens the next step
        assert w.main_grad is None and held() is None, "the last step's main_grad is still held"
        del out
        distwgrad.finalize_model_grads(m)  # the use was withdrawn with its graph: nothing owed


def test_a_held_grad_keeps_its_values_and_adds_the_next_step():
    """No ``zero_grad`` between steps: ``.grad`` is the released ``main_grad``, and the next step's
    gradient is added to it, exactly what autograd's accumulation does."""
    weight, xs = _inputs()
    m, w = _module(weight, delay=True)
    ref = weight.clone().requires_grad_()
    for x in xs:
        _step(m, x)
        F.linear(x, ref).square().sum().backward()
        assert torch.equal(w.grad, ref.grad)
    assert w.grad is not w.main_grad, "the accumulated .grad is the first step's tensor, not this step's"


def test_an_attached_main_grad_is_kept_and_zeroed_in_place():
    weight, xs = _inputs()
    m, w = _module(weight, delay=True)
    attached = w.main_grad = torch.full((8, 6), 5.0)
    for x, g in zip(xs, _torch_grads(weight, xs)):
        _step(m, x)
        assert w.main_grad is attached and torch.equal(attached, g)
        w.grad = None


def test_an_attached_main_grad_replacing_an_own_one_is_kept():
    """The weight forgets the one it created once the caller attaches another."""
    weight, xs = _inputs()
    m, w = _module(weight, delay=False)
    _step(m, xs[0])
    attached = w.main_grad = torch.zeros(8, 6)
    w.grad = None
    _step(m, xs[1])
    w.grad = None
    _step(m, xs[2])
    assert w.main_grad is attached and torch.equal(attached, _torch_grads(weight, xs[2:])[0])
