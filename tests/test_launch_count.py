"""qa/studies/launch_count.py: what one step of the job's model issues, counted per kernel (CPU, interpreter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distwgrad.testing.interpreter import run_interpreted

SCRIPT = Path(__file__).resolve().parents[1] / "qa" / "studies" / "launch_count.py"


def test_one_layer_issues_one_quantization_per_operand(tmp_path):
    """One block: bf16 runs fc1 and fc2 (fprop and dgrad: 4 ragged launches, 2 wgrads) and rotates q and k (forward
    and backward: 4 rotary launches, [Note: rotary in one pass]); FP8 quantizes the inputs
    of qkv, proj, fc1 and fc2 and their output gradients, and the lm_head's input and gradient: 10 operands, each
    one amax and one cast + transpose per tensor (one rows + columns pass blockwise). The router is not among
    them ([Note: a module out of FP8])."""
    pytest.importorskip("triton")
    out = tmp_path / "counts.json"
    run_interpreted(str(SCRIPT), "--layers", "1", "--json", str(out), kernels_on_cpu=True, timeout=300)
    got = {p: c["launches"] for p, c in json.loads(out.read_text()).items()}
    assert got["bf16"] == {"_ragged_m_kernel": 4, "_wgrad_kernel": 2, "_rotary_kernel": 4}
    per_tensor, blockwise = got["fp8_per_tensor"], got["fp8_blockwise"]
    assert per_tensor["_amax_kernel"] == per_tensor["_cast_transpose_kernel"] == 10
    assert blockwise["_quantize_rowcol_kernel"] == 10 and "_amax_kernel" not in blockwise
    for counts in (per_tensor, blockwise):  # fprop + dgrad of qkv, proj, fc1, fc2, lm_head; their 5 wgrads
        assert counts["_fp8_ragged_kernel"] == 10 and counts["_wgrad_fp8_kernel"] == 5


def test_two_microbatches_quantize_the_weights_once_a_step(tmp_path):
    """With two microbatches the activations are quantized twice as often, the weights (qkv, proj, fc1, fc2,
    lm_head, in forward's layout and dgrad's) no more often: kept for the step ([Note: fp8 weights kept across
    microbatches]); ``--no-fp8-weight-cache`` quantizes them at every use."""
    pytest.importorskip("triton")
    got = {}
    for flag in ((), ("--no-fp8-weight-cache",)):
        out = tmp_path / f"counts{len(flag)}.json"
        run_interpreted(str(SCRIPT), "--layers", "1", "--microbatches", "2", "--precisions", "fp8_blockwise",
                        *flag, "--json", str(out), kernels_on_cpu=True, timeout=300)
        got[bool(flag)] = json.loads(out.read_text())["fp8_blockwise"]["launches"]
    assert got[False]["_quantize_rowcol_kernel"] == got[True]["_quantize_rowcol_kernel"] == 20
    assert (got[False]["_quantize_blocks_kernel"], got[True]["_quantize_blocks_kernel"]) == (10, 20)


def test_refuses_to_run_outside_the_interpreter(capsys, monkeypatch):
    import runpy
    import sys

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("DISTWGRAD_KERNELS_ON_CPU", raising=False)
    argv = sys.argv
    sys.argv = [str(SCRIPT)]
    try:
        with pytest.raises(SystemExit) as exc:
            runpy.run_path(str(SCRIPT), run_name="__main__")
    finally:
        sys.argv = argv
    assert exc.value.code == 2 and "TRITON_INTERPRET=1 DISTWGRAD_KERNELS_ON_CPU=1" in capsys.readouterr().err
