"""The kernels' tuning ([Note: kernel tuning] in kernels/_tuning.py): the frozen set of knobs, their
validation, and the scoping of ``distwgrad.kernels.tuning`` blocks.

A new knob, a renamed one or a changed default fails ``test_no_new_knobs`` until the literal below changes
with it (as torchtitan's ``test_no_new_cli_options``): tuning grows on purpose, with its measurement in
``_tuning.py``, never as a module constant that a test flips (``test_no_new_module_constants``).
"""

from __future__ import annotations

import ast
import dataclasses
import re
import threading
from pathlib import Path

import pytest
from distwgrad.kernels import (
    GroupedGemmFp8Tuning,
    GroupedGemmTuning,
    KernelTuning,
    QuantizeTuning,
    TokenLayoutTuning,
    current,
    tuning,
)

_ROOT = Path(__file__).resolve().parents[1]

KNOBS = {
    "grouped_gemm": {
        "wide_tail_max_tokens": 160,
    },
    "grouped_gemm_fp8": {
        "ragged_gluon": True,
        "ragged_gluon_min_depth_per_tensor": 768,
        "ragged_gluon_min_depth_blockwise": 768,
        "ragged_gluon_block_m": 128,
        "ragged_gluon_stages": 4,
        "wgrad_gluon": True,
        "wgrad_gluon_blockwise": True,
        "wgrad_gluon_stages_blockwise": 4,
        "wgrad_gluon_add_mode": "atomic",
        "wgrad_gluon_stages": 5,
        "wgrad_gluon_stages_16": 6,
        "wgrad_gluon_epilogue_warps": 2,
        "linear_cublas": True,
    },
    "quantize": {
        "per_tensor_block": 4096,
        "per_tensor_warps": 4,
        "amax_max_programs": 1024,
        "blocks_warps": 8,
        "rows_tile_m": 32,
        "rows_warps": 4,
        "rowcol_warps": 8,
        "rowcol_maxnreg": 128,
        "rowcol_gluon": True,
        "weights_tile": 64,
    },
    "token_layout": {
        "block_t": 128,
        "block_r": 64,
    },
}

# Module-level ALL_CAPS names in kernels/: structural constants (a kernel's layouts are built around them),
# caches, tables and candidates; none is a knob a test or benchmark may set.
MODULE_CONSTANTS = {
    "_grouped_gemm_checks.py": ["_DTYPES"],
    "_grouped_gemm_configs.py": ["ERROR_FLOOR", "ERROR_RATIO", "INTERPRETER", "RAGGED_CANDIDATES",
                                 "WGRAD_ACC_CANDIDATES", "WGRAD_CANDIDATES", "_DEFAULTS", "_RAGGED_SMEM_MARGIN", "_T"],
    "_grouped_gemm_fp8_checks.py": ["_FP8", "_OUT_DTYPES"],
    "_grouped_gemm_fp8_configs.py": ["ADD_MODES", "INTERPRETER", "RAGGED_CANDIDATES", "WGRAD_CANDIDATES", "_T"],
    "_grouped_gemm_fp8_launch.py": ["_ADD_MODES", "_GLUON_FAILED"],
    "_host.py": ["_TABLES", "_TABLES_MAX"],
    "_launch.py": ["_CACHES", "_DESCRIPTORS", "_MAX_KEYS", "_PLAIN"],
    "_quantize_kernels.py": ["_FLT_MAX", "_FLT_MIN_NORMAL", "_INF"],
    "_tuning.py": ["_CLASSES", "_FAMILIES", "_WARPS"],
    "grouped_gemm.py": ["_ADD_MODES"],
    "quantize.py": ["SWEEP", "_FORMATS", "_GLUON_FAILED", "_INPUT_DTYPES", "_TL_FP8"],
    "rotary.py": ["_DTYPES"],
    "token_layout.py": ["_ATTR"],
    "weights_fp8.py": ["_TL"],
    "gluon/__init__.py": ["AVAILABLE", "REINTERPRET", "WS_PAIRS", "_GL_DTYPES"],
    "gluon/grouped_gemm_fp8.py": ["BLOCK"],
    "gluon/grouped_wgrad_fp8.py": ["BLOCK", "EPI_REGS", "EPI_ROWS"],
    "gluon/quantize_rowcol.py": ["L", "NUM_WARPS"],
}


def _knobs(t: KernelTuning) -> dict:
    return {fam.name: {f.name: getattr(getattr(t, fam.name), f.name) for f in dataclasses.fields(getattr(t, fam.name))}
            for fam in dataclasses.fields(t)}


