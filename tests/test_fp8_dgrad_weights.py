"""[Note: dgrad's weights from forward's read] (distwgrad/fp8/weights.py): a GroupedLinear whose packed weight is
held whole here quantizes it in forward into fprop's and dgrad's layouts from one read, and backward reads the
saved dgrad copy instead of quantizing the weight again.

Checked against the same module with that path off (``QuantizeTuning.weights_pair=False``: backward quantizing
its own): the output, the input
gradient and the weight gradient are bit-identical (the same casts, the same GEMMs), under both recipes, with
and without kept weights over two microbatches, and twice through a retained graph. The weight quantization
launches are counted, so a silent fall back to two reads fails; the saved copy must die with backward. The
kernels run on CPU under ``TRITON_INTERPRET=1`` (a child process) and on the GPU.
"""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

_HERE = os.path.abspath(__file__)


def _module(recipe_name: str, device: str, dtype: torch.dtype):
    from distwgrad import ShardedWeight
    from distwgrad.fp8 import BlockwiseScaling, PerTensorScaling
    from distwgrad.nn import GroupedLinear
    B = 32 if device == "cpu" else 128
    E, K, N = 3, 2 * B, 3 * B
    torch.manual_seed(0)
    mod = GroupedLinear(E, K, N, bias=False, single_grouped_weight=True, device=device)
    mod.weight = ShardedWeight.from_full(mod.weight.detach().clone() * 3, param_dtype=dtype)
    recipe = PerTensorScaling() if recipe_name == "per_tensor" else BlockwiseScaling(act_block=(1, B),
                                                                                     weight_block=(B, B))
    T = 4 * B
    splits = [T // 2, 0, T - T // 2]
    x = torch.randn(T, K, device=device, dtype=dtype)
    return mod, recipe, x, splits


def _launches(monkeypatch_like) -> list[tuple[bool, bool]]:
    """Records each weight quantization launch as ``(transpose, both)``."""
    from distwgrad.kernels import weights_fp8 as kw
    seen: list[tuple[bool, bool]] = []
    for name in ("_packed_per_tensor", "_experts_blockwise"):
        real = getattr(kw, name)
        monkeypatch_like(kw, name, lambda *a, _real=real, **k: (seen.append((a[-1], k["both"])), _real(*a, **k))[1])
    return seen


def _step(mod, recipe, x, splits, firsts, *, retain=False):
    """Forward and backward of each microbatch (``firsts``: their ``is_first_microbatch``); the outputs, dx's and
    the weight's gradient, as tensors to compare bit for bit."""
    import distwgrad
    from distwgrad.fp8 import fp8_autocast
    outs = []
    for first in firsts:
        xi = x.clone().requires_grad_(True)
        with fp8_autocast(recipe):
            y = mod(xi, splits, is_first_microbatch=first)
        dy = torch.ones_like(y).normal_(generator=torch.Generator(y.device).manual_seed(len(outs)))
        y.backward(dy, retain_graph=retain)
        outs += [y.detach(), xi.grad]
        if retain:
            dx = xi.grad.clone()
            xi.grad = None
            y.backward(dy)
            assert torch.equal(xi.grad, dx), "a retained graph's second backward read another dgrad weight"
    distwgrad.finalize_model_grads([mod])
    grad = mod.weight.grad.clone()
    mod.zero_grad(set_to_none=True)
    return [*outs, grad]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


def _check(recipe_name: str, device: str, dtype: torch.dtype, monkeypatch_like) -> None:
    from distwgrad.kernels import tuning

    from distwgrad.fp8 import fp8_autocast
    from distwgrad.ops import quantize as oq
    mod, recipe, x, splits = _module(recipe_name, device, dtype)
    launches = _launches(monkeypatch_like)
    for firsts, retain in (([None], False), ([True, False], False), ([None], True)):
        launches.clear()
        got = _step(mod, recipe, x, splits, firsts, retain=retain)
        # one read a step (kept) or a microbatch: both layouts at once, never a backward quantization
        assert launches == [(True, True)] * (1 if firsts[0] is not None else len(firsts)), (firsts, launches)
        launches.clear()
        with tuning(quantize=dict(weights_pair=False)):
            want = _step(mod, recipe, x, splits, firsts, retain=retain)
        apart = [(False, False), (True, False)] + [(True, False)] * retain  # a second backward: again
        assert launches == (apart if firsts[0] is not None else apart * len(firsts)), (firsts, retain, launches)
        assert _same(got, want), (recipe_name, firsts, retain)
    # no dx wanted (an input without grad, an eval forward): forward's layout alone
    for grad_on in (True, False):
        launches.clear()
        with fp8_autocast(recipe), torch.set_grad_enabled(grad_on):
            y = mod(x, splits)
        assert launches == [(False, False)], (grad_on, launches)
    # the saved copy lives from forward to backward, not as long as the output
    name = "quantize_packed_per_tensor_pair" if recipe_name == "per_tensor" else "quantize_experts_blockwise_pair"
    made: list[weakref.ref] = []
    real = getattr(oq, name)
    monkeypatch_like(oq, name, lambda *a, **k: (lambda p: (made.append(weakref.ref(p[1].data)), p)[1])(real(*a, **k)))
    xi = x.clone().requires_grad_(True)
    with fp8_autocast(recipe):
        y = mod(xi, splits)
    gc.collect()
    assert len(made) == 1 and made[0]() is not None, "the dgrad copy did not survive until backward"
    y.sum().backward()
    gc.collect()
    assert made[0]() is None, "backward left the dgrad copy alive while the output lives"
    monkeypatch_like(oq, name, real)


class _Patch:
    """A monkeypatch for the child process: ``setattr``, undone by ``undo``."""

    def __init__(self) -> None:
        self.saved: list[tuple[object, str, object]] = []

    def __call__(self, obj, name, value) -> None:
        self.saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def undo(self) -> None:
        for obj, name, value in reversed(self.saved):
            setattr(obj, name, value)
        self.saved.clear()


@pytest.mark.interpret
@pytest.mark.parametrize("recipe_name", ["per_tensor", "blockwise"])
def test_dgrad_weights_from_forward_interpreted(recipe_name):
    pytest.importorskip("triton")
    from distwgrad.testing.interpreter import run_interpreted
    run_interpreted(_HERE, recipe_name, kernels_on_cpu=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("recipe_name", ["per_tensor", "blockwise"])
def test_dgrad_weights_from_forward_gpu(recipe_name, monkeypatch):
    _check(recipe_name, "cuda", torch.bfloat16, monkeypatch.setattr)


if __name__ == "__main__":  # child of test_dgrad_weights_from_forward_interpreted
    import sys
    patch = _Patch()
    try:
        _check(sys.argv[1], "cpu", torch.float32, patch)
    finally:
        patch.undo()
    print("ok")
