"""The training job with ``--pp`` under torchrun on CPU/gloo: the same losses as ``--pp 1`` at every step,
checkpoints that move between pp sizes (pp2 -> pp1 -> pp2), report.json's parallelism, and the options it
refuses.

Tolerance: the runs train the same global batch in the same 4 microbatches per data-parallel rank; they
differ only in how the partial sums of losses and gradients are grouped (one data-parallel rank holding the
whole batch against two holding half each; the tied embedding's two copies summed at finalize; sharded
weights reduced after several microbatches at once), so each step's loss agrees with ``--pp 1``'s to the
job's own parity bound ``PARITY_LOSS_ATOL`` (1e-5, about 40 fp32 ulps at a loss of 4; measured at most
3.1e-6 over these 6 steps). Longer horizons amplify rounding through top-k routing ([Note: parity] in
``launch/train.py``).
"""

from __future__ import annotations

import json

import pytest
from train_job_cases import LOSS_ATOL, _launch, _ok, _report, _run

ARGS = ["--global-batch", "16", "--microbatches", "4", "--seq-len", "32", "--d-model", "32", "--d-ff", "64",
        "--n-layers", "4", "--no-progress", "--log-every", "0", "--steps", "6"]


@pytest.fixture(scope="module")
def pp1(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("pp1"))
    _ok(_run([*ARGS, "--out", out]))
    return _report(out)


@pytest.fixture(scope="module")
def zbv(tmp_path_factory):
    """pp 2 under ZBVZeroBubble on 2 ranks, a checkpoint every 2 steps (the checkpoint test resumes one)."""
    out = str(tmp_path_factory.mktemp("zbv"))
    _ok(_run([*ARGS, "--pp", "2", "--pp-schedule", "ZBVZeroBubble", "--save-every", "2", "--out", out]))
    return out


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc, extra", [(2, ["--pp-schedule", "ZBVZeroBubble"]), (4, ["--pp-schedule", "1F1B"])],
                         ids=["pp2-ZBVZeroBubble", "pp2xdp2-1F1B"])
def test_pipeline_reaches_the_losses_of_pp1(pp1, zbv, nproc, extra, tmp_path):
    out = zbv if nproc == 2 else str(tmp_path)
    if nproc == 4:
        _ok(_run([*ARGS, "--pp", "2", *extra, "--out", out], nproc=nproc))
    report = _report(out)
    assert len(report["loss"]) == len(pp1["loss"]) == 6
    for step, (got, want) in enumerate(zip(report["loss"], pp1["loss"]), 1):
        assert abs(got - want) <= LOSS_ATOL, f"step {step}: {got} against --pp 1's {want}"
    par = report["parallelism"]
    assert (par["pp"], par["dp"], par["schedule"], par["microbatches"]) == (2, nproc // 2, extra[1], 4)
    stages = par["stage_times_ms"]
    n_stages = 4 if extra[1] == "ZBVZeroBubble" else 2
    assert sorted(stages, key=int) == [str(s) for s in range(n_stages)]
    assert all(t["F_ms"] > 0 and t["B_ms"] > 0 and t["W_ms"] > 0 for t in stages.values()), stages
    assert pp1["parallelism"] == {"pp": 1, "dp": 2}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_checkpoints_move_between_pp_sizes(pp1, zbv, tmp_path):
    """The pp 2 (ZBV) run's step 2, resumed at pp 1 for two more steps, saved; resumed at pp 2 (1F1B) for the
    last two: every resumed step's loss is --pp 1's uninterrupted one (the same tolerance), and the
    checkpoints name the same parameters whatever wrote them (the tied weight once, as embedding.weight)."""
    a, b, c = zbv, str(tmp_path / "b"), str(tmp_path / "c")
    _ok(_run([*ARGS, "--steps", "4", "--save-every", "2", "--resume", f"{a}/checkpoints/step_2", "--out", b]))
    _ok(_run([*ARGS, "--pp", "2", "--resume", f"{b}/checkpoints", "--out", c]))
    for out, steps in ((b, (3, 4)), (c, (5, 6))):
        report = _report(out)
        assert report["steps"][-2:] == list(steps)
        for step, got in zip(steps, report["loss"][-2:]):
            want = pp1["loss"][step - 1]
            assert abs(got - want) <= LOSS_ATOL, f"step {step} resumed in {out}: {got} against {want}"
    metas = [json.load(open(f"{out}/checkpoints/step_{n}/meta.json")) for out, n in ((a, 2), (b, 4))]
    assert metas[0]["params"] == metas[1]["params"] and "embedding.weight" in metas[0]["params"]
    assert not any("lm_head" in name for name in metas[0]["params"])


def test_pipeline_options_are_checked_before_anything_runs():
    config = _launch("config")
    TrainConfig = config.TrainConfig
    with pytest.raises(ValueError, match="--pp 2 does not run with --compile, --eval-every yet"):
        TrainConfig(pp=2, eval_every=5, compile=True)
    with pytest.raises(ValueError, match="--pp-microbatches 4 needs --pp > 1"):
        TrainConfig(pp_microbatches=4)
    with pytest.raises(ValueError, match="pp=0 must be a positive int"):
        TrainConfig(pp=0)
    with pytest.raises(ValueError, match=r"--pp 2 must divide the world size 3"):
        TrainConfig(pp=2).check_world_size(3)
    with pytest.raises(ValueError, match="2 layers do not divide over 4 pipeline stages"):
        TrainConfig(pp=2, pp_schedule="ZBVZeroBubble").check_world_size(2)
    with pytest.raises(ValueError, match=r"data-parallel ranks \(world 4 / pp 2\) \* microbatches = 2 \* 3"):
        TrainConfig(pp=2, global_batch=16, pp_microbatches=3).check_world_size(4)
    assert TrainConfig(pp=2, n_layers=4, pp_microbatches=4).step_microbatches == 4