def test_no_new_knobs():
    """Every family's knobs and defaults, in order: adding, renaming or retuning one changes this test."""
    assert _knobs(KernelTuning()) == KNOBS
    assert [list(v) for v in _knobs(KernelTuning()).values()] == [list(v) for v in KNOBS.values()]
    assert current() == KernelTuning(), "a tuning override leaked out of a test"


def test_no_new_module_constants():
    """No kernel module grows an ALL_CAPS module constant beside the listed ones: tuning lives in the
    dataclasses, where ``tuning`` reaches it, not in module globals that a test would have to set."""
    found = {}
    for path in sorted((_ROOT / "kernels").rglob("*.py")):
        names = []
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AnnAssign) else []
            for t in targets:
                for n in ([t] if isinstance(t, ast.Name) else getattr(t, "elts", [])):
                    if isinstance(n, ast.Name) and re.fullmatch(r"_?[A-Z][A-Z0-9_]*", n.id):
                        names.append(n.id)
        if names:
            found[path.relative_to(_ROOT / "kernels").as_posix()] = sorted(names)
    assert found == MODULE_CONSTANTS


@pytest.mark.parametrize("family,field,value,what", [
    (GroupedGemmTuning, "wide_tail_max_tokens", -1, "an int >= 0"),
    (GroupedGemmFp8Tuning, "wgrad_gluon_epilogue_warps", 1, "0 or 2"),
    (GroupedGemmFp8Tuning, "wgrad_gluon", 1, "a bool"),
    (GroupedGemmFp8Tuning, "ragged_gluon_block_m", 96, "64 or 128 (one warpgroup per 64 rows)"),
    (GroupedGemmFp8Tuning, "wgrad_gluon_stages", 1, "an int in 2..8 (shared-memory stages)"),
    (GroupedGemmFp8Tuning, "wgrad_gluon_add_mode", "tma_add", "'atomic' or 'load'"),
    (QuantizeTuning, "per_tensor_block", 1000, "a power of two >= 128"),
    (QuantizeTuning, "rows_warps", 3, "one of (1, 2, 4, 8, 16)"),
    (QuantizeTuning, "rowcol_maxnreg", 8, "None or an int in 24..255"),
    (QuantizeTuning, "rowcol_gluon", "yes", "a bool"),
    (TokenLayoutTuning, "block_t", 100, "a power of two >= 16"),
])
def test_a_bad_value_names_itself(family, field, value, what):
    with pytest.raises(ValueError, match=re.escape(f"{family.__name__}.{field} must be {what}, got {value!r}")):
        family(**{field: value})
    with pytest.raises(ValueError, match=re.escape(f"{family.__name__}.{field} must be")):
        tuning(**{[n for n, c in zip(KNOBS, (GroupedGemmTuning, GroupedGemmFp8Tuning, QuantizeTuning,
                                              TokenLayoutTuning)) if c is family][0]: {field: value}})
    assert current() == KernelTuning()


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        current().grouped_gemm.wide_tail_max_tokens = 0  # type: ignore[misc]


def test_unknown_names_raise_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"GroupedGemmFp8Tuning has no knob 'wgrad_glue'; its knobs are "
                                         r"ragged_gluon, .*wgrad_gluon_epilogue_warps, linear_cublas$"):
        tuning(grouped_gemm_fp8=dict(wgrad_glue=False))
    with pytest.raises(ValueError, match=r"GroupedGemmTuning has no knob 'wgrad_gluon'; its knobs are "
                                         r"wide_tail_max_tokens$"):
        tuning(grouped_gemm=dict(wgrad_gluon=False))  # (the bf16 wgrad has one kernel: no Gluon switch)
    with pytest.raises(ValueError, match=r"no kernel family 'gemm'; the families are grouped_gemm, grouped_gemm_fp8, "
                                         r"quantize, token_layout"):
        tuning(gemm=dict(wgrad_gluon=False))
    with pytest.raises(TypeError, match=r"tuning\(quantize=...\) takes a dict of QuantizeTuning fields or a "
                                        r"QuantizeTuning, got GroupedGemmTuning"):
        tuning(quantize=GroupedGemmTuning())
    with pytest.raises(TypeError, match=r"tuning\(\) takes GroupedGemmTuning, .* instances positionally, got dict"):
        tuning(dict(rows_tile_m=16))
    with pytest.raises(ValueError, match=r"the family 'quantize' is given twice"):
        tuning(QuantizeTuning(), quantize=dict(rows_tile_m=16))


def test_the_override_ends_with_the_block():
    with tuning(grouped_gemm_fp8=dict(wgrad_gluon=False), quantize=dict(rows_tile_m=16)) as t:
        assert t is current()
        assert not current().grouped_gemm_fp8.wgrad_gluon and current().quantize.rows_tile_m == 16
        assert current().grouped_gemm_fp8.wgrad_gluon_stages == 5  # the other knobs keep their values
        assert current().grouped_gemm == GroupedGemmTuning()
    assert current() == KernelTuning()


