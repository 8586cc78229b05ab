"""``qa/bench/step_phases.py`` on CPU: every phase of each build is timed and recorded."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_step_phases_rows_per_phase(tmp_path):
    out = tmp_path / "rows.jsonl"
    cmd = [sys.executable, str(ROOT / "qa/bench/step_phases.py"), "--model", "tiny", "--modes", "eager",
           "--precisions", "bf16", "--impls", "distwgrad,torch", "--warmup", "1", "--steps", "1",
           "--cprofile", "5", "--results", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    phases = {(r["impl"], r["case"].rsplit(" ", 1)[1]) for r in rows}
    assert phases == {("distwgrad", p) for p in ("forward", "backward", "drain", "finalize", "optimizer")} | {
        ("torch", p) for p in ("forward", "backward", "optimizer")}
    assert {r["metric"] for r in rows} == {"host_ms"}  # CPU: no device time
    assert all(r["value"] > 0 and r["bench"] == "step_phases" and r["device"] == "cpu" for r in rows)
    assert all(r["real_step_ms"] > 0 for r in rows)
    assert "real step" in run.stdout and "tottime" in run.stdout  # the table and the cProfile listing
