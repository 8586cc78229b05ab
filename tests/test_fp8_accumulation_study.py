"""qa/studies/fp8_accumulation.py: its model of Hopper's fp8 accumulation, and the study's control.

The model is exact with enough bits (the products of fp8 values and their 32-term sums fit in fp64 and,
for these small values, in fp32) and truncates toward zero with few; the study exits 1 unless its exact
setting reproduces the emulated job's losses.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from train_job_cases import _run_forked

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STUDY = os.path.join(_ROOT, "qa", "studies", "fp8_accumulation.py")


def _study():
    spec = importlib.util.spec_from_file_location("fp8_accumulation_study", _STUDY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_hopper_dot_exact_with_enough_bits_and_truncating_with_few():
    study = _study()
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(8, 64, generator=gen).to(torch.float8_e4m3fn).double()
    B = torch.randn(5, 64, generator=gen).to(torch.float8_e4m3fn).double()
    assert torch.equal(study.hopper_dot(A, B, 60), (A @ B.t()).float())
    pos = A.abs() @ B.abs().t()
    low = study.hopper_dot(A.abs(), B.abs(), 4)
    assert bool((low <= pos.float()).all()) and bool((low < pos.float()).any()), "truncation is toward zero"


def test_study_control_reproduces_the_emulation():
    # one process forked from one that imported torch ([Note: forked job ranks])
    proc = _run_forked(["--bits", "40", "--steps", "2"], None, timeout=300, target=_STUDY)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip().startswith(("emulation", "40 bits"))]
    assert len(lines) == 2 and lines[0].split(":")[1] == lines[1].split(":")[1], proc.stdout
