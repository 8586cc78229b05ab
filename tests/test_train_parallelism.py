"""The training job's parallelism on CPU/gloo ranks, forked as torchrun starts them ([Note: forked job ranks]).
``--pp``: the same losses as the data-parallel run at every step, checkpoints that move between pp sizes (pp2 ->
pp1 -> pp2), report.json's parallelism. ``--ep``: the same losses as the data-parallel run at every step, on 2
ranks and at ep 2 x dp 2 on 4. And the options each refuses.

Tolerance: the runs train the same global batch in the same 4 microbatches per data-parallel rank; they
differ only in how the partial sums of losses and gradients are grouped (one data-parallel rank holding the
whole batch against two holding half each; the tied embedding's two copies summed at finalize; sharded
weights reduced after several microbatches at once), so each step's loss agrees with ``--pp 1``'s to the
job's own parity bound ``PARITY_LOSS_ATOL`` (1e-5, about 40 fp32 ulps at a loss of 4; measured at most
3.1e-6 over these 6 steps). Longer horizons amplify rounding through top-k routing ([Note: parity] in
``launch/train.py``). With ``--ep`` the experts' GEMMs take the rows of every rank of the ep group at once
and their wgrads reduce over fewer ranks, the same sums regrouped: the same bound.
"""

from __future__ import annotations

import json

import pytest
from train_job_cases import LOSS_ATOL, _launch, _ok, _report, _run_forked

ARGS = ["--global-batch", "16", "--microbatches", "4", "--seq-len", "32", "--d-model", "32", "--d-ff", "64",
        "--n-layers", "4", "--no-progress", "--log-every", "0", "--steps", "6"]


def _check_losses(report: dict, reference: dict, steps, where: str) -> None:
    for step, got in zip(steps, report["loss"][-len(steps):]):
        want = reference["loss"][step - 1]
        assert abs(got - want) <= LOSS_ATOL, f"{where}, step {step}: {got} against --pp 1's {want}"


def _check_parallelism(report: dict, dp: int, schedule: str, n_stages: int) -> None:
    par = report["parallelism"]
    assert (par["pp"], par["dp"], par["schedule"], par["microbatches"]) == (2, dp, schedule, 4)
    stages = par["stage_times_ms"]
    assert sorted(stages, key=int) == [str(s) for s in range(n_stages)]
    assert all(t["F_ms"] > 0 and t["B_ms"] > 0 and t["W_ms"] > 0 for t in stages.values()), stages


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_pipeline_and_expert_parallel_jobs_reach_the_data_parallel_losses(tmp_path):
    """One test, so the runs it compares are made once (module fixtures run once per xdist worker):
    * --pp 1 (and --ep 1) on 2 ranks (dp 2), the reference;
    * --ep 2 on 2 ranks and --ep 2 x dp 2 on 4: every step's loss, report.json's parallelism; the latter's
      step 3 resumed at --ep 1 on 2 ranks for the last three;
    * --pp 2 --pp-schedule ZBVZeroBubble on 2 ranks: every step's loss;
    * the ZBV run's checkpoint at step 2 resumed at pp 1 for two steps and saved, that resumed at pp 2 x dp 2
      (1F1B, each stage's blocks coalesced) on 4 ranks for the last two: every resumed step's loss,
      report.json's parallelism, and both checkpoints naming the same parameters (the tied weight once, as
      embedding.weight)."""
    ref, zbv, b, c = (str(tmp_path / n) for n in ("pp1", "zbv", "b", "c"))
    _ok(_run_forked([*ARGS, "--out", ref]))
    reference = _report(ref)
    assert len(reference["loss"]) == 6 and reference["parallelism"] == {"pp": 1, "dp": 2}
    for nproc in (2, 4):
        out = str(tmp_path / f"ep2_{nproc}")
        _ok(_run_forked([*ARGS, "--ep", "2", "--save-every", "3", "--out", out], nproc=nproc))
        _check_losses(_report(out), reference, range(1, 7), f"--ep 2 on {nproc} ranks")
        par = _report(out)["parallelism"]
        a2a = par.pop("all_to_all")
        assert par == {"pp": 1, "ep": 2, "dp": nproc // 2}
        # every rank, each of 4 layers and 4 microbatches: the E = 4 int64 counts; and each of the step's 16 x 32
        # x top_k 2 = 1024 assignment rows (d_model 32 fp32) travels four times: out and back, forward and
        # backward
        assert sum(a2a["bytes_per_step"]) == 4 * (nproc * 4 * 4 * 8 + 4 * 1024 * 32 * 4), a2a
        assert len(a2a["exposed_s_per_step"]) == nproc and all(t > 0 for t in a2a["exposed_s_per_step"]), a2a
    ep1 = str(tmp_path / "ep1")  # the ep 2 x dp 2 run's step 3, resumed without expert parallelism on 2 ranks
    _ok(_run_forked([*ARGS, "--resume", f"{tmp_path}/ep2_4/checkpoints/step_3", "--out", ep1]))
    _check_losses(_report(ep1), reference, (4, 5, 6), "resumed at --ep 1")
    _ok(_run_forked([*ARGS, "--pp", "2", "--pp-schedule", "ZBVZeroBubble", "--save-every", "2", "--out", zbv]))
    _check_losses(_report(zbv), reference, range(1, 7), "pp 2 ZBVZeroBubble")
    _check_parallelism(_report(zbv), 1, "ZBVZeroBubble", 4)
    _ok(_run_forked([*ARGS, "--steps", "4", "--save-every", "2", "--resume", f"{zbv}/checkpoints/step_2", "--out", b]))
    _ok(_run_forked([*ARGS, "--pp", "2", "--pp-schedule", "1F1B", "--resume", f"{b}/checkpoints", "--out", c], nproc=4))
    _check_parallelism(_report(c), 2, "1F1B", 2)
    for out, steps in ((b, (3, 4)), (c, (5, 6))):
        assert _report(out)["steps"][-2:] == list(steps)
        _check_losses(_report(out), reference, steps, f"resumed in {out}")
    metas = [json.load(open(f"{out}/checkpoints/step_{n}/meta.json")) for out, n in ((zbv, 2), (b, 4))]
    assert metas[0]["params"] == metas[1]["params"] and "embedding.weight" in metas[0]["params"]
    assert not any("lm_head" in name for name in metas[0]["params"])


def test_expert_parallel_options_are_checked_before_anything_runs():
    TrainConfig = _launch("config").TrainConfig
    with pytest.raises(ValueError, match="--ep 2 does not run with --compile, --eval-every yet"):
        TrainConfig(ep=2, compile=True, eval_every=2)
    with pytest.raises(ValueError, match="--ep 2 does not run with --pp yet"):
        TrainConfig(ep=2, pp=2)
    with pytest.raises(ValueError, match="ep=0 must be a positive int"):
        TrainConfig(ep=0)
    with pytest.raises(ValueError, match=r"--ep 3 must divide --n-experts 4"):
        TrainConfig(ep=3)
    with pytest.raises(ValueError, match=r"--ep 2 must divide the world size 3"):
        TrainConfig(ep=2).check_world_size(3)
    with pytest.raises(ValueError, match="--aux-loss-coef 0.01 does not run with --cuda-graph, --compile yet"):
        TrainConfig(aux_loss_coef=0.01, cuda_graph=True, compile=True, device="cuda")
    with pytest.raises(ValueError, match=r"aux_loss_coef must be a finite number >= 0, got -1.0"):
        TrainConfig(aux_loss_coef=-1.0)
    assert TrainConfig(aux_loss_coef=0.01).model_config().aux_loss_coef == 0.01


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
