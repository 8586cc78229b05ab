"""``qa/bench/parallelism.py experts`` runs as docs/experts.md says, on the ``tiny`` preset: 2 CPU ranks (every
build, its rows, FSDP2's bytes counted as distwgrad counts ep 1's) and ``--compute`` on the CPU. The ranks are
forked as torchrun would start them ([Note: forked job ranks]): the rows are the test, not the launcher."""

from __future__ import annotations

import json
import os

import pytest
from train_job_cases import _run_forked

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "qa", "bench", "parallelism.py")


def _run(args: list[str], tmp_path, nproc: int | None = None) -> list[dict]:
    results = tmp_path / "rows.jsonl"
    proc = _run_forked(["experts", *args, "--results", str(results)], nproc, timeout=300, target=BENCH)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return [json.loads(line) for line in results.read_text().splitlines()]


@pytest.mark.distributed
@pytest.mark.timeout(320)
def test_cpu_ranks(tmp_path):
    rows = _run(["--model", "tiny", "--warmup", "0", "--steps", "1"], tmp_path, nproc=2)
    got = {(r["impl"], r["metric"]): r["value"] for r in rows}
    builds = ("distwgrad ep=1", "distwgrad ep=2", "distwgrad ep=2 no-overlap", "fsdp2")
    assert {i for i, _ in got} == set(builds), sorted(got)
    assert got["distwgrad ep=1", "step_ratio"] == 1.0
    # the same parameters, both gathered twice and reduced once a microbatch, counted at full size; distwgrad's
    # counts include the padding of shards to equal size (a row of a weight at most, per weight and rank)
    fsdp2, ep1 = got["fsdp2", "bytes_per_step"], got["distwgrad ep=1", "bytes_per_step"]
    assert fsdp2 <= ep1 <= fsdp2 * 1.01, (fsdp2, ep1)
    assert got["distwgrad ep=2", "bytes_per_step"] == got["distwgrad ep=2 no-overlap", "bytes_per_step"]
    assert got["distwgrad ep=2", "bytes_per_step"] < got["distwgrad ep=1", "bytes_per_step"]
    assert ("distwgrad ep=2", "hidden_fraction") in got


def test_compute_on_the_cpu(tmp_path):
    rows = _run(["--compute", "--device", "cpu", "--model", "tiny", "--warmup", "1", "--steps", "1"], tmp_path)
    cases = {r["case"] for r in rows}
    assert cases == {f"experts ep={ep} tiny E=4 tokens=128" for ep in (1, 2, 4)}, cases
    assert {r["metric"] for r in rows} == {"fwd_ms", "dgrad_ms", "wgrad_ms"} and all(r["value"] > 0 for r in rows)
