"""Property test: training steps interleaved with everything that writes weights or probes a model, against
an oracle that reads the weights afresh every step ([Note: weight lifecycle] in ``distwgrad/weights/lifecycle.py``).

Legend: D the input width, H the hidden width (rows of ``fc1``), both drawn around the world size so shards
come out uneven and empty.

A *case* (``_cases``, drawn by hypothesis with a fixed seed; one spawn per world size runs them all, as in
``tests/test_properties.py``): 2 or 3 gloo ranks; a model of two blocks ``fc1 -> * g -> relu -> fc2`` on
``ShardedWeight``s (``fc1`` deferred or not; fresh biases beside them; ``g`` a plain fp32 parameter) and a head
tied to block 0's ``fc1``; coalesced units or not; fp32, or bf16 compute on fp32 masters; no FP8, per-tensor or
blockwise FP8; 1-2 microbatches, each with one loss or two (the second backward through the retained
graph); one of five optimizers (fused, foreach and for-loop AdamW, SGD with momentum, fused SGD); between
finalize and the optimizer step a probe (an eval forward, an early exit through block 0 only, a forward with
grad whose graph is dropped); and between steps a write the runtime may not see (``.data``, ``copy_`` under
``no_grad``, ``load_state_dict``).

The oracle, every step, on every rank: the model's weights as they are now (gathered), every rank's
microbatches in one process with the same split and the same backwards, gradients averaged over the ranks.
Without FP8 it is plain torch (``F.linear`` on the fp32 masters, cast to bf16 per use inside autograd);
under FP8 it is a fresh unsharded distwgrad model built from those weights, which has no cache to go stale
(the sharded gather quantizes bit-identically to the full weight: [Note: fp8 distributed weights]). Then the
oracle's own optimizer (the same class, its state carried across steps) steps from the same weights.

Checks, every step: each rank's loss; every gradient after finalize (gathered); the plain parameters and
their gradients identical on every rank; the weights after the optimizer step. Tolerance: the same products
summed in another order (per-rank GEMMs and an fp32 average against autograd's accumulation, gloo's order at
3 ranks): ``_RTOL`` of the tensor's largest entry; the optimizer step adds one AdamW update's worth of that
(``lr * _RTOL`` per unit of normalized gradient, bounded by ``_STEP_ATOL``). The bugs this catches move
gradients by 1e-3 (stale FP8 scales) to 1.0 (a doubled contribution) of their scale, and replicas apart
exactly. ``pytest --full`` raises the counts (``_COUNTS``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

import distwgrad
from distwgrad import ShardedWeight
from distwgrad.fp8 import BlockwiseScaling, PerTensorScaling, fp8_autocast
from distwgrad.nn import Linear
from distwgrad.testing import sweep
from distwgrad.testing.multiprocess import for_each_case, run_distributed

STEPS = 3
LR = 0.05
_RTOL = 1e-4
_STEP_ATOL = 1e-4
_COUNTS = {2: (8, 120), 3: (5, 80)}  # examples per world size: (CI, --full)
_OPTIMIZERS = {
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=LR, fused=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=LR, foreach=True),
    "adamw_loop": lambda ps: torch.optim.AdamW(ps, lr=LR, foreach=False),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9),
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=LR, fused=True),
}
_RECIPES = {"none": None, "per_tensor": PerTensorScaling(), "blockwise": BlockwiseScaling()}


def _count(world: int) -> int:
    return _COUNTS[world][1 if sweep.full() else 0]


@st.composite
def _cases(draw, world):
    return dict(
        world=world, D=draw(st.integers(1, world + 2)), H=draw(st.integers(1, world + 2)),
        delay=draw(st.booleans()), head_delay=draw(st.booleans()), coalesce=draw(st.booleans()),
        dtype=draw(st.sampled_from(["fp32", "bf16"])), recipe=draw(st.sampled_from(sorted(_RECIPES))),
        mbs=draw(st.integers(1, 2)), two_losses=draw(st.booleans()),
        optimizer=draw(st.sampled_from(sorted(_OPTIMIZERS))),
        probes=draw(st.lists(st.sampled_from(["none", "eval", "early", "dropped"]), min_size=STEPS, max_size=STEPS)),
        writes=draw(st.lists(st.sampled_from(["none", "data", "copy", "load_state_dict"]), min_size=STEPS,
                             max_size=STEPS)),
        seed=draw(st.integers(0, 2**16)))


# --- the model ---------------------------------------------------------------------------------------------

class _Block(nn.Module):
    def __init__(self, fc1: nn.Module, fc2: nn.Module, g: torch.Tensor) -> None:
        super().__init__()
        self.fc1, self.fc2, self.g = fc1, fc2, nn.Parameter(g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x) * self.g.to(x.dtype)))


class _Model(nn.Module):
    def __init__(self, blocks: list[_Block], head: nn.Module) -> None:
        super().__init__()
        self.blocks, self.head = nn.ModuleList(blocks), head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _full_init(case) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(case["seed"])
    D, H = case["D"], case["H"]
    out = {}
    for i in range(2):
        out |= {f"blocks.{i}.fc1.weight": torch.randn(H, D, generator=gen) / 2,
                f"blocks.{i}.fc1.bias": torch.randn(H, generator=gen) / 4,
                f"blocks.{i}.g": 1 + torch.randn(H, generator=gen) / 4,
                f"blocks.{i}.fc2.weight": torch.randn(D, H, generator=gen) / 2,
                f"blocks.{i}.fc2.bias": torch.randn(D, generator=gen) / 4}
    return out


def _distwgrad_model(case, full: dict[str, torch.Tensor], group) -> _Model:
    """distwgrad's build over ``group``: sharded weights, fresh biases beside them (set to ``full``'s)."""
    pd = torch.bfloat16 if case["dtype"] == "bf16" else None
    D, H = case["D"], case["H"]
    blocks = []
    for i in range(2):
        w1 = ShardedWeight.from_full(full[f"blocks.{i}.fc1.weight"], group=group, param_dtype=pd)
        w2 = ShardedWeight.from_full(full[f"blocks.{i}.fc2.weight"], group=group, param_dtype=pd)
        fc1 = Linear(D, H, weight=w1, delay_wgrad_compute=case["delay"])
        fc2 = Linear(H, D, weight=w2)
        with torch.no_grad():
            fc1.bias.copy_(full[f"blocks.{i}.fc1.bias"])
            fc2.bias.copy_(full[f"blocks.{i}.fc2.bias"])
        blocks.append(_Block(fc1, fc2, full[f"blocks.{i}.g"].clone()))
    head = Linear(D, H, bias=False, weight=blocks[0].fc1.weight, delay_wgrad_compute=case["head_delay"])
    return _Model(blocks, head)


class _TorchLinear(nn.Module):
    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight, self.bias, self.dtype = weight, bias, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # each use casts on its own, so autograd hands the fp32 master each contribution separately
        return F.linear(x, self.weight.to(self.dtype), self.bias)


def _torch_model(case, full: dict[str, torch.Tensor]) -> _Model:
    dtype = torch.bfloat16 if case["dtype"] == "bf16" else torch.float32
    p = {k: nn.Parameter(v.clone()) for k, v in full.items()}
    for k in p:
        if k.endswith("bias"):  # a fresh bias next to a weight computes in the weight's compute dtype
            p[k] = nn.Parameter(full[k].to(dtype))
    blocks = [_Block(_TorchLinear(p[f"blocks.{i}.fc1.weight"], p[f"blocks.{i}.fc1.bias"], dtype),
                     _TorchLinear(p[f"blocks.{i}.fc2.weight"], p[f"blocks.{i}.fc2.bias"], dtype),
                     full[f"blocks.{i}.g"].clone()) for i in range(2)]
    return _Model(blocks, _TorchLinear(p["blocks.0.fc1.weight"], None, dtype))


# --- one step -----------------------------------------------------------------------------------------------

def _inputs(case, step: int, rank: int) -> list[torch.Tensor]:
    dtype = torch.bfloat16 if case["dtype"] == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(case["seed"] * 1000 + step * 10 + rank)
    return [torch.randn(3, case["D"], generator=gen).to(dtype) for _ in range(case["mbs"])]


def _backward(case, model: nn.Module, xs: list[torch.Tensor]) -> float:
    """Forward and backward of each microbatch (two backwards through a retained graph if asked), deferred
    wgrads drained; the summed loss."""
    total = 0.0
    with fp8_autocast(_RECIPES[case["recipe"]], enabled=case["recipe"] != "none"):
        for x in xs:
            out = model(x).float()
            loss = out.square().mean()
            if case["two_losses"]:
                loss.backward(retain_graph=True)
                (1e-2 * out.sum()).backward()
            else:
                loss.backward()
            distwgrad.drain_deferred_wgrads(model)
            total += float(loss.detach())
    return total


def _full_of(p: torch.Tensor) -> torch.Tensor:
    return p.gather_rows(p.detach().clone()) if isinstance(p, ShardedWeight) else p.detach().clone()


def _full_grad(p: torch.Tensor) -> torch.Tensor:
    g = torch.zeros(p.shape, dtype=torch.float32) if p.grad is None else p.grad.detach().float()
    return p.gather_rows(g.clone()) if isinstance(p, ShardedWeight) else g


def _close(got: torch.Tensor, want: torch.Tensor, what: str, atol: float = 0.0, dtype: torch.dtype = torch.float32
           ) -> None:
    """``got`` (held in ``dtype``) against ``want`` rounded to ``dtype``: within ``_RTOL`` of the largest entry, or
    one ``dtype`` ulp of it for a bf16 plain parameter (its rank's fp32 average is rounded to bf16 once, and an
    fp32 sum in another order may round the other way)."""
    want = want.to(dtype).float()
    got = got.float()
    rtol = max(_RTOL, 2.0 * torch.finfo(dtype).eps) if dtype != torch.float32 else _RTOL
    scale = float(want.abs().max()) if want.numel() else 0.0
    err = float((got - want).abs().max()) if want.numel() else 0.0
    assert err <= rtol * scale + atol, f"{what}: max error {err:.3g} against scale {scale:.3g}"


def _oracle_grads(case, full: dict[str, torch.Tensor], xs_all: list[list[torch.Tensor]], solo) \
        -> tuple[list[float], dict[str, torch.Tensor]]:
    """Every rank's losses and the rank-averaged gradients of a model built afresh from ``full``: each rank's
    gradients on their own (a bf16 plain parameter accumulates its rank's in bf16, as the rank does), then
    summed in fp32 in rank order and averaged, as the reductions do."""
    model = _torch_model(case, full) if case["recipe"] == "none" else _distwgrad_model(case, full, solo)
    losses, total = [], {n: torch.zeros(p.shape) for n, p in model.named_parameters()}
    for xs in xs_all:
        losses.append(_backward(case, model, xs))
        if case["recipe"] != "none":
            distwgrad.finalize_model_grads(model)
        for n, p in model.named_parameters():
            if p.grad is not None:
                total[n] += p.grad.float()
        model.zero_grad(set_to_none=True)
    return losses, {n: t / len(xs_all) for n, t in total.items()}


def _probe(case, model: _Model, kind: str, x: torch.Tensor) -> None:
    with fp8_autocast(_RECIPES[case["recipe"]], enabled=case["recipe"] != "none"):
        if kind == "eval":
            with torch.no_grad():
                model(x)
        elif kind == "early":
            with torch.no_grad():
                model.blocks[0](x)
        elif kind == "dropped":
            model(x)  # a forward with grad whose graph is dropped: its uses are withdrawn


def _write(model: _Model, kind: str) -> None:
    if kind == "data":
        for p in model.parameters():
            p.data.mul_(0.75)
    elif kind == "copy":
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p * 0.75)
    elif kind == "load_state_dict":
        model.load_state_dict({k: v * 0.75 for k, v in model.state_dict().items()})


def _check_case(case, rank: int, world: int) -> bool:
    solo = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
    full = _full_init(case)
    model = _distwgrad_model(case, full, None)
    if case["coalesce"]:
        distwgrad.coalesce(model)
    opt = _OPTIMIZERS[case["optimizer"]](model.parameters())
    names = [n for n, _ in model.named_parameters()]
    oracle = {n: nn.Parameter(_full_of(p)) for n, p in model.named_parameters()}
    oracle_opt = _OPTIMIZERS[case["optimizer"]](list(oracle.values()))
    for step in range(STEPS):
        now = {n: _full_of(p) for n, p in model.named_parameters()}
        xs_all = [_inputs(case, step, r) for r in range(world)]
        loss = _backward(case, model, xs_all[rank])
        distwgrad.finalize_model_grads(model)
        want_losses, want = _oracle_grads(case, {**full, **{n: now[n].float() for n in now}}, xs_all, solo[rank])
        assert abs(loss - want_losses[rank]) <= _RTOL * abs(want_losses[rank]) + 1e-6, \
            f"step {step}: loss {loss} against the oracle's {want_losses[rank]}"
        for n, p in model.named_parameters():
            _close(_full_grad(p), want[n], f"step {step}: gradient of {n}", dtype=p.dtype)
            if not isinstance(p, ShardedWeight):
                mine = torch.stack([p.detach().float().reshape(-1), _full_grad(p).reshape(-1)])
                every = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(every, mine)
                assert all(torch.equal(e, mine) for e in every), f"step {step}: {n} differs across ranks"
        _probe(case, model, case["probes"][step], xs_all[rank][0])
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # the oracle steps from the same weights with its own gradients
            for n in names:
                oracle[n].copy_(now[n].float())
                oracle[n].grad = want[n].to(oracle[n].dtype)
        oracle_opt.step()
        for n, p in model.named_parameters():
            _close(_full_of(p), oracle[n].detach(), f"step {step}: {n} after {case['optimizer']}",
                   atol=_STEP_ATOL, dtype=p.dtype)
        _write(model, case["writes"][step])
    return True


# --- the tests -------------------------------------------------------------------------------------------

_SETTINGS = dict(derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def _draw(world: int) -> list[dict]:
    drawn: list[dict] = []

    @settings(max_examples=_count(world), phases=[Phase.generate], **_SETTINGS)
    @given(case=_cases(world))
    def collect(case):
        drawn.append(copy.deepcopy(case))
    collect()
    return drawn


def _rank(rank, world, cases):
    return for_each_case(cases, _check_case, rank, world)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_updates_and_probes_never_leave_a_stale_weight(world):
    cases = _draw(world)
    assert len(cases) == _count(world)
    assert all(all(r) for r in run_distributed(_rank, world, cases, timeout=600))
