"""Pipeline schedules over distwgrad modules ([Note: W steps are deferred wgrads] in
``distwgrad/parallel/pipeline.py``), on gloo ranks, against the single-process model.

Each case runs three training steps of ``tests/pipeline_cases.py``'s model cut into stages under one of
torch's schedules, and the same model uncut on every rank (the oracle: the data-parallel group and batch
of this rank, one microbatch after another, each wgrad drained after its backward). Compared at every step:
each microbatch's loss, every gradient after ``finalize_model_grads``, every parameter after AdamW.

Everything is bit-exact (``torch.equal``): the schedule runs each stage's F, B and W per microbatch in the
oracle's order of additions (B and W of microbatch m after those of m - 1, per weight). Where the tied
embedding / lm_head weight lives on two ranks, each copy sums its own stage's contributions and the copies
then add; the oracle has the same two copies and adds their gradients the same way
(``pipeline_cases.sum_tied_copies``), so the order of additions is the same there too.

Two exceptions, where the schedule groups the same additions differently:
* In a V schedule the first and the last stage share rank 0 and so one weight object, whose buffer receives
  the embedding's contributions (in B) and the head's (in W) in the schedule's order, where the oracle
  alternates them per microbatch.
* With dp > 1 a sharded weight reduces (reduce-scatter over dp) whenever every recorded use has delivered:
  after each microbatch in the oracle, after several at once where the schedule runs several forwards
  first. Reducing sum(a_m) instead of summing reduce(a_m) reorders the dp * M additions.
Reordering n <= 2 * dp * M = 16 fp32 additions moves each element by at most (n - 1) * 2^-24 * S, S the sum
of the |contributions| (below 2 for this model's inputs: cross-entropy gradients of at most
1 / (M * MB * T) per token times activations below 3, over at most 2 * dp * M * MB * T = 96 token rows), so
REORDERED_ATOL = 2e-6 (at most 6e-8 seen). Both n and S grow with dp (S with the rows summed before the
average), so with dp > 2 (HSDP's 4 ranks) the bound scales by (2 * dp * M - 1) * dp / 30, 8.3e-6 at dp 4,
M 4 (``_reordered_atol``). Every rank's oracle then takes the pipeline's gradients, so the optimizers step
from equal gradients and every later comparison starts from equal weights.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import distwgrad
from distwgrad import ShardedWeight
from distwgrad.fp8 import BlockwiseScaling, PerTensorScaling, fp8_autocast
from distwgrad.parallel import (
    SCHEDULES,
    PipelineStage,
    build_schedule,
    check_pipeline_config,
    stage_placement,
    tie_first_and_last_stage,
)
from distwgrad.testing.multiprocess import for_each_case, run_distributed
from tests import pipeline_cases as pc

pytestmark = pytest.mark.distributed

MB, STEPS, REORDERED_ATOL = 2, 3, 2e-6


def _reordered_atol(dp: int, n_micro: int) -> float:
    """REORDERED_ATOL at dp <= 2; scaled with the bound's n and S beyond (module docstring)."""
    return REORDERED_ATOL * max(1.0, (2 * dp * n_micro - 1) * dp / 30)


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.main_grad if isinstance(p, ShardedWeight) else p.grad


