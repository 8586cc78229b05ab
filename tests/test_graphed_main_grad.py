"""A kept ``main_grad`` ([Note: main_grad lifetime] in ``weights/base.py``) holds nothing of the last step when
the next opens: eagerly the opening zeroes it in place. A graphed weight is flagged instead and its first wgrad
writes ([Note: an unwritten accumulator]): ``tests/test_first_write.py``, with the graphed-against-eager GPU test.
"""

from __future__ import annotations

import pytest
import torch

import distwgrad
from distwgrad.nn import Linear


def _kept_weight() -> tuple[distwgrad.ShardedWeight, Linear]:
    w = distwgrad.ShardedWeight.from_full(torch.randn(4, 4))
    m = Linear(4, 4, bias=False, weight=w, delay_wgrad_compute=True)
    m(torch.randn(2, 4)).sum().backward()
    distwgrad.drain_deferred_wgrads(m)
    distwgrad.finalize_model_grads(m)
    w.keep_main_grad()
    return w, m


@pytest.mark.parametrize("end", ["finish", "discard"])
def test_a_step_that_opens_zeroes_a_kept_main_grad(end):
    """Opening zeroes the kept ``main_grad`` in place (the same tensor); a step with nothing delivered leaves zeros."""
    w, _ = _kept_weight()
    main_grad = w.main_grad
    main_grad.fill_(3.0)
    w.expect_contribution(0)
    assert w.main_grad is main_grad and not main_grad.any()
    w.finish_step() if end == "finish" else w.discard_step()
    assert w.main_grad is main_grad and not main_grad.any()


def test_a_step_adds_into_the_zeros_not_the_last_step():
    """Two steps on a kept ``main_grad`` poisoned with NaN between them: the second equals a fresh model's."""
    w, m = _kept_weight()
    x = torch.randn(2, 4)
    w.main_grad.fill_(float("nan"))
    m(x).sum().backward()
    distwgrad.drain_deferred_wgrads(m)
    distwgrad.finalize_model_grads(m)
    fresh = Linear(4, 4, bias=False, delay_wgrad_compute=True,
                   weight=distwgrad.ShardedWeight.from_full(w.detach().clone()))
    fresh(x).sum().backward()
    distwgrad.drain_deferred_wgrads(fresh)
    distwgrad.finalize_model_grads(fresh)
    assert torch.equal(w.main_grad, fresh.weight.main_grad)
