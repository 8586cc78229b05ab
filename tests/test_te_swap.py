"""The import swap (``qa/te_swap/te_swap.py``) that runs TransformerEngine's public test files against
distwgrad: TE's module names give distwgrad's modules, TE's test helpers answer for distwgrad, and a name
distwgrad lacks imports (and, while pytest collects, builds a placeholder) but refuses to be used in a test,
naming itself."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> subprocess.CompletedProcess:
    # a fresh interpreter: the finder stays out of this process's sys.meta_path
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT / "qa" / "te_swap"), "CUDA_VISIBLE_DEVICES": ""},
                          timeout=120)


def test_te_names_are_distwgrads_modules_and_missing_names_refuse_by_name():
    r = _run("""
        import te_swap
        import distwgrad.nn, distwgrad.nn.ops, distwgrad.fp8.recipe
        import transformer_engine.pytorch as te
        import transformer_engine.pytorch.ops as te_ops
        from transformer_engine.common import recipe
        from transformer_engine.pytorch import TransformerLayer, autocast, make_graphed_callables
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager, is_fp8_block_scaling_available
        from transformer_engine.pytorch.module.grouped_linear import is_module_grouped_tensor_path_supported
        import transformer_engine_torch as tex
        assert te.Linear is distwgrad.nn.Linear and te.ops.GroupedLinear is distwgrad.nn.ops.GroupedLinear
        assert te_ops.Sequential is distwgrad.nn.ops.Sequential
        assert recipe.Float8BlockScaling is distwgrad.fp8.recipe.Float8BlockScaling
        assert autocast is distwgrad.nn.autocast and make_graphed_callables is distwgrad.nn.make_graphed_callables
        assert is_fp8_block_scaling_available(return_reason=True) == (False, "blockwise FP8 needs sm_90 or newer")
        assert is_module_grouped_tensor_path_supported(None, None) is True
        FP8GlobalStateManager.reset()
        built = TransformerLayer(8, 8)  # while collecting: a placeholder (a parametrize value, say)
        assert repr(built) == "<transformer_engine.pytorch.TransformerLayer(...): not provided by distwgrad>"
        te_swap.pytest_collection_finish(None)  # tests run: using a missing name refuses, naming it
        for missing, name in ((TransformerLayer, "transformer_engine.pytorch.TransformerLayer"),
                              (tex.DType.kFloat8E4M3, "transformer_engine_torch.DType.kFloat8E4M3")):
            try:
                missing()
            except te_swap.MissingFromDistwgrad as e:
                assert str(e) == f"{name} is not provided by distwgrad", e
            else:
                raise AssertionError(f"{name} did not refuse")
        class Sub(TransformerLayer):  # a subclass imports; building one refuses
            pass
        try:
            Sub()
        except te_swap.MissingFromDistwgrad:
            pass
        else:
            raise AssertionError("a subclass of a missing name was built")
        import os, importlib
        assert not any(m.startswith("transformer_engine") for m in os.listdir("."))  # nothing on disk
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_without_the_plugin_transformer_engine_is_not_importable():
    r = _run("import transformer_engine")
    assert r.returncode != 0 and "No module named 'transformer_engine'" in r.stderr