def _build(schedule: str, pp: int, dp: int, n_layers: int, n_micro: int, *, checkpoint: bool = False,
           dtype: torch.dtype | None = None, coalesce: bool = False, hsdp: tuple[int, int] | None = None):
    """This rank's stages, their schedule, and the oracle, on a (pp, dp) mesh. ``coalesce``: each stage's
    blocks coalesced (``distwgrad.coalesce``, a unit a block, the stage the root). ``hsdp=(R, S)``: a
    (pp, replicate, shard) mesh instead, each stage's weights HSDP over its (R, S) sub-mesh (dp = R * S)."""
    kw = {"checkpoint": checkpoint, "dtype": dtype}
    act = dtype or torch.float32
    per = check_pipeline_config(schedule, pp_size=pp, n_layers=n_layers, n_microbatches=n_micro)
    if hsdp:
        mesh = init_device_mesh("cpu", (pp, *hsdp), mesh_dim_names=("pp", "replicate", "shard"))
        dp_group = mesh["replicate", "shard"]
    else:
        mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
        dp_group = mesh.get_group("dp")
    pp_rank = mesh.get_local_rank("pp")
    n_stages, per_stage = pp * per, n_layers // (pp * per)
    indices = stage_placement(schedule, pp_rank, pp, per)
    shared = pc.tied_weight(dp_group, dtype) if {0, n_stages - 1} <= set(indices) else None
    mods, stages = [], []
    for s in indices:
        first, last = s == 0, s == n_stages - 1
        mod = pc.Stage(range(s * per_stage, (s + 1) * per_stage), dp_group, first=first, last=last, tied=shared, **kw)
        x = (torch.zeros(MB, pc.T, dtype=torch.long) if first else
             torch.empty(MB, pc.T, pc.D, dtype=act, requires_grad=True))
        y = torch.empty(MB, pc.T, pc.V if last else pc.D, dtype=act, requires_grad=True)
        if coalesce:
            distwgrad.coalesce(mod, units=list(mod.blocks.values()))
        mods.append(mod)
        stages.append(PipelineStage(mod, s, n_stages, "cpu", input_args=x, output_args=y, group=mesh.get_group("pp")))
    tied = shared if shared is not None else next(
        (m.embed.weight if m.embed is not None else m.head.weight for m in mods if m.embed or m.head), None)
    tie_first_and_last_stage(tied, schedule, mesh)
    apart = pp > 1 and SCHEDULES[_canonical(schedule)] != "v"  # first and last stage on two ranks: two tied copies
    oracle = pc.Stage(range(n_layers), dp_group, first=True, last=True, untied=apart, **kw)
    sched = build_schedule(schedule, stages, n_micro, pc.loss_fn)
    sync = _oracle_sync_group(mesh)
    return mods, sched, oracle, dp_group, indices, n_stages, sync


def _canonical(schedule: str) -> str:
    return next(k for k in SCHEDULES if k.lower() == schedule.lower())


def _oracle_sync_group(mesh):
    """A group of this rank's pp peers of its own: the schedule's sends may still be in flight on the pp group
    when a step returns."""
    ranks = mesh.mesh.reshape(mesh.shape[0], -1)
    mine = None
    for j in range(ranks.shape[1]):
        group = dist.new_group(ranks[:, j].tolist())
        if dist.get_rank() in ranks[:, j].tolist():
            mine = group
    return mine


def _take_pipeline_grads(mods, ref_params: dict, pp_group) -> None:
    """Every rank's oracle takes the pipeline's gradients (each from the rank that holds its stage), so the
    oracles step from the pipeline's sums where a schedule reorders them."""
    mine = {_ref_name(n, ref_params): _grad(p) for m in mods for n, p in m.named_parameters()}
    for name, q in ref_params.items():
        g = mine[name].clone() if name in mine else torch.zeros_like(_grad(q))
        dist.all_reduce(g, group=pp_group)  # x + 0 == x: exact
        _grad(q).copy_(g)


def _recipe(case: dict):
    """The case's FP8 recipe around the schedule's step and the oracle's microbatches (emulated on CPU)."""
    recipe = {"fp8_per_tensor": PerTensorScaling, "fp8_blockwise": BlockwiseScaling}.get(case.get("recipe", ""))
    return fp8_autocast(recipe()) if recipe else contextlib.nullcontext()


def _ref_name(name: str, ref_params: dict) -> str:
    """A stage parameter's name in the oracle: ``blocks.<i>.`` is global already; a head whose weight is the
    embedding's (tied on one rank) appears as ``embed.weight`` only."""
    return name if name in ref_params else {"head.weight": "embed.weight"}[name]


