"""Expert parallelism ([Note: expert-parallel dispatch] in ``distwgrad/parallel/experts.py``) on gloo ranks,
against the single-process model.

Each case trains ``MoEGPT(ep_mesh=...)`` for three AdamW steps, every rank on its own batch, beside the
plain-torch oracle (``MoEGPT(sharded=False)``) on every rank's batch concatenated. Compared at every step:
the mean loss, every weight's gradient after ``finalize_model_grads`` (gathered over the weight's group;
an expert weight against its experts' rows of the oracle's), and every weight after the optimizer step.
The oracle then takes the distributed gradients, so both optimizers step from the same gradient and each
step's comparison starts from equal weights (AdamW is elementwise: a shard updates as its rows of the full
tensor do, bit for bit).

Tolerances. The two sides add the same terms in different groupings: a rank's experts see the tokens of
``ep`` ranks in one GEMM where the oracle sees them in another (the GEMM's blocking over rows differs), and
the reductions sum ``W`` ranks' partial gradients where the oracle sums rows. An fp32 sum of n terms,
regrouped, moves by at most (n - 1) * 2^-24 * S (S the sum of the terms' magnitudes); here n <= W * T *
top_k = 4 * 64 * 2 = 512 rows a weight and S <= 4 max|g| (measured below 3: cross-entropy gradients of
mixed signs), so GRAD_ATOL_REL = 511 * 2^-24 * 4 = 1.2e-4 of the weight's largest gradient entry (5.3e-7
seen); a bug (a missing 1/ep, an expert's rows sent to the wrong rank) moves gradients by O(1) of it. The
loss is a mean of W per-rank means of T = 64 tokens against one mean over the same tokens: the two sums'
roundings bound the difference by (T + W) * 2^-24 * 4.2 = 1.7e-5, LOSS_ATOL = 2e-5 (one ulp, 4.8e-7, seen).
In bf16 both sides round each GEMM's output to bf16 (2^-9 relative) at different groupings: BF16_REL = 5e-2
(7.3e-3 seen; the job's bf16 parity bound, ``launch/parity.py``, is 1e-1), the loss within 2e-2.
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
import torch.distributed as dist
from distwgrad.launch.config import fp8_recipe
from torch.distributed.device_mesh import init_device_mesh

import distwgrad
from distwgrad import ShardedWeight
from distwgrad.checkpoint import full_tensor, load_checkpoint, save_checkpoint
from distwgrad.fp8 import fp8_autocast
from distwgrad.fp8.weights import sync_weight_amax
from distwgrad.models import MoEGPT, MoEGPTConfig
from distwgrad.parallel.experts import ExpertParallel
from distwgrad.testing.multiprocess import for_each_case, run_distributed
from distwgrad.wgrad.scheduler import deferred_modules

pytestmark = pytest.mark.distributed

TINY = dict(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, n_experts=4, top_k=2, d_ff=48)
B, STEPS = 4, 3  # sequences a rank a step
GRAD_ATOL_REL, LOSS_ATOL = 1.2e-4, 2e-5
BF16_REL, BF16_LOSS = 5e-2, 2e-2


def _full(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    return p.gather_rows(local) if isinstance(p, ShardedWeight) else local


def _oracle_rows(name: str, t: torch.Tensor, ep: ExpertParallel) -> torch.Tensor:
    """The oracle's tensor as this rank's weight holds it: an expert weight's rows of this rank's experts."""
    return ep.local_slice(t) if ".moe.fc" in name else t


def _train(case: dict, rank: int, world: int) -> None:
    ep_size = case["ep"]
    dtype = case.get("dtype")
    mesh = init_device_mesh("cpu", (ep_size, world // ep_size), mesh_dim_names=("ep", "dp"))
    cfg = MoEGPTConfig(**TINY, aux_loss_coef=case.get("aux", 0.0))
    model = MoEGPT(cfg, ep_mesh=mesh, param_dtype=dtype)
    oracle = MoEGPT(cfg, sharded=False, param_dtype=dtype)
    ep = model.blocks[0].moe.ep
    ep.overlap_wgrads = case.get("overlap", True)
    params, ref = dict(model.named_parameters()), dict(oracle.named_parameters())
    if case.get("skew"):  # a zero router: every score ties, every token picks the same two experts
        with torch.no_grad():
            for name in params:
                if name.endswith("router.weight"):
                    params[name].zero_()
                    ref[name].zero_()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(oracle.parameters(), lr=1e-2)
    rel, loss_atol = (BF16_REL, BF16_LOSS) if dtype else (GRAD_ATOL_REL, LOSS_ATOL)
    micro = case.get("micro", 1)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, cfg.vocab_size, (world * B, cfg.seq_len + 1), generator=g)
        mine = tokens[rank * B:(rank + 1) * B]
        total = torch.zeros(())
        for mb in mine.chunk(micro):
            loss = model.loss(mb[:, :-1], mb[:, 1:]) / micro
            loss.backward()
            total += loss.detach().float()
            if case.get("drain_each"):
                distwgrad.drain_deferred_wgrads(model, order=case.get("order", "reverse"))
        distwgrad.drain_deferred_wgrads(model, order=case.get("order", "reverse"))
        distwgrad.finalize_model_grads([model])
        dist.all_reduce(total)
        ref_total = torch.zeros(())
        for mb in tokens.view(world, B, -1).chunk(micro, dim=1):  # the same microbatches, every rank's
            # [Note: load balancing]: each rank balances its own microbatch, so with it the oracle's loss is
            # the mean of the ranks' losses; without, the mean over the microbatch in one piece
            pieces = mb.unbind(0) if case.get("aux") else [mb.reshape(-1, mb.shape[-1])]
            for rows in pieces:
                ref_loss = oracle.loss(rows[:, :-1], rows[:, 1:]) / (micro * len(pieces))
                ref_loss.backward()
                ref_total += ref_loss.detach().float()
        assert abs(total.item() / world - ref_total.item()) <= loss_atol, (step, total.item() / world, ref_total)
        for name, p in params.items():
            got = _full(p, p.grad)
            want = _oracle_rows(name, ref[name].grad, ep)
            scale = want.abs().max().item()
            torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=rel * scale,
                                       msg=lambda m, n=name, s=step: f"step {s}: {n}: {m}")
            with torch.no_grad():  # the oracle steps from the distributed gradient
                if ".moe.fc" in name:  # every rank's experts, each row from one rank: the sum is exact
                    full = torch.zeros_like(ref[name].grad)
                    _oracle_rows(name, full, ep).copy_(got)
                    dist.all_reduce(full, group=mesh.get_group("ep"))
                    ref[name].grad.copy_(full)
                else:
                    ref[name].grad.copy_(got)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for name, p in params.items():
            want = _oracle_rows(name, ref[name].detach(), ep)
            assert torch.equal(_full(p, p.detach()), want), f"after step {step}: {name}"


def _fp8(case: dict, rank: int, world: int) -> None:
    """One step under an FP8 recipe, against the same distwgrad model on one rank (a group of one: nothing
    gathered, nothing reduced) on every rank's batch concatenated, under the same recipe and in fp32.

    Blockwise: activations and gradients are quantized in 1 x 128 tiles of a row and weights in 128 x 128
    blocks of one expert, so a row quantizes the same on whichever rank its expert lives: the quantized GEMM
    inputs are the oracle's, and the fp32 bounds of the module docstring apply (9.3e-7 seen). Per-tensor: a
    rank's expert GEMM scales by the amax of the rows and experts it holds, the oracle's by all of them, so
    every element rounds to a different FP8 value (2^-4 relative in E4M3, 2^-3 in E5M2) and no bound below the
    recipe's own error exists. The check is that expert parallelism adds none: every gradient's distance
    from the fp32 model, relative to its largest entry, is at most 1.5 times the largest such distance of the
    single-rank FP8 model (a second draw of roundings of the same size; 0.27 against 0.29 seen). A missing
    1/ep doubles the experts' gradients, a distance of 1.0."""
    ep_size, recipe = case["ep"], fp8_recipe(case["recipe"])
    mesh = init_device_mesh("cpu", (ep_size, world // ep_size), mesh_dim_names=("ep", "dp"))
    alone = [dist.new_group([r]) for r in range(world)][rank]  # every rank makes every group, in order
    cfg = MoEGPTConfig(**TINY)
    tokens = torch.randint(0, cfg.vocab_size, (world * B, cfg.seq_len + 1), generator=torch.Generator().manual_seed(7))
    mine = tokens[rank * B:(rank + 1) * B]
    grads, losses, ep = {}, {}, None
    for key, model, batch, fp8 in (("ep", MoEGPT(cfg, ep_mesh=mesh), mine, True),
                                   ("fp8", MoEGPT(cfg, group=alone), tokens, True),
                                   ("fp32", MoEGPT(cfg, group=alone), tokens, False)):
        sync_weight_amax(model)
        with fp8_autocast(recipe) if fp8 else contextlib.nullcontext():
            loss = model.loss(batch[:, :-1], batch[:, 1:])
            loss.backward()
        distwgrad.drain_deferred_wgrads(model)
        distwgrad.finalize_model_grads([model])
        if key == "ep":
            ep = model.blocks[0].moe.ep
        grads[key] = {n: _full(p, p.grad).float() if key == "ep" else p.grad for n, p in model.named_parameters()}
        losses[key] = loss.detach()
    dist.all_reduce(losses["ep"])

    def distance(a: str, b: str) -> dict[str, float]:
        """Each gradient of ``a`` from ``b``'s (its experts' rows, for the expert-parallel model), relative."""
        rows = (lambda n, t: _oracle_rows(n, t, ep)) if a == "ep" else (lambda n, t: t)
        return {n: ((g - rows(n, grads[b][n])).abs().max() / rows(n, grads[b][n]).abs().max()).item()
                for n, g in grads[a].items()}

    if case["recipe"] == "fp8_blockwise":
        assert abs(losses["ep"].item() / world - losses["fp8"].item()) <= LOSS_ATOL
        worst = distance("ep", "fp8")
        assert max(worst.values()) <= GRAD_ATOL_REL, worst
    else:
        ep_error, fp8_error = distance("ep", "fp32"), distance("fp8", "fp32")
        assert max(ep_error.values()) <= 1.5 * max(fp8_error.values()), (ep_error, fp8_error)


def _overlap(rank: int, world: int) -> None:
    """[Note: the dispatch's backward hides behind the experts' wgrads]: with the overlap, backward leaves no
    expert wgrad queued (they ran while the dispatch's gradient travelled) and the gradients are the bits of
    the same step without it. The all-to-all bytes: per layer, each rank sends the counts (E int64), its A
    rows (dispatch) and the R rows it got back (combine), and in backward the same the other way; summed
    over ranks, R's total is A's, so the ranks' bytes add up to ``world * layers * (8 E + 4 A D 4)``."""
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ep", "dp"))
    cfg = MoEGPTConfig(**TINY)
    tokens = torch.randint(0, cfg.vocab_size, (B, cfg.seq_len + 1), generator=torch.Generator().manual_seed(rank))
    A = B * cfg.seq_len * cfg.top_k
    grads, queued = [], []
    for overlap in (True, False):
        model = MoEGPT(cfg, ep_mesh=mesh)
        ep = model.blocks[0].moe.ep
        ep.overlap_wgrads = overlap
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        queued.append(sum(m.pending_backward_dw for m in deferred_modules(model)))
        distwgrad.drain_deferred_wgrads(model)
        distwgrad.finalize_model_grads([model])
        grads.append({n: p.grad for n, p in model.named_parameters()})
        sent = torch.tensor(ep.bytes_sent)
        dist.all_reduce(sent)
        assert sent.item() == world * cfg.n_layers * (8 * cfg.n_experts + 4 * A * cfg.d_model * 4), sent
        assert ep.exposed_s > 0
    assert queued == [0, 2 * cfg.n_layers], queued  # fc1 and fc2 of each layer, without the overlap
    for name, g in grads[0].items():
        assert torch.equal(g, grads[1][name]), name


def _refusals(rank: int, world: int) -> None:
    """Bad inputs, each one clear error naming the value; every rank raises together where a collective is
    involved."""
    group = dist.group.WORLD
    for n, match in ((3, "n_experts=3 does not divide over ep=2"), (0, "positive int, got 0")):
        with pytest.raises(ValueError, match=match):
            ExpertParallel(n, group)
    with pytest.raises(ValueError, match="group is None"):
        ExpertParallel(4, None)
    ep = ExpertParallel(4, group)
    with pytest.raises(ValueError, match=r"m_splits_E must have shape \(4,\), got \(3,\)"):
        ep.dispatch(torch.zeros(3, 2), torch.ones(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="overlap must be callable or None, got 3"):
        ep.dispatch(torch.zeros(4, 2), torch.ones(4, dtype=torch.int64), overlap=3)
    with pytest.raises(ValueError, match="m_splits_E sums to 4 but x has 3 rows"):
        ep.dispatch(torch.zeros(3, 2), torch.ones(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"4 rows, got shape \(2, 3\)"):
        ep.local_slice(torch.zeros(2, 3))
    pair = dist.new_group([0, 1])  # held weakly ([Note: groups held weakly]): gone with its destruction
    dist.barrier(group=pair)  # both ends connected before either destroys it
    orphan = ExpertParallel(4, pair)
    dist.destroy_process_group(pair)
    del pair
    dist.barrier()
    gc.collect()
    with pytest.raises(RuntimeError, match="ExpertParallel: its ep group was destroyed"):
        orphan.dispatch(torch.zeros(4, 2), torch.ones(4, dtype=torch.int64))
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("ep", "dp"))
    with pytest.raises(ValueError, match="ep_mesh must be a DeviceMesh with dims"):
        MoEGPT(MoEGPTConfig(**TINY), ep_mesh=mesh, sharded=False)
    model = MoEGPT(MoEGPTConfig(**TINY), ep_mesh=mesh)
    expert = model.blocks[0].moe.fc1.weight
    with pytest.raises(ValueError, match="spread_over_experts needs the 2-D \\('ep', 'dp'\\) DeviceMesh"):
        expert.spread_over_experts(init_device_mesh("cpu", (2, 1), mesh_dim_names=("a", "b")))
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(rank))
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    distwgrad.drain_deferred_wgrads(model)
    with pytest.raises(RuntimeError, match="spread_over_experts during an open step"):
        expert.spread_over_experts(mesh)
    with pytest.raises(ValueError, match="num_tokens with expert-parallel weights is not supported"):
        distwgrad.finalize_model_grads([model], num_tokens=32)
    distwgrad.finalize_model_grads([model], discard=True)


def _full_state(model, opt) -> dict[str, torch.Tensor]:
    """Every weight and its AdamW moments as whole tensors (an expert weight: all E experts)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = full_tensor(p.detach(), p)
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{key}"] = full_tensor(opt.state[p][key], p)
    return out


def _checkpoints(rank: int, world: int, root: str) -> None:
    """ep 2 x dp 2 -> ep 1 (dp 4) -> ep 4: each load holds the weights and the optimizer's moments of the
    save, whole tensor for whole tensor ([Note: checkpoint layout] in ``distwgrad/checkpoint.py``)."""
    cfg = MoEGPTConfig(**TINY)

    def build(ep: int):
        mesh = init_device_mesh("cpu", (ep, world // ep), mesh_dim_names=("ep", "dp")) if ep > 1 else None
        model = MoEGPT(cfg, ep_mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = build(2)
    tokens = torch.randint(0, cfg.vocab_size, (B, cfg.seq_len + 1), generator=torch.Generator().manual_seed(rank))
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    distwgrad.drain_deferred_wgrads(model)
    distwgrad.finalize_model_grads([model])
    opt.step()
    want = _full_state(model, opt)
    path = save_checkpoint(root, 1, model, opt)
    for step, ep in ((2, 1), (3, 4)):
        model, opt = build(ep)
        load_checkpoint(path, model, opt)
        got = _full_state(model, opt)
        assert got.keys() == want.keys()
        for key, t in want.items():
            assert torch.equal(got[key], t), f"ep {ep}: {key}"
        path = save_checkpoint(root, step, model, opt)


def _cases(rank, world, cases):
    for_each_case(cases, _train, rank, world)


def _fp8_cases(rank, world, cases):
    for_each_case(cases, _fp8, rank, world)


@pytest.mark.timeout(200)
def test_ep2():
    """ep 2 on 2 ranks: two experts a rank; skewed routing (two experts get every token, the other rank's
    none), two microbatches drained in either order, bf16, the load-balancing loss without the overlap; the
    overlap's bits and bytes; both FP8 recipes."""
    cases = [dict(ep=2), dict(ep=2, skew=True), dict(ep=2, micro=2, drain_each=True, order="forward"),
             dict(ep=2, dtype=torch.bfloat16), dict(ep=2, aux=0.01, overlap=False)]
    run_distributed(_cases, 2, cases, timeout=160)
    run_distributed(_refusals, 2, timeout=60)
    run_distributed(_overlap, 2, timeout=60)
    run_distributed(_fp8_cases, 2, [dict(ep=2, recipe=r) for r in ("fp8_blockwise", "fp8_per_tensor")], timeout=60)


@pytest.mark.timeout(200)
def test_ep4_and_ep2_by_dp2():
    """ep 4 (one expert a rank) and ep 2 x dp 2 (each rank's experts sharded over its dp pair); both FP8
    recipes."""
    cases = [dict(ep=4), dict(ep=2, skew=True), dict(ep=2, micro=2), dict(ep=4, aux=0.01, skew=True)]
    run_distributed(_cases, 4, cases, timeout=160)
    fp8 = [dict(ep=4, recipe="fp8_blockwise"), dict(ep=2, recipe="fp8_per_tensor")]
    run_distributed(_fp8_cases, 4, fp8, timeout=120)


@pytest.mark.timeout(200)
def test_checkpoints_move_between_ep_sizes(tmp_path):
    run_distributed(_checkpoints, 4, str(tmp_path), timeout=160)
