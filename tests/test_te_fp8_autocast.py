"""TransformerEngine's FP8 entry points on distwgrad ([Note: TransformerEngine's fp8_autocast] in
distwgrad/fp8/recipe.py): a TE test that swaps ``transformer_engine.pytorch`` for ``distwgrad.nn`` and
``transformer_engine.common.recipe`` for ``distwgrad.fp8.recipe`` gets the same recipes and the same
``fp8_autocast`` forms; what distwgrad does not implement is refused by name."""

from __future__ import annotations

import pytest
import torch

import distwgrad.nn as te
from distwgrad.fp8 import BlockwiseScaling, MMParams, PerTensorScaling, current_recipe, fp8_autocast, split_accumulator
from distwgrad.fp8 import recipe as te_recipe

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("args, kwargs, expected", [
    ((), {}, PerTensorScaling()),                                    # TE: enabled=True by default
    ((True,), {}, PerTensorScaling()),                               # TE's positional enabled
    ((False,), {}, None),
    ((None,), {}, None),                                             # distwgrad's explicit "off"
    ((), dict(enabled=True, fp8_recipe=BlockwiseScaling()), BlockwiseScaling()),
    ((), dict(enabled=False, fp8_recipe=BlockwiseScaling()), None),
    ((), dict(fp8_recipe=BlockwiseScaling()), BlockwiseScaling()),
    ((BlockwiseScaling(),), {}, BlockwiseScaling()),
    ((), dict(enabled=True, fp8_recipe=None), PerTensorScaling()),
])
def test_fp8_autocast_forms(args, kwargs, expected):
    with te.fp8_autocast(*args, **kwargs) as active:
        assert current_recipe() == expected and active == expected
    assert current_recipe() is None


@pytest.mark.parametrize("args, kwargs, error, match", [
    ((BlockwiseScaling(),), dict(fp8_recipe=PerTensorScaling()), ValueError, "give the recipe once"),
    ((True,), dict(enabled=False), ValueError, "enabled given twice"),
    ((), dict(calibrating=True), NotImplementedError, "calibrating=True"),
    ((), dict(fp8_group=object()), ValueError, "fp8_group is not supported"),
    (("fp8",), {}, TypeError, "got 'fp8'"),
])
def test_fp8_autocast_refuses_what_it_does_not_do(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        with fp8_autocast(*args, **kwargs):
            pass
    assert current_recipe() is None


@pytest.mark.parametrize("kwargs, expected", [
    ({}, PerTensorScaling()),                                        # TE 2: enabled=True, the default recipe
    (dict(enabled=False, recipe=BlockwiseScaling()), None),
    (dict(enabled=True, recipe=BlockwiseScaling()), BlockwiseScaling()),
    (dict(recipe=te_recipe.Float8BlockScaling()), BlockwiseScaling()),
])
def test_autocast_is_te2s_spelling(kwargs, expected):
    with te.autocast(**kwargs) as active:
        assert current_recipe() == expected and active == expected
    assert current_recipe() is None


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(amax_reduction_group=object()), ValueError, "amax_reduction_group=<object"),
    (dict(calibrating=True), NotImplementedError, "calibrating=True"),
    (dict(recipe="fp8"), TypeError, "got 'fp8'"),
])
def test_autocast_refuses_what_it_does_not_do(kwargs, error, match):
    with pytest.raises(error, match=match):
        with te.autocast(**kwargs):
            pass
    assert current_recipe() is None


def test_te_recipe_names_with_te_defaults():
    cs = te_recipe.Float8CurrentScaling()
    assert (cs.fwd_dtype, cs.grad_dtype) == (E4M3, E5M2)  # Format.HYBRID
    assert [split_accumulator(cs, g) for g in ("fprop", "dgrad", "wgrad")] == [False, True, True]
    e4 = te_recipe.Float8CurrentScaling(fp8_format=te_recipe.Format.E4M3, fp8_gemm_fprop=MMParams(True))
    assert (e4.fwd_dtype, e4.grad_dtype) == (E4M3, E4M3) and split_accumulator(e4, "fprop")
    assert te_recipe.Float8BlockScaling() == BlockwiseScaling()
    with pytest.raises(ValueError, match="fp8_format must be Format.E4M3"):
        te_recipe.Float8BlockScaling(fp8_format=te_recipe.Format.HYBRID)
    with pytest.raises(ValueError, match="fp8_format must be a Format, got 'HYBRID'"):
        te_recipe.Float8CurrentScaling(fp8_format="HYBRID")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fp8_dpa=True"):
        te_recipe.Float8CurrentScaling(fp8_dpa=True)
    delayed = te_recipe.DelayedScaling(margin=0)  # builds, as a TE test's recipe list does at import
    assert delayed.delayed() and not delayed.float8_block_scaling()
    with pytest.raises(NotImplementedError, match="DelayedScaling is not implemented"):
        with te.fp8_autocast(enabled=True, fp8_recipe=delayed):
            pass
    with te.autocast(enabled=False, recipe=delayed) as active:  # FP8 off: nothing to refuse
        assert active is None
    assert [(r.float8_current_scaling(), r.float8_block_scaling(), r.delayed(), r.mxfp8())
            for r in (te_recipe.Float8CurrentScaling(), te_recipe.Float8BlockScaling())] == [
        (True, False, False, False), (False, True, False, False)]


@pytest.mark.parametrize("module", ["linear", "grouped"])
def test_te_style_fp8_test_runs_the_same_recipe(module):
    """A TE-style FP8 module test: the TE form gives the bits of the equivalent distwgrad recipe, and FP8
    is really on (the output differs from the unquantized one)."""
    torch.manual_seed(0)
    mod = te.Linear(64, 32) if module == "linear" else te.GroupedLinear(2, 64, 32)
    x = torch.randn(24, 64)
    run = (lambda: mod(x)) if module == "linear" else (lambda: mod(x, [10, 14]))
    with te.fp8_autocast(enabled=True, fp8_recipe=te_recipe.Float8CurrentScaling()):
        y_te = run()
    with fp8_autocast(PerTensorScaling(fp8_gemm_fprop=MMParams(use_split_accumulator=False))):
        y = run()
    assert torch.equal(y_te, y)
    assert not torch.equal(y, run())
    y_te.sum().backward()
    assert all(p.grad is not None for p in mod.parameters())