def _train_and_compare(case: dict, rank: int, world: int) -> None:
    schedule, pp, n_micro = case["schedule"], case["pp"], case["micro"]
    dp = world // pp
    mods, sched, oracle, dp_group, indices, n_stages, pp_group = _build(
        schedule, pp, dp, case["layers"], n_micro, checkpoint=case.get("checkpoint", False), dtype=case.get("dtype"),
        coalesce=case.get("coalesce", False), hsdp=case.get("hsdp"))
    opt = torch.optim.AdamW(list({id(p): p for m in mods for p in m.parameters()}.values()), lr=1e-2)
    ref_opt = torch.optim.AdamW(oracle.parameters(), lr=1e-2)
    ref_params = dict(oracle.named_parameters())
    if isinstance(dp_group, DeviceMesh):  # HSDP: the rank's place among the R * S data-parallel ranks
        r, sh = dp_group.get_coordinate()
        dp_rank = r * dp_group.shape[1] + sh
    else:
        dp_rank = dist.get_rank(dp_group)
    for step in range(STEPS):
        x, y = pc.batch(MB * n_micro, seed=100 * step + dp_rank)
        losses: list[torch.Tensor] = []
        kwargs = {"target": y, "losses": losses} if n_stages - 1 in indices else {}
        with _recipe(case):
            sched.step(x, **kwargs) if 0 in indices else sched.step(**kwargs)
        distwgrad.finalize_model_grads(mods, dp_group=dp_group)
        ref_losses = []
        for m in range(n_micro):
            part = slice(m * MB, (m + 1) * MB)
            with _recipe(case):
                loss = pc.loss_fn(oracle(x[part]), y[part]) / n_micro
                loss.backward()
                distwgrad.drain_deferred_wgrads(oracle)
            ref_losses.append(loss.detach())
        distwgrad.finalize_model_grads(oracle, dp_group=dp_group)
        if oracle.head.weight is not oracle.embed.weight:
            pc.sum_tied_copies(oracle)
        if losses:
            assert torch.equal(torch.stack(losses), torch.stack(ref_losses)), (step, losses, ref_losses)
        for m in mods:
            for name, p in m.named_parameters():
                want = _grad(ref_params[_ref_name(name, ref_params)])
                if (isinstance(p, ShardedWeight) and dp > 1) or (
                        _ref_name(name, ref_params) == "embed.weight" and SCHEDULES[_canonical(schedule)] == "v"):
                    torch.testing.assert_close(_grad(p), want, rtol=0, atol=_reordered_atol(dp, n_micro),
                                               msg=f"step {step}: {name}")
                    continue
                assert torch.equal(_grad(p), want), f"step {step}: {name} differs by {(_grad(p) - want).abs().max()}"
        if SCHEDULES[_canonical(schedule)] == "v" or dp > 1:
            _take_pipeline_grads(mods, ref_params, pp_group)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for m in mods:
            for name, p in m.named_parameters():
                assert torch.equal(p.detach(), ref_params[_ref_name(name, ref_params)].detach()), \
                    f"after step {step}: {name}"


def _schedules(rank, world, cases):
    for_each_case(cases, _train_and_compare, rank, world)


_ALL = sorted(SCHEDULES)


