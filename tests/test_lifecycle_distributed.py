"""Regressions on gloo ranks: what went silently wrong in ordinary use before the weight lifecycle existed
([Note: weight lifecycle] in ``distwgrad/weights/lifecycle.py``, [Note: plain parameters at finalize] in
``distwgrad/wgrad/plain.py``, [Note: coalesced units] in ``distwgrad/weights/units.py``).

Each case failed before and passes now:
* ``readme``: the README's "Use" loop (default biases): the ranks' biases differed by 2e-3 after one AdamW step.
* ``mlp_layernorm``: a two-layer MLP on ``ShardedWeight``s with default biases and a plain ``nn.LayerNorm``
  drifted from the same MLP in plain torch from the second step.
* ``fp8_*``: after a fused AdamW step or a ``.data`` write, FP8 forwards quantized the new weights with the
  old amax (per tensor) or the old block scales (blockwise, whose ``sync_weight_amax`` did not refresh them).
* ``coalesce_probe_*``: a coalesced model's prefetched copy, left by an eval probe that ran one block between
  finalize and the optimizer step, survived a fused AdamW step (or a ``.data`` write): the next forward
  computed with the old weights.
* ``coalesce_retained``, ``moe_z_loss``: two backwards through one forward (``retain_graph=True``) reduced a
  coalesced weight's first contribution twice (relative error 1.0).

The oracle: plain torch on one process over every rank's batch (fp32, so sums in another order differ by a
few ulps: ``_TOL``), or the uncoalesced twin, which a coalesced model equals bit for bit at two ranks (two-term
sums; [Note: coalesced units]).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import distwgrad
from distwgrad import ShardedWeight
from distwgrad.fp8 import BlockwiseScaling, PerTensorScaling, fp8_autocast
from distwgrad.fp8 import weights as fw
from distwgrad.models import MoEGPT, MoEGPTConfig
from distwgrad.nn import Linear
from distwgrad.testing import sweep
from distwgrad.testing.multiprocess import for_each_case, run_distributed

WORLD = 2
# fp32 sums of the same terms in another order (per-rank GEMMs then an average against one GEMM over the
# whole batch): a few ulps of the largest term, amplified by at most AdamW's lr-sized steps of 5 steps
_TOL = 1e-5


def _gather_full(w: ShardedWeight) -> torch.Tensor:
    return w.gather_rows(w.detach().clone())


def _all_equal_across_ranks(t: torch.Tensor) -> bool:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return all(torch.equal(o, out[0]) for o in out)


def _batches(step: int, rows: int = 8, width: int = 16) -> list[torch.Tensor]:
    return [torch.randn(rows, width, generator=torch.Generator().manual_seed(100 * step + r)) for r in range(WORLD)]


# --- plain parameters --------------------------------------------------------------------------------

def _readme(rank: int) -> None:
    torch.manual_seed(0)
    full = torch.randn(16, 16) / 4
    w = ShardedWeight.from_full(full)
    model = nn.Sequential(Linear(16, 16, weight=w, delay_wgrad_compute=True),
                          Linear(16, 16, weight=w, delay_wgrad_compute=True))
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    with torch.no_grad():
        ref[1].weight = ref[0].weight = nn.Parameter(full.clone())
        ref[0].bias.copy_(model[0].bias)
        ref[1].bias.copy_(model[1].bias)
    opt, ref_opt = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(ref.parameters())
    for step in range(3):
        batches = _batches(step)
        for mb in batches[rank].chunk(2):
            model(mb).square().mean().backward()
            distwgrad.drain_deferred_wgrads(model)
        distwgrad.finalize_model_grads([model])
        opt.step()
        opt.zero_grad()
        sum(ref(mb).square().mean() for b in batches for mb in b.chunk(2)).div(WORLD).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for i in range(2):
            assert _all_equal_across_ranks(model[i].bias.detach()), f"step {step}: bias {i} differs across ranks"
            torch.testing.assert_close(model[i].bias.detach(), ref[i].bias.detach(), rtol=_TOL, atol=_TOL)
        torch.testing.assert_close(_gather_full(w), ref[0].weight.detach(), rtol=_TOL, atol=_TOL)


def _mlp_layernorm(rank: int) -> None:
    torch.manual_seed(0)
    w1, w2 = torch.randn(32, 16) / 4, torch.randn(16, 32) / 4

    def build(sharded: bool) -> nn.Sequential:
        torch.manual_seed(1)
        if sharded:
            fc1 = Linear(16, 32, weight=ShardedWeight.from_full(w1))
            fc2 = Linear(32, 16, weight=ShardedWeight.from_full(w2))
        else:
            fc1, fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
            with torch.no_grad():
                fc1.weight.copy_(w1)
                fc2.weight.copy_(w2)
        return nn.Sequential(fc1, nn.LayerNorm(32), nn.ReLU(), fc2)

    model, ref = build(True), build(False)
    with torch.no_grad():
        for a, b in zip(model.parameters(), ref.parameters()):
            if not isinstance(a, ShardedWeight):
                b.copy_(a)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for step in range(5):
        batches = _batches(step)
        loss = model(batches[rank]).square().mean()
        loss.backward()
        distwgrad.finalize_model_grads(model)
        opt.step()
        opt.zero_grad()
        ref_loss = sum(ref(b).square().mean() for b in batches) / WORLD
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        torch.testing.assert_close(mean_loss / WORLD, ref_loss.detach(), rtol=_TOL, atol=_TOL)
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            got = _gather_full(a) if isinstance(a, ShardedWeight) else a.detach()
            if not isinstance(a, ShardedWeight):
                assert _all_equal_across_ranks(got), f"step {step}: {name} differs across ranks"
            torch.testing.assert_close(got, b.detach(), rtol=_TOL, atol=_TOL, msg=f"step {step}: {name}")


# --- FP8 scales --------------------------------------------------------------------------------------

def _fp8(rank: int, recipe_name: str, write: str) -> None:
    recipe = PerTensorScaling() if recipe_name == "per_tensor" else BlockwiseScaling()
    torch.manual_seed(0)
    model = nn.Sequential(Linear(16, 256, bias=False, weight=ShardedWeight.from_full(torch.randn(256, 16) / 4)),
                          Linear(256, 16, bias=False, weight=ShardedWeight.from_full(torch.randn(16, 256) / 4)))
    # lr 1: the amax moves by about the step, across a power of two (a block scale of BlockwiseScaling moves then)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0, fused=True)
    for step in range(3):
        if recipe_name == "blockwise":
            fw.sync_weight_amax(model)  # what the job does every step (it refreshes amaxes only)
        x = _batches(step, width=16)[rank]
        with fp8_autocast(recipe):
            out = model(x)
            for p in model.parameters():  # what this step's forward quantized with, against the weight it read
                got = fw.materialize_quantized(p, recipe, backward=False)
                want = fw.quantize_weight(_gather_full(p), recipe)
                for g, q in zip(got, want):
                    assert torch.equal(g.scale_inv, q.scale_inv), f"step {step}: stale scales"
                    assert torch.equal(g.data.view(torch.uint8), q.data.view(torch.uint8)), f"step {step}"
            out.square().mean().backward()
        distwgrad.finalize_model_grads(model)
        if write == "fused_adamw":
            opt.step()
        else:
            with torch.no_grad():
                for p in model.parameters():
                    p.data.mul_(1.5)
        opt.zero_grad()


# --- coalesced units ---------------------------------------------------------------------------------

class _Block(nn.Module):
    def __init__(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.fc1 = Linear(16, 16, bias=False, weight=ShardedWeight.from_full(w1), delay_wgrad_compute=True)
        self.fc2 = Linear(16, 16, bias=False, weight=ShardedWeight.from_full(w2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class _Blocks(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_Block(torch.randn(16, 16) / 4, torch.randn(16, 16) / 4) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _twins(n: int = 3) -> tuple[_Blocks, _Blocks]:
    plain = _Blocks(n)
    coal = copy.deepcopy(plain)
    distwgrad.coalesce(coal)
    return plain, coal


def _in_flight(model: nn.Module) -> int:
    units = model.blocks[0].fc1.weight._unit.units
    return sum(len(u._prefetched_fwd) + len(u._prefetched_bwd) + len(u._backward) + len(u._forward) for u in units)


def _coalesce_probe(rank: int, write: str) -> None:
    plain, coal = _twins()
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, fused=True) for m in (plain, coal)]
    for step in range(4):
        x = _batches(step)[rank]
        losses = []
        for m in (plain, coal):
            loss = m(x).square().mean()
            loss.backward()
            distwgrad.drain_deferred_wgrads(m)
            distwgrad.finalize_model_grads(m)
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), f"step {step}: coalesced {losses[1]} vs {losses[0]}"
        with torch.no_grad():  # an eval probe that exits early: block 0 only, which prefetches block 1
            coal.blocks[0](x)
        assert _in_flight(coal) == 0, "a forward left a gather in flight"
        for m, opt in zip((plain, coal), opts):
            if write == "fused_adamw":
                opt.step()
            else:
                with torch.no_grad():
                    for p in m.parameters():
                        p.data.mul_(0.5)
            opt.zero_grad()


def _coalesce_retained(rank: int) -> None:
    plain, coal = _twins(n=1)
    x = _batches(0)[rank]
    grads = []
    for m in (plain, coal):
        y = m(x)
        y.square().mean().backward(retain_graph=True)
        y.sum().backward()
        distwgrad.drain_deferred_wgrads(m)
        distwgrad.finalize_model_grads(m)
        grads.append([p.grad.clone() for p in m.parameters()])
    for i, (a, b) in enumerate(zip(*grads)):
        assert torch.equal(a, b), f"parameter {i}: relative error {float((a - b).abs().max() / a.abs().max())}"


def _moe_z_loss(rank: int) -> None:
    config = MoEGPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2, n_experts=4, d_ff=32)
    plain = MoEGPT(config)
    coal = MoEGPT(config)
    distwgrad.coalesce(coal)
    ids = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(rank))
    grads = []
    for m in (plain, coal):
        logits = m(ids[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward(retain_graph=True)
        (1e-3 * logits.logsumexp(-1).square().mean()).backward()  # a z-loss backpropagated on its own
        distwgrad.drain_deferred_wgrads(m)
        distwgrad.finalize_model_grads(m)
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    for name, a in grads[0].items():
        assert torch.equal(a, grads[1][name]), name


_CASES = {
    "readme": _readme, "mlp_layernorm": _mlp_layernorm,
    "fp8_per_tensor_fused_adamw": lambda r: _fp8(r, "per_tensor", "fused_adamw"),
    "fp8_per_tensor_data": lambda r: _fp8(r, "per_tensor", "data"),
    "fp8_blockwise_fused_adamw": lambda r: _fp8(r, "blockwise", "fused_adamw"),
    "fp8_blockwise_data": lambda r: _fp8(r, "blockwise", "data"),
    "coalesce_probe_fused_adamw": lambda r: _coalesce_probe(r, "fused_adamw"),
    "coalesce_probe_data": lambda r: _coalesce_probe(r, "data"),
    "coalesce_retained": _coalesce_retained, "moe_z_loss": _moe_z_loss,
}


def _one(case: str, rank: int) -> None:
    _CASES[case](rank)


def _rank_fn(rank: int, world: int, cases: list[str]) -> None:
    for_each_case(cases, _one, rank)


@pytest.mark.distributed
def test_ordinary_use_stays_exact():
    run_distributed(_rank_fn, WORLD, sorted(_CASES), timeout=240)


# --- exit ----------------------------------------------------------------------------------------------

_EXIT_SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist, distwgrad
    from torch import nn
    from distwgrad import ShardedWeight
    from distwgrad.nn import Linear

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Sequential(Linear(256, 256, bias=False,
                                                      weight=ShardedWeight.from_full(torch.randn(256, 256))))
                                 for _ in range(3))
    model.forward = lambda x: model.blocks[2](model.blocks[1](model.blocks[0](x)))
    distwgrad.coalesce(model)
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randn(8, 256)).square().mean().backward()
        distwgrad.finalize_model_grads(model)
        opt.step()
    with torch.no_grad():
        model.blocks[0](torch.randn(8, 256))  # a probe that prefetches block 1 and exits
    dist.destroy_process_group()
    try:
        model.blocks[0][0].weight.group  # held weakly: gone with the group, never a silent group of one
    except RuntimeError as e:
        assert "process group was destroyed" in str(e), e
    print("clean exit")
""")


@pytest.mark.distributed
def test_a_coalesced_run_exits_cleanly(tmp_path):
    """A coalesced run whose last forward prefetched a gather it never used, then ``destroy_process_group()``
    with the model still alive: every process exits 0 (the gather is waited for when that forward returns; the
    weights hold their group weakly and torch's ``_shard`` is imported before the group exists: [Note: process
    groups at exit] in ``distwgrad/weights/_comm.py``; a quarter of such runs aborted before). Two runs in CI,
    20 with ``--full``."""
    script = tmp_path / "exit_probe.py"
    script.write_text(_EXIT_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for run in range(20 if sweep.full() else 2):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               "2", str(script)], capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0 and proc.stdout.count("clean exit") == 2, \
            f"run {run}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        assert "terminate called" not in proc.stderr, proc.stderr[-4000:]
