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
    # above: signed, the largest rise over the reference; per-tensor ran below bf16 at every step
    assert got["fp8_per_tensor"]["above"] == pytest.approx(max(-0.1 / 4.0, -0.1 / 3.0, -0.1 / 2.0))
    assert got["fp8_blockwise"]["above"] == pytest.approx(0.9 / 2.0)
    assert got["bf16"]["above"] == pytest.approx(0.2 / 3.0)
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


def test_first_steps_of_a_run_stopped_early(tmp_path, capsys):
    fp32 = _run(tmp_path, "fp32", [4.0, 4.0, 2.0, 2.0, 9.0])
    bf16 = _run(tmp_path, "bf16", [4.0, 4.4, 2.0, 2.2, 9.0], precision="bf16")
    pt = _run(tmp_path, "pt", [4.0, 4.2, 2.0, 2.0], precision="bf16", recipe="fp8_per_tensor")  # stopped at 4
    with pytest.raises(ValueError, match="curves of one length >= 2 steps, got 4, 5 and 5"):
        lc.compare(lc.load_runs([fp32, bf16, pt]), window=2)
    with pytest.raises(ValueError, match=r"different numbers of steps, \{'fp32': 5, 'bf16': 5, 'fp8_per_tensor': 4\}; "
                       r"--steps N compares the first N"):
        lc.first_steps(lc.load_runs([fp32, bf16, pt]), None)
    runs = lc.first_steps(lc.load_runs([fp32, bf16, pt]), 4)
    assert [len(r["loss"]) for r in runs.values()] == [4, 4, 4]
    assert {r["precision"]: r["distance"] for r in lc.compare(runs, window=2)}["fp8_per_tensor"] == \
        pytest.approx(0.1 / 2.0)   # as in test_distances_and_the_bound, the fifth step ignored
    with pytest.raises(ValueError, match=r"steps=5 but these runs trained fewer: \{'fp8_per_tensor': 4\}"):
        lc.first_steps(lc.load_runs([fp32, bf16, pt]), 5)
    with pytest.raises(SystemExit):
        lc.main([fp32, bf16, pt, "--window", "2", "--no-record"])
    assert "different numbers of steps" in capsys.readouterr().err
    assert lc.main([fp32, bf16, pt, "--window", "2", "--steps", "4", "--no-record"]) == 0
    assert "4 steps seed 0" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        lc.main([fp32, bf16, pt, "--window", "2", "--steps", "1", "--no-record"])
    assert "--steps must be >= --window (2), got 1" in capsys.readouterr().err


def test_rows_name_the_machine_of_the_runs(tmp_path, monkeypatch):
    """Reports of GPU runs compared on a machine without one: the rows take the device, torch and triton of the
    runs' reports (those written before ``device_name`` existed give their device, ``cuda:0``)."""
    out = tmp_path / "rows.jsonl"
    dirs = []
    for name, prec, recipe in (("fp32", "fp32", "none"), ("bf16", "bf16", "none"),
                               ("pt", "bf16", "fp8_per_tensor")):
        d = tmp_path / name
        d.mkdir()
        (d / "report.json").write_text(json.dumps({
            "config": {**CONFIG, "precision": prec, "recipe": recipe}, "loss": [4.0, 4.0, 2.0, 2.0],
            "device": "cuda:0", "device_name": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0",
            "world_size": 1}))
        dirs.append(str(d))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert lc.main([*dirs, "--window", "2", "--results", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["precision"] for r in rows] == ["bf16", "fp8_per_tensor"]
    assert {(r["device"], r["torch"], r["triton"]) for r in rows} == {("NVIDIA H200", "2.11.0+cu130", "3.6.0")}
    assert rows[1]["above"] == 0.0 and rows[1]["within"] is True


def test_a_report_file_is_a_run(tmp_path):
    fp32 = _run(tmp_path, "fp32", [4.0, 4.0, 2.0, 2.0])
    bf16 = _run(tmp_path, "bf16", [4.0, 4.4, 2.0, 2.2], precision="bf16")
    by_dir = lc.compare(lc.load_runs([fp32, bf16]), window=2)
    by_file = lc.compare(lc.load_runs([str(Path(fp32) / "report.json"), str(Path(bf16) / "report.json")]), window=2)
    assert by_file == by_dir and by_file[0]["distance"] == pytest.approx(0.2 / 3.0)