@pytest.mark.timeout(240)
def test_pp2_every_schedule_matches_the_single_process_model():
    """pp 2: six of torch's schedules, the tied weight on two ranks (or one, in a V), three AdamW steps; each
    schedule again with activation checkpointing, two of those in bf16 and two under the FP8 recipes."""
    cases = [dict(schedule=s, pp=2, micro=4, layers=6 if SCHEDULES[s] == "single" else 4) for s in _ALL]
    # activation checkpointing (recomputed in B, delivered once in W) in every schedule, alone, with bf16
    # compute on fp32 masters, and under both FP8 recipes (emulated on CPU: the weights quantized from their
    # masters once per step)
    cases += [dict(schedule=s, pp=2, micro=4, layers=4, checkpoint=True) for s in ("GPipe", "Interleaved1F1B")]
    cases += [dict(schedule=s, pp=2, micro=4, layers=4, checkpoint=True, dtype=torch.bfloat16)
              for s in ("InterleavedZeroBubble", "DualPipeV")]
    cases += [dict(schedule="ZBVZeroBubble", pp=2, micro=4, layers=4, checkpoint=True, recipe="fp8_per_tensor"),
              dict(schedule="1F1B", pp=2, micro=4, layers=6, checkpoint=True, recipe="fp8_blockwise")]
    run_distributed(_schedules, 2, cases, timeout=200)


@pytest.mark.timeout(240)
def test_pp2_by_dp2_and_pp4():
    """pp 2 x dp 2 (each stage's weights sharded over its dp pair, uneven rows; the tied copies summed over
    each stage pair; coalesced per block in two schedules) and pp 4."""
    cases = [dict(schedule=s, pp=2, micro=4, layers=4) for s in ("1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")]
    cases += [dict(schedule=s, pp=2, micro=4, layers=4, coalesce=True) for s in ("1F1B", "InterleavedZeroBubble")]
    cases += [dict(schedule=s, pp=4, micro=4, layers=8) for s in ("1F1B", "ZBVZeroBubble")]
    run_distributed(_schedules, 4, cases, timeout=200)


@pytest.mark.timeout(240)
def test_pp2_by_hsdp():
    """pp 2 x (replicate 2, shard 2) on 8 ranks: each stage's weights HSDP over its sub-mesh, the tied copies
    summed over each stage pair of one (replicate, shard) place; one schedule with the copies on two ranks,
    one V."""
    cases = [dict(schedule=s, pp=2, micro=4, layers=4, hsdp=(2, 2)) for s in ("InterleavedZeroBubble", "ZBVZeroBubble")]
    run_distributed(_schedules, 8, cases, timeout=200)


def _refusals(rank, world):
    mods, sched, _, dp_group, indices, _, _ = _build("ZBVZeroBubble", 2, 1, 4, 4)
    x, y = pc.batch(MB * 4, seed=0)
    stage = sched._stages[0]
    # A W dropped on purpose: the step refuses to finish and names the module, stage and microbatch.
    skipped = []
    original = type(stage).backward_weight_one_chunk

    def drop_one(self, bwd_chunk_id, last_backward=False):
        if self is stage and bwd_chunk_id == 1 and not skipped:
            skipped.append(bwd_chunk_id)
            self.dw_runner.pop(bwd_chunk_id)
            return
        original(self, bwd_chunk_id, last_backward=last_backward)
    type(stage).backward_weight_one_chunk = drop_one
    try:
        sched.step(x, target=y, losses=[]) if 0 in indices else sched.step(target=y, losses=[])
    finally:
        type(stage).backward_weight_one_chunk = original
    with pytest.raises(distwgrad.MissingContributionError, match=f"W of stage {stage.stage_index}, microbatch 1"):
        distwgrad.finalize_model_grads(mods, dp_group=dp_group)
    distwgrad.finalize_model_grads(mods, discard=True)
    # Microbatches of unequal size are refused by the first stage, naming the shapes.
    if 0 in indices:
        x5, _ = pc.batch(MB * 4 + 1, seed=1)
        with pytest.raises(ValueError, match="microbatches of equal size"):
            sched._stages[0].forward_one_chunk(0, (x5[:3],))
    # torch's gradient scaling cannot reach distwgrad weights: refused.
    with pytest.raises(RuntimeError, match="scale_grads=False"):
        stage.scale_grads(4)
    stage.scale_grads(1)  # nothing to scale: fine


@pytest.mark.timeout(120)
def test_a_dropped_w_and_unequal_microbatches_are_refused():
    run_distributed(_refusals, 2, timeout=90)


