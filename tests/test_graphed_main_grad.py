"""A kept ``main_grad`` ([Note: main_grad lifetime] in ``weights/base.py``) holds nothing of the last step: an eager
step's opening zeroes it, a graphed one flags it and the step's first wgrad writes it ([Note: an unwritten
accumulator] in ``weights/first_write.py``).

CPU: the step's opening and ending on a kept ``main_grad``, eagerly.
GPU (``@pytest.mark.gpu``): graphed packed experts (the Gluon wgrad) and a Linear against the same model eager,
``main_grad`` poisoned with NaN before each step, bit for bit (a replay that read the stale values would carry
the NaN).
"""

from __future__ import annotations

import pytest
import torch
from test_cuda_graphs import nccl_world  # noqa: F401  (a fixture)
from torch import nn

import distwgrad
from distwgrad.nn import GroupedLinear, Linear

_SPLITS = [5, 0, 20, 7]  # tokens per group: one group empty


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


# ---- GPU ------------------------------------------------------------------------------------------

_gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("recipe", [None, "per_tensor", "blockwise"])
@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("gpu", [pytest.param(None, marks=_gpu)])
def test_gpu_graphed_steps_match_eager(nccl_world, recipe, microbatches, gpu):  # noqa: F811
    """Graphed packed experts (the Gluon wgrad: 512 tokens per group on average) and a Linear on one-rank
    ShardedWeights (bf16 compute on fp32 masters) against the same model eager, both keeping ``main_grad``: two
    steps, ``main_grad`` poisoned with NaN before each, equal bit for bit (a replay that added into the stale
    values would carry the NaN); one expert has no tokens."""
    from distwgrad.fp8 import BlockwiseScaling, PerTensorScaling, fp8_autocast
    rec = {None: None, "per_tensor": PerTensorScaling(), "blockwise": BlockwiseScaling()}[recipe]

    def build():
        torch.manual_seed(0)
        E, K = len(_SPLITS), 256
        experts = GroupedLinear(E, K, K, bias=False, single_grouped_weight=True, delay_wgrad_compute=True,
                                device="meta")
        experts.weight = distwgrad.ShardedWeight.from_full(torch.randn(E, K, K, device="cuda") / 16, group=nccl_world,
                                                           param_dtype=torch.bfloat16)
        lin = Linear(K, K, bias=False, delay_wgrad_compute=True, device="cuda",
                     weight=distwgrad.ShardedWeight.from_full(torch.randn(K, K, device="cuda") / 16, group=nccl_world,
                                                              param_dtype=torch.bfloat16))

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.experts, self.lin = experts, lin

            def forward(self, x, splits):
                return self.lin(self.experts(x, splits))
        return M()

    splits = torch.tensor([64 * s for s in _SPLITS], device="cuda")
    T = int(splits.sum())
    eager, graphed = build(), build()
    for p in eager.parameters():
        p.keep_main_grad()
    x0 = torch.randn(T, 256, device="cuda", dtype=torch.bfloat16)
    g = distwgrad.make_graphed_callables(graphed, (x0, splits), fp8_enabled=rec is not None, fp8_recipe=rec)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(2):
        xs = [torch.randn(T, 256, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(microbatches)]
        for p in [*eager.parameters(), *graphed.parameters()]:
            if getattr(p, "main_grad", None) is not None:
                p.main_grad.fill_(float("nan"))
        for m, run in ((eager, eager), (graphed, g)):
            for x in xs:
                with fp8_autocast(rec, enabled=rec is not None and m is eager):
                    run(x, splits).float().square().sum().backward()
                distwgrad.drain_deferred_wgrads(m)
            distwgrad.finalize_model_grads(m)
        for (name, a), b in zip(eager.named_parameters(), graphed.parameters()):
            assert not a.main_grad.isnan().any(), f"step {step}: {name}"
            assert torch.equal(a.main_grad, b.main_grad), f"step {step}: {name}"
        eager.zero_grad(set_to_none=True)
        graphed.zero_grad(set_to_none=True)
    g.reset()
