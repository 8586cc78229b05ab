"""A recipe defined here, outside the package, trains ([Note: fp8 recipe objects] in
``distwgrad/fp8/recipes/base.py``): one ``Recipe`` subclass and a registry line are all a new recipe is.

``RowScaling`` scales each row by its own amax (a token's activations, a weight's output row) in E4M3, a
family the kernels do not implement, so every GEMM runs emulated: the operands dequantized, an fp32 GEMM.
The checks: the modules' outputs are exactly that emulation of the recipe's own quantization; its
gradients come from it too (dgrad and wgrad read the recipe's quantized operands); a Linear and a
GroupedLinear, one of them on a tied, sharded weight, train under it to the fp32 loss within the recipe's
rounding; and the registry hands it out by name, refusing bad entries by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import distwgrad
import distwgrad.nn as dnn
from distwgrad.fp8 import Quantized, dequantize, fp8_autocast
from distwgrad.fp8.recipes import RECIPES, Recipe, recipe_by_name, register_recipe

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0


def _rows(x: torch.Tensor, dtype: torch.dtype = E4M3) -> Quantized:
    """Each row of a 2-D ``x`` over its own amax."""
    x32 = x.float()
    amax = x32.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, FP8_MAX / amax, torch.ones_like(amax))
    data = (x32 * scale).clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return Quantized(data, 1.0 / scale, (1, x.shape[1]), x.dtype, x.shape)


@dataclass(frozen=True)
class RowScaling(Recipe):
    family: ClassVar[str | None] = None  # no kernels: the emulated GEMMs

    def dtype_for(self, *, grad: bool) -> torch.dtype:
        return E4M3

    def split_accumulator(self, gemm: str) -> bool:
        return True

    def quantize_rowwise_and_columnwise(self, x, *, grad):
        return _rows(x), _rows(x.t().contiguous())

    def quantize_weight(self, w, *, amax=None, quantizers: tuple[Callable, Callable, bool] | None = None):
        return [_rows(m) for m in ([w] if w.dim() == 2 else w.unbind(0))]


def test_a_linear_computes_the_recipes_own_quantization():
    torch.manual_seed(0)
    lin = dnn.Linear(32, 16, bias=False, device="cpu")
    x = torch.randn(8, 32, requires_grad=True)
    with fp8_autocast(RowScaling()):
        y = lin(x)
    want = dequantize(_rows(x.detach()), dtype=torch.float32) @ dequantize(_rows(lin.weight.detach()),
                                                                           dtype=torch.float32).t()
    assert torch.equal(y, want.to(y.dtype))
    assert not torch.equal(y, x.detach() @ lin.weight.detach().t())  # it did quantize
    dy = torch.randn_like(y)
    y.backward(dy)
    q_dy_rows = dequantize(_rows(dy), dtype=torch.float32)
    w_rows = dequantize(_rows(lin.weight.detach()), dtype=torch.float32)
    assert torch.equal(x.grad, (q_dy_rows @ w_rows).to(x.dtype))  # dgrad: the recipe's dy and weight
    dy_t, x_t = (dequantize(_rows(t.t().contiguous()), dtype=torch.float32) for t in (dy, x.detach()))
    assert torch.equal(lin.weight.grad, (dy_t @ x_t.t()).to(lin.weight.dtype))  # wgrad: dy^T and x^T by rows


def _model(tied: torch.nn.Parameter | distwgrad.ShardedWeight) -> torch.nn.Module:
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = dnn.Linear(16, 16, bias=False, weight=tied, delay_wgrad_compute=True)
            self.experts = dnn.GroupedLinear(2, 16, 16, device="cpu", delay_wgrad_compute=True)
            self.out = dnn.Linear(16, 16, bias=False, weight=tied, delay_wgrad_compute=True)

        def forward(self, x):
            return self.out(torch.tanh(self.experts(torch.tanh(self.inp(x)), [5, 3])))
    return Net()


@pytest.mark.parametrize("sharded", [False, True])
def test_a_model_trains_under_it_near_fp32(sharded):
    """A tied (optionally sharded, one rank) weight and a GroupedLinear: 30 steps of Adam on a fixed batch
    reach fp32's loss within the recipe's rounding, from the same start."""
    losses = {}
    for recipe in (None, RowScaling()):
        torch.manual_seed(1)
        full = torch.randn(16, 16) / 4
        tied = distwgrad.ShardedWeight.from_full(full) if sharded else torch.nn.Parameter(full.clone())
        model = _model(tied)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        x, target = torch.randn(8, 16), torch.randn(8, 16)
        curve = []
        for _ in range(30):
            with fp8_autocast(recipe):
                loss = (model(x) - target).square().mean()
            loss.backward()
            distwgrad.drain_deferred_wgrads(model)
            distwgrad.finalize_model_grads([model])
            opt.step()
            opt.zero_grad(set_to_none=True)
            curve.append(loss.item())
        losses[recipe is None] = curve
    fp32, fp8 = losses[True], losses[False]
    assert fp8[-1] < 0.6 * fp8[0], fp8  # it trains
    assert abs(fp8[-1] - fp32[-1]) < 0.05 * fp32[0], (fp8[-1], fp32[-1])  # E4M3's 2**-4 rounding, not worse
    assert fp8 != fp32  # the recipe was in effect


def test_the_registry_hands_it_out_by_name():
    register_recipe("test_rows", RowScaling)
    try:
        assert recipe_by_name("test_rows") == RowScaling() and recipe_by_name("none") is None
        assert isinstance(recipe_by_name("fp8_blockwise"), distwgrad.fp8.BlockwiseScaling)
    finally:
        del RECIPES["test_rows"]


def test_the_registry_refuses_bad_entries():
    with pytest.raises(ValueError, match="name must be a non-empty string other than 'none', got 'none'"):
        register_recipe("none", RowScaling)
    with pytest.raises(ValueError, match="'fp8_blockwise' is registered already"):
        register_recipe("fp8_blockwise", RowScaling)
    with pytest.raises(TypeError, match="make must build a Recipe, got 3"):
        register_recipe("x", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"recipe 'nope' is not registered; the recipes: \['none', 'fp8_per"):
        recipe_by_name("nope")
    register_recipe("test_bad", lambda: "not a recipe")  # type: ignore[arg-type, return-value]
    try:
        with pytest.raises(TypeError, match="recipe 'test_bad' built 'not a recipe', not a Recipe"):
            recipe_by_name("test_bad")
    finally:
        del RECIPES["test_bad"]
    with pytest.raises(TypeError, match="fp8_autocast expects an FP8 Recipe"):
        with fp8_autocast("fp8_blockwise"):  # type: ignore[arg-type]
            pass