def test_blocks_nest():
    with tuning(quantize=dict(rows_tile_m=16, rows_warps=8)):
        with tuning(quantize=dict(rows_tile_m=64)):
            assert (current().quantize.rows_tile_m, current().quantize.rows_warps) == (64, 8)
            with tuning(QuantizeTuning(blocks_warps=4)):  # a whole family: the defaults but one
                assert current().quantize == QuantizeTuning(blocks_warps=4)
            assert current().quantize.rows_tile_m == 64
        assert (current().quantize.rows_tile_m, current().quantize.rows_warps) == (16, 8)
    assert current() == KernelTuning()


def test_restored_after_an_exception():
    with pytest.raises(KeyError):
        with tuning(token_layout=dict(block_t=256)):
            with tuning(token_layout=dict(block_r=32)):
                assert current().token_layout == TokenLayoutTuning(block_t=256, block_r=32)
                raise KeyError("inside")
    assert current() == KernelTuning()


def test_a_bad_override_fails_before_the_block():
    with pytest.raises(ValueError, match="rows_tile_m must be a power of two"):
        with tuning(quantize=dict(rows_tile_m=3)):
            raise AssertionError("the block ran")
    assert current() == KernelTuning()


def test_reaches_other_threads():
    """Process-wide, as the module constants were: a kernel launched on another thread (the autograd
    engine's device threads run backward on CUDA) sees the override."""
    seen = []
    with tuning(grouped_gemm=dict(wide_tail_max_tokens=64)):
        th = threading.Thread(target=lambda: seen.append(current().grouped_gemm.wide_tail_max_tokens))
        th.start()
        th.join()
    assert seen == [64]


def test_blocks_must_nest():
    """A block left while one opened inside it is still open raises; the one still open keeps its
    overrides (on the defaults: the left block's are gone) until it is left too."""
    a, b = tuning(quantize=dict(rows_tile_m=16)), tuning(quantize=dict(rows_warps=8))
    a.__enter__()
    b.__enter__()
    with pytest.raises(RuntimeError, match="blocks must nest"):
        a.__exit__(None, None, None)
    assert current().quantize == QuantizeTuning(rows_warps=8)
    b.__exit__(None, None, None)
    assert current() == KernelTuning()
    with a:
        with pytest.raises(RuntimeError, match="this block is already open"):
            a.__enter__()
        assert current().quantize == QuantizeTuning(rows_tile_m=16)
    assert current() == KernelTuning()


def test_the_fixture_scopes_to_the_test(kernel_tuning):
    assert kernel_tuning(grouped_gemm_fp8=dict(wgrad_gluon=False)).grouped_gemm_fp8.wgrad_gluon is False
    kernel_tuning(grouped_gemm_fp8=dict(wgrad_gluon_stages=4))
    assert current().grouped_gemm_fp8 == GroupedGemmFp8Tuning(wgrad_gluon=False, wgrad_gluon_stages=4)


def test_the_fixture_left_nothing_behind():
    assert current() == KernelTuning()


def test_the_kernels_read_the_tuning_in_force():
    """The dispatch and the config picks follow a block's values (pure functions of the problem and the
    tuning; no kernel runs)."""
    pytest.importorskip("triton")
    from distwgrad.kernels import _grouped_gemm_configs as C
    from distwgrad.kernels import grouped_gemm as G  # noqa: F401  (imports under a block too)
    from distwgrad.kernels import grouped_gemm_fp8 as F  # noqa: F401
    kw = dict(num_tokens=16384, num_groups=128, n=768, k=2048, elem_bytes=2, smem_limit=None)
    assert C.pick_ragged(**kw, tuning=current().grouped_gemm).wide_tail
    assert not C.pick_ragged(**kw, tuning=GroupedGemmTuning(wide_tail_max_tokens=64)).wide_tail
    with tuning(grouped_gemm=dict(wide_tail_max_tokens=64)):  # what the fprop/dgrad launcher passes
        assert not C.pick_ragged(**kw, tuning=current().grouped_gemm).wide_tail
    fp8 = GroupedGemmFp8Tuning()
    assert fp8.ragged_gluon_wanted(768, 0) and not fp8.ragged_gluon_wanted(512, 128)
    assert not GroupedGemmFp8Tuning(ragged_gluon=False).ragged_gluon_wanted(4096, 0)
    assert (fp8.wgrad_stages(True), fp8.wgrad_stages(False)) == (6, 5)
