"""A weight's step as one state machine ([Note: weight lifecycle] in ``distwgrad/weights/lifecycle.py``), in one
process: the states a step walks through, the optimizer step that refuses an unfinalized step (whichever
torch optimizer), and the caches that die with the step whatever wrote the weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import distwgrad
from distwgrad import ReducePolicy, ShardedWeight
from distwgrad.fp8 import BlockwiseScaling, PerTensorScaling, fp8_autocast
from distwgrad.fp8 import weights as fw
from distwgrad.nn import Linear
from distwgrad.weights import WeightState
from distwgrad.weights.lifecycle import UnfinalizedStepError

S = WeightState


def _model(delay: bool = True, policy: ReducePolicy = ReducePolicy.PER_MICROBATCH) -> nn.Sequential:
    torch.manual_seed(0)
    w1 = ShardedWeight.from_full(torch.randn(8, 8) / 4, reduce_policy=policy)
    w2 = ShardedWeight.from_full(torch.randn(8, 8) / 4, reduce_policy=policy)
    return nn.Sequential(Linear(8, 8, weight=w1, bias=False, delay_wgrad_compute=delay),
                         Linear(8, 8, weight=w2, bias=False))


def test_a_step_walks_the_states():
    model = _model(delay=True)
    w1, w2 = model[0].weight, model[1].weight
    assert w1.state is S.IDLE and w2.state is S.IDLE
    out = model(torch.randn(4, 8))
    assert w1.state is S.PENDING and w2.state is S.PENDING
    out.sum().backward()
    assert w1.state is S.PENDING, "its wgrad is queued, not delivered"
    assert w2.state is S.REDUCED, "a group of one accumulates in place: nothing left to reduce"
    distwgrad.drain_deferred_wgrads(model)
    assert w1.state is S.REDUCED
    distwgrad.finalize_model_grads(model)
    assert w1.state is S.FINALIZED and w2.state is S.FINALIZED
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert w1.state is S.IDLE and w2.state is S.IDLE


def test_per_step_weights_are_complete_until_finalize():
    model = _model(delay=False, policy=ReducePolicy.PER_STEP)
    model(torch.randn(4, 8)).sum().backward()
    assert model[0].weight.state is S.COMPLETE  # every use delivered, nothing reduced before the step's end
    model(torch.randn(4, 8)).sum().backward()
    assert model[0].weight.state is S.COMPLETE
    distwgrad.finalize_model_grads(model)
    assert model[0].weight.state is S.FINALIZED


def test_a_step_whose_uses_were_all_withdrawn_ends_idle():
    model = _model(delay=False)
    model(torch.randn(4, 8))  # the graph is dropped: the uses are withdrawn, and the step with them
    assert model[0].weight.state is S.IDLE and model[0].weight.pending_contributions == 0
    with fp8_autocast(PerTensorScaling()):
        kept = model(torch.randn(4, 8))
        assert model[0].weight._life.caches, "a step is open: its amax is kept"
        del kept
    assert model[0].weight.state is S.IDLE and not model[0].weight._life.caches, "no step: nothing kept"
    distwgrad.finalize_model_grads(model)
    assert model[0].weight.state is S.IDLE


_OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw_for_loop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True),
}


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_an_optimizer_step_without_finalize_is_refused(name):
    """The README loop without ``finalize_model_grads`` trained nothing, silently: ``.grad`` stayed None and
    every torch optimizer skipped the weights. Now the step raises, naming the weight's path and the fix;
    after the finalize the same step runs and moves the weights."""
    model = _model(delay=True)
    opt = _OPTIMIZERS[name](model.parameters())
    model(torch.randn(4, 8)).square().mean().backward()
    distwgrad.drain_deferred_wgrads(model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UnfinalizedStepError, match=r"0\.weight.*finalize_model_grads") as err:
        opt.step()
    assert "1.weight" in str(err.value)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters())), "the refused step wrote nothing"
    distwgrad.finalize_model_grads(model)
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(p.state is S.IDLE for p in model.parameters())


def test_optimizer_steps_without_a_backward_are_unaffected():
    """No backward since the last step (a forward whose graph is kept, or nothing at all): nothing to
    finalize, so nothing is refused; an optimizer without distributed weights is never looked at."""
    model = _model(delay=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    kept = model(torch.randn(4, 8))  # a use recorded, no contribution yet
    opt.step()
    assert model[0].weight.state is S.PENDING
    kept.sum().backward()
    with pytest.raises(UnfinalizedStepError):
        opt.step()
    distwgrad.finalize_model_grads(model)
    opt.step()
    plain = nn.Linear(4, 4)
    torch.optim.SGD(plain.parameters(), lr=0.1).step()


def test_a_named_weight_keeps_its_name_in_the_refusal():
    model = nn.ModuleDict({"mlp": _model()})
    distwgrad.wgrad.name_weights(model)
    model["mlp"](torch.randn(4, 8)).sum().backward()
    distwgrad.drain_deferred_wgrads(model)
    with pytest.raises(UnfinalizedStepError, match=r"mlp\.0\.weight"):
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    distwgrad.finalize_model_grads(model, discard=True)
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # a discarded step leaves nothing to finalize


def test_a_load_into_an_unfinalized_step_is_refused():
    model = _model(delay=False)
    model(torch.randn(4, 8)).sum().backward()
    with pytest.raises(UnfinalizedStepError, match="load"):
        model[0].weight.master_written("a load")
    distwgrad.finalize_model_grads(model)
    model[0].weight.master_written("a load")
    assert model[0].weight.state is S.IDLE


# --- caches ------------------------------------------------------------------------------------------

def _fp8_step(model, recipe, x):
    with fp8_autocast(recipe):
        model(x).square().mean().backward()
    distwgrad.drain_deferred_wgrads(model)
    distwgrad.finalize_model_grads(model)


def _writes():
    def fused(model):
        torch.optim.AdamW(model.parameters(), lr=0.5, fused=True).step()

    def data(model):
        for p in model.parameters():
            p.data.mul_(3.0)

    def copy_no_grad(model):
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p * 3.0)

    def load_state_dict(model):
        model.load_state_dict({k: v * 3.0 for k, v in model.state_dict().items()})
    return {"fused_adamw": fused, "data": data, "copy_no_grad": copy_no_grad, "load_state_dict": load_state_dict}


@pytest.mark.parametrize("write", sorted(_writes()))
@pytest.mark.parametrize("recipe", [PerTensorScaling(), BlockwiseScaling()], ids=["per_tensor", "blockwise"])
def test_no_fp8_scale_outlives_a_write(recipe, write):
    """A weight's FP8 amax and block scales were cached under its ``_version``, which fused optimizers and
    ``.data`` writes never bump: later forwards quantized new weights with old scales. Now they live for one
    open step, so after any write the next step quantizes with the scales of the weights it reads."""
    model = _model(delay=True)
    torch.manual_seed(1)
    model(torch.randn(4, 8))  # warm anything up; the graph is dropped
    x = torch.randn(4, 8)
    _fp8_step(model, recipe, x)
    for p in model.parameters():
        p.grad = torch.randn_like(p)  # AdamW moves every element
    _writes()[write](model)
    with fp8_autocast(recipe):
        out = model(x)  # the step is open: the forward's scales are cached for it
        for p in model.parameters():
            got = fw.materialize_quantized(p, recipe, backward=False)
            want = fw.quantize_weight(p.detach().clone(), recipe)
            assert [torch.equal(g.data.view(torch.uint8), q.data.view(torch.uint8)) for g, q in zip(got, want)] \
                == [True] * len(want), write
            assert all(torch.equal(g.scale_inv, q.scale_inv) for g, q in zip(got, want)), write
    del out


def test_a_forward_outside_a_step_keeps_no_cache():
    """An eval forward (no grad, no step open) quantizes from the weights as they are and keeps nothing: an
    EMA swap through ``.data`` right after it finds no stale scale."""
    model = _model(delay=False)
    with torch.no_grad(), fp8_autocast(PerTensorScaling()):
        model(torch.randn(4, 8))
    assert all(not p._life.caches for p in model.parameters())
    model(torch.randn(4, 8)).sum().backward()  # a step opens; an amax made now is kept until its end
    with fp8_autocast(PerTensorScaling()):
        fw.materialize_quantized(model[0].weight, PerTensorScaling(), backward=False)
    assert model[0].weight._life.caches
    distwgrad.finalize_model_grads(model)
    assert all(not p._life.caches for p in model.parameters())


def test_sync_weight_amax_serves_the_step_about_to_open():
    """``sync_weight_amax`` pins the amax for the next step (one all-reduce for all weights); the step's
    finalize drops it."""
    model = _model(delay=False)
    assert fw.sync_weight_amax(model) == 2
    w = model[0].weight
    pinned = w._life.caches[fw._AMAX][2]
    with fp8_autocast(PerTensorScaling()):
        model(torch.randn(4, 8)).sum().backward()
        assert fw.global_amax(w) is pinned
    distwgrad.finalize_model_grads(model)
    assert fw._AMAX not in w._life.caches