def test_configurations_are_checked_before_anything_is_built():
    with pytest.raises(ValueError, match="6 layers do not divide over 4 pipeline stages"):
        check_pipeline_config("ZBVZeroBubble", pp_size=2, n_layers=6, n_microbatches=4)
    with pytest.raises(ValueError, match="at least 4 microbatches, got 2"):
        check_pipeline_config("DualPipeV", pp_size=2, n_layers=4, n_microbatches=2)
    with pytest.raises(ValueError, match="at least 2 microbatches, got 1"):
        check_pipeline_config("1F1B", pp_size=2, n_layers=4, n_microbatches=1)
    with pytest.raises(ValueError, match="not one of"):
        check_pipeline_config("ZeroBubbleFast", pp_size=2, n_layers=4, n_microbatches=4)
    assert check_pipeline_config("interleaved1f1b", pp_size=2, n_layers=8, n_microbatches=2) == 2
    assert stage_placement("ZBVZeroBubble", 0, 2, 2) == [0, 3]
    assert stage_placement("Interleaved1F1B", 1, 2, 2) == [1, 3]
    with pytest.raises(ValueError, match="two stages per rank"):
        stage_placement("DualPipeV", 0, 2, 1)
    with pytest.raises(ValueError, match="pass input_args and output_args"):
        PipelineStage(torch.nn.Linear(2, 2), 0, 1, "cpu", input_args=None, output_args=None)


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match=r"pp_rank must be in \[0, 2\), got 2"):
        stage_placement("1F1B", 2, 2)
    with pytest.raises(ValueError, match="one stage per rank, got stages_per_rank=2"):
        stage_placement("GPipe", 0, 2, 2)
    with pytest.raises(ValueError, match="stages_per_rank must be >= 1, got 0"):
        stage_placement("Interleaved1F1B", 0, 2, 0)
    with pytest.raises(ValueError, match=r"runs 2 stage\(s\) per rank, got stages_per_rank=3"):
        check_pipeline_config("ZBVZeroBubble", pp_size=2, n_layers=4, n_microbatches=4, stages_per_rank=3)
    with pytest.raises(ValueError, match="pp_size must be >= 1, got 0"):
        check_pipeline_config("1F1B", pp_size=0, n_layers=4, n_microbatches=4)
    with pytest.raises(ValueError, match="scale_grads cannot be passed"):
        build_schedule("1F1B", [], 4, pc.loss_fn, scale_grads=True)
    with pytest.raises(ValueError, match="n_microbatches must be a positive int, got 0"):
        build_schedule("1F1B", [], 0, pc.loss_fn)
    with pytest.raises(TypeError, match=r"PipelineStage objects, got \['object'\]"):
        build_schedule("1F1B", [object()], 4, pc.loss_fn)
    with pytest.raises(ValueError, match="mesh must be a 1-D"):
        tie_first_and_last_stage(None, "1F1B", mesh=None)


def test_a_claimed_wgrad_runs_once():
    """A W's work is bound at claim time: draining the module first runs it, and the W then refuses
    (``WeightGradStore.run``) instead of running a later microbatch's work."""
    from distwgrad.nn import Linear
    from distwgrad.wgrad import DeferredWgradError

    fc = Linear(4, 4, delay_wgrad_compute=True)
    fc(torch.ones(2, 4)).sum().backward()
    (work,) = fc.wgrad_store.claim("W of stage 0, microbatch 0")
    assert fc.wgrad_store.labels() == ["W of stage 0, microbatch 0"]
    fc(torch.ones(2, 4)).sum().backward()
    assert fc.wgrad_store.labels() == ["W of stage 0, microbatch 0", "unclaimed"]
    fc.backward_dw()  # the oldest: the claimed one
    with pytest.raises(DeferredWgradError, match="'W of stage 0, microbatch 0' is not queued"):
        fc.wgrad_store.run(work)
    fc.backward_dw()
    assert fc.pending_backward_dw == 0
