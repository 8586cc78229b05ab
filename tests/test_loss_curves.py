"""``qa/bench/loss_curves.py`` ([Note: the FP8 loss bound]): distances of trailing-mean loss curves over the
fp32 run's, the FP8 bound of twice bf16's distance from fp32, and runs that cannot be compared refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qa.bench import loss_curves as lc

CONFIG = {"model": "tiny", "seed": 0, "steps": 4, "lr": 0.01, "precision": "fp32", "recipe": "none", "out": "x"}


def _run(tmp_path: Path, name: str, losses: list[float], **config) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "report.json").write_text(json.dumps({"config": {**CONFIG, **config}, "loss": losses, "device": "cpu",
                                               "world_size": 1}))
    return str(d)


def test_distances_and_the_bound(tmp_path, capsys):
    fp32 = _run(tmp_path, "fp32", [4.0, 4.0, 2.0, 2.0])
    bf16 = _run(tmp_path, "bf16", [4.0, 4.4, 2.0, 2.2], precision="bf16")           # trailing means 4.2, 3.2, 2.1
    pt = _run(tmp_path, "pt", [4.0, 4.2, 2.0, 2.0], precision="bf16", recipe="fp8_per_tensor")    # 4.1, 3.1, 2.0
    bw = _run(tmp_path, "bw", [4.0, 4.0, 3.0, 3.0], precision="bf16", recipe="fp8_blockwise")     # 4.0, 3.5, 3.0
    runs = lc.load_runs([fp32, bf16, pt, bw])
    got = {r["precision"]: r for r in lc.compare(runs, window=2)}   # fp32's trailing means 4.0, 3.0, 2.0
    assert got["bf16"]["distance"] == pytest.approx(0.2 / 3.0) and got["bf16"]["within"] is None
    bound = 2 * 0.2 / 3.0
    assert got["fp8_per_tensor"]["bound"] == pytest.approx(bound)
    assert got["fp8_per_tensor"]["distance"] == pytest.approx(0.1 / 2.0)   # |2.0 - 2.1| / 2.0, the largest
    assert got["fp8_per_tensor"]["within"] is True and got["fp8_per_tensor"]["from_fp32"] == pytest.approx(0.1 / 3.0)
    assert got["fp8_blockwise"]["distance"] == pytest.approx(0.9 / 2.0) and got["fp8_blockwise"]["within"] is False
    assert lc.main([fp32, bf16, pt, bw, "--window", "2", "--no-record"]) == 1  # a run outside: exit code 1
    assert "fp8_blockwise" in capsys.readouterr().out


def test_runs_that_cannot_be_compared(tmp_path):
    fp32 = _run(tmp_path, "fp32", [1.0] * 4)
    with pytest.raises(ValueError, match=r"no bf16 run among \['fp32'\]"):
        lc.load_runs([fp32])
    other = _run(tmp_path, "bf16", [1.0] * 4, precision="bf16", seed=1)
    with pytest.raises(ValueError, match=r"the runs differ in seed: 0 .* and 1 "):
        lc.load_runs([fp32, other])
    with pytest.raises(FileNotFoundError, match="report.json does not exist"):
        lc.load_runs([str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="curves of one length >= 20 steps, got 4"):
        lc.compare(lc.load_runs([fp32, _run(tmp_path, "b", [1.0] * 4, precision="bf16")]))
