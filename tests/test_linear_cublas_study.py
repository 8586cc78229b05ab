"""qa/studies/linear_cublas.py: its arguments, checked before it needs a GPU (the study itself runs on one)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "qa" / "studies" / "linear_cublas.py"


def _main():
    return runpy.run_path(str(SCRIPT))["main"]


def test_an_unknown_shape_is_named(capsys):
    with pytest.raises(SystemExit) as exc:
        _main()(["--shapes", "qkv_large,mlp"])
    assert exc.value.code == 2
    assert "--shapes: choose from qkv_large,proj_large,lm_head_large,qkv_xl,proj_xl,lm_head_xl, got " \
           "'qkv_large,mlp'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a CUDA device")
def test_refuses_without_a_gpu(capsys):
    with pytest.raises(SystemExit) as exc:
        _main()(["--host-only"])
    assert exc.value.code == 2
    assert "needs a CUDA device of compute capability 8.9 or more" in capsys.readouterr().err
