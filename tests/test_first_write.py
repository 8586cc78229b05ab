"""[Note: an unwritten accumulator] (``distwgrad/weights/first_write.py``): a flagged output written, not added
into, by every wgrad kernel; the steps of a graphed weight that flag ``main_grad`` instead of zeroing it.

The kernels' contract is checked against themselves, bit for bit, on NaN-poisoned outputs: with the flag set a
launch leaves exactly what the same launch adds into zeros (an empty group's slot zeros), with the flag clear
exactly what it adds into the old values without a flag. CPU: the Triton kernels under ``TRITON_INTERPRET=1`` in
a child process (this file is its script: ``python tests/test_first_write.py CASE``); the GPU tests run the same
checks on the Gluon kernels and the graphed modules (``@pytest.mark.gpu``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import sys

import pytest
import torch
from test_cuda_graphs import nccl_world  # noqa: F401  (a fixture)
from test_graphs import _x, modelled_cuda  # noqa: F401  (a fixture)
from torch import nn

import distwgrad
from distwgrad.nn import GroupedLinear, Linear
from distwgrad.testing import sweep
from distwgrad.testing.interpreter import run_interpreted
from distwgrad.weights import first_write

_HERE = os.path.abspath(__file__)
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_SPLITS = [5, 0, 20, 7]  # tokens per group: one group empty


def _check_flag(launch, shape, device, tag: str, gen: torch.Generator) -> None:
    """``launch(out, first)`` adds one product into ``out`` (``first`` None: no flag) and returns it; stacked
    ``[E, N, K]`` or, when ``launch`` takes a list, per-group views. Flag set: a NaN-poisoned ``out`` ends as
    the product added into zeros; flag clear: an ``out`` of old values ends as the unflagged launch leaves it."""
    old = torch.randn(*shape, generator=gen).to(device)
    into_zeros = launch(torch.zeros(shape, device=device), None)
    plain = launch(old.clone(), None)
    flag = first_write.new_flag(device)
    flag.fill_(1)
    got = launch(torch.full(shape, float("nan"), device=device), flag)
    assert not got.isnan().any(), f"{tag}: a flagged output kept its old (NaN) values somewhere"
    assert torch.equal(got, into_zeros), f"{tag}: flagged: differs from the product added into zeros"
    assert int(flag.item()) == 1, f"{tag}: the kernel must leave the flag to its caller"
    flag.zero_()
    got = launch(old.clone(), flag)
    assert torch.equal(got, plain), f"{tag}: flag clear: differs from the unflagged accumulation"


def _as_list(launch_list):
    """A launch into E separate strided buffers (the pointer-table path) as a launch into a stacked tensor."""
    def launch(out, first):
        bufs = [torch.empty(out.shape[1], out.shape[2] + 3, device=out.device)[:, :out.shape[2]]
                for _ in range(out.shape[0])]
        for b, o in zip(bufs, out):
            b.copy_(o)
        launch_list(bufs, first)
        return torch.stack(bufs)
    return launch


def _bf16_problem(dtype, device, gen, T=32, K=48, N=40):
    dy = torch.randn(T, N, generator=gen).to(device, dtype)
    x = torch.randn(T, K, generator=gen).to(device, dtype)
    offs = torch.tensor(_SPLITS).cumsum(0).to(device, torch.int32)
    return dy, x, offs, (len(_SPLITS), N, K)


def _fp8_problem(recipe: str, device):
    from grouped_gemm_fp8_cases import _problem
    T = sum(_SPLITS) * 4
    return _problem(T, len(_SPLITS), 160, 144, recipe, seed=3, splits=[4 * s for s in _SPLITS], device=device)


# ---- interpreter cases (run in the child process) -------------------------------------------------


def _triton_launches(dy, x, offs, cfg):
    """(stacked, list) launches of the Triton wgrad kernel in config ``cfg``."""
    from distwgrad.kernels import grouped_gemm as k
    return (lambda out, first: k._wgrad(dy, x, offs, out, config=cfg, first=first),
            _as_list(lambda bufs, first: k._wgrad(dy, x, offs, bufs, config=cfg, first=first)))


def _fp8_launch(k, pb, cfg=None, gluon=None):
    """A launch of the FP8 wgrad (``k``: its launchers) on problem ``pb``."""
    raw = (pb.dy_qt.data, pb.dy_qt.scale_inv, pb.x_qt.data, pb.x_qt.scale_inv, pb.offs)
    return lambda out, first: k._wgrad(*raw, pb.block, out, config=cfg, first=first, gluon=gluon,
                                       split_accumulator=pb.split["wgrad"])


def _case_triton_wgrad():
    """The Triton wgrad kernel, each add mode the interpreter runs, stacked and list outputs, fp16 and fp32 (a
    fixed sample of four of the eight launches in CI, every one with ``--full``), and the public entry."""
    from distwgrad.kernels import grouped_gemm as k
    from distwgrad.kernels._grouped_gemm_configs import INTERPRETER
    gen = torch.Generator().manual_seed(0)
    problems = {dtype: _bf16_problem(dtype, "cpu", gen) for dtype in (torch.float16, torch.float32)}
    cases = [(d, m, listed) for d in problems for m in ("load", "atomic") for listed in (False, True)]
    for dtype, mode, listed in sweep.sample(cases, 4):
        dy, x, offs, shape = problems[dtype]
        launches = _triton_launches(dy, x, offs, dataclasses.replace(INTERPRETER, add_mode=mode))
        _check_flag(launches[listed], shape, "cpu", f"triton {dtype} {mode}{' list' if listed else ''}", gen)
    for dtype, (dy, x, offs, shape) in problems.items():
        _check_flag(functools.partial(_public, k, dy, x, offs), shape, "cpu", f"public {dtype}", gen)


def _public(k, dy, x, offs, out, first):
    return k.grouped_wgrad(dy, x, offs, out=out, first=first)


def _case_fp8_wgrad():
    """The Triton FP8 wgrad kernel: per-tensor and blockwise, load and atomic, stacked and list outputs (a
    fixed sample of three of the eight in CI, the first and the last among them: both recipes, both modes,
    both layouts; every one with ``--full``)."""
    from grouped_gemm_fp8_cases import _cfg, _kernels
    gen = torch.Generator().manual_seed(1)
    problems = {recipe: _fp8_problem(recipe, "cpu") for recipe in ("per_tensor", "blockwise")}
    cases = [(r, m, listed) for r in problems for m in ("load", "atomic") for listed in (False, True)]
    for recipe, mode, listed in sweep.sample(cases, 3):
        pb = problems[recipe]
        run = _fp8_launch(_kernels(), pb, _cfg(add_mode=mode))
        _check_flag(_as_list(run) if listed else run, (pb.E, pb.N, pb.K), "cpu",
                    f"fp8 {recipe} {mode}{' list' if listed else ''}", gen)


def _case_flagged_zero():
    """``zero_if_flagged``: zeros every element (a length off the block) iff the flag is set."""
    from distwgrad.kernels.flagged_zero import zero_if_flagged
    out = torch.randn(8192 * 2 + 5)
    old, flag = out.clone(), first_write.new_flag("cpu")
    assert torch.equal(zero_if_flagged(out, flag), old), "flag clear: nothing may change"
    flag.fill_(1)
    assert not zero_if_flagged(out, flag).any(), "flag set: every element zero"
    with pytest.raises(ValueError, match=r"out must be a contiguous float32 tensor, got torch.float32 with strides"):
        zero_if_flagged(torch.zeros(4, 4).t(), flag)
    with pytest.raises(ValueError, match=r"first must be one int32 on cpu, got torch.int64"):
        zero_if_flagged(torch.zeros(4), torch.ones(1, dtype=torch.int64))


_INTERPRETER_CASES = {"triton_wgrad": _case_triton_wgrad, "fp8_wgrad": _case_fp8_wgrad,
                      "flagged_zero": _case_flagged_zero}


@pytest.mark.interpret
@pytest.mark.parametrize("case", sorted(_INTERPRETER_CASES))
def test_interpreter(case):
    pytest.importorskip("triton")
    run_interpreted(_HERE, case, timeout=300)


# ---- in-process, no kernels: the reference routes, the checks, the weights' steps -------------------


def test_reference_routes_zero_where_flagged():
    """Without the kernels (CPU tensors) ``first=`` zeroes the output where the flag is set, then adds: the
    same values as the product added into zeros; clear, the plain accumulation."""
    from distwgrad.ops import grouped_gemm as gg
    gen = torch.Generator().manual_seed(2)
    dy, x, offs, shape = _bf16_problem(torch.float32, "cpu", gen)
    _check_flag(lambda out, first: gg.grouped_wgrad(dy, x, offs, out=out, first=first), shape, "cpu", "reference",
                gen)
    _check_flag(_as_list(lambda bufs, first: gg.grouped_wgrad(dy, x, offs, out=bufs, first=first)), shape, "cpu",
                "reference list", gen)


def test_first_is_checked_by_name():
    pytest.importorskip("triton")
    from distwgrad.kernels import grouped_gemm as k

    from distwgrad.ops import grouped_gemm as gg
    dy, x, offs = torch.randn(8, 24), torch.randn(8, 16), torch.tensor([3, 8], dtype=torch.int32)
    out = torch.zeros(2, 24, 16)
    with pytest.raises(TypeError, match=r"first must be an int32 tensor of one element \(the flag\), got "
                                        r"torch.int64 of shape \(1,\)"):
        k.grouped_wgrad(dy, x, offs, out=out, first=torch.ones(1, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"got torch.int32 of shape \(2,\)"):
        k.grouped_wgrad(dy, x, offs, out=out, first=torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"a fresh output \(out=None\) takes none"):
        k.grouped_wgrad(dy, x, offs, first=first_write.new_flag("cpu"))
    with pytest.raises(ValueError, match=r"first= flags an output to add into; pass out as well"):
        gg.grouped_wgrad(dy, x, offs, first=first_write.new_flag("cpu"))


class _Two(nn.Module):
    """A packed GroupedLinear and a Linear on one-rank ShardedWeights (they accumulate in place)."""

    def __init__(self, seed: int, dtype=torch.float32) -> None:
        super().__init__()
        torch.manual_seed(seed)
        E, K = len(_SPLITS), 16
        self.experts = GroupedLinear(E, K, K, bias=False, single_grouped_weight=True, delay_wgrad_compute=True,
                                     device="meta")
        self.experts.weight = distwgrad.ShardedWeight.from_full(torch.randn(E, K, K) / 4, param_dtype=dtype)
        self.out = Linear(K, K, bias=False, weight=distwgrad.ShardedWeight.from_full(torch.randn(K, K) / 4,
                                                                                      param_dtype=dtype),
                          delay_wgrad_compute=True)

    def forward(self, x, splits):
        return self.out(self.experts(x, splits))


def _train_step(model, xs, splits):
    for x in xs:
        model(x, splits).square().sum().backward()
        distwgrad.drain_deferred_wgrads(model)
    distwgrad.finalize_model_grads(model)
    return {n: p.main_grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("microbatches", [1, 3])
def test_flagged_steps_match_zeroed_steps(microbatches):
    """Eager steps of flagged weights (what the graphed callables set up): a step that opens leaves
    ``main_grad`` alone and sets the flag; the experts' wgrad takes the flag (``first=``), the Linear's settles
    (zeros, then its add); poisoned with NaN between steps, every ``main_grad`` equals the unflagged model's,
    bit for bit, and the flags are clear after each contribution."""
    flagged, plain = _Two(0), _Two(0)
    splits = torch.tensor(_SPLITS)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        xs = [torch.randn(sum(_SPLITS), 16, generator=gen) for _ in range(microbatches)]
        want = _train_step(plain, xs, splits)
        if step == 0:
            flagged_step = _train_step(flagged, xs, splits)  # the weights' own main_grad, kept from here on
            for p in flagged.parameters():
                p.keep_main_grad()
                p._life.use_first_flag(p)
        else:
            for p in flagged.parameters():
                p.main_grad.fill_(float("nan"))  # what a step must never read: the last step's values
            flagged(xs[0][:0], torch.zeros_like(splits))  # a use with no tokens opens the step: flags, no zeroing
            for p in flagged.parameters():
                assert p._life.armed and int(p._life.first_flag.item()) == 1 and p.main_grad.isnan().all()
            flagged_step = _train_step(flagged, xs, splits)
        for name in want:
            assert torch.equal(flagged_step[name], want[name]), f"step {step}: {name}"
        for p in flagged.parameters():
            assert not p._life.armed and int(p._life.first_flag.item()) == 0
        flagged.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)


def test_a_step_with_nothing_delivered_leaves_zeros():
    """A flagged weight whose step opens and ends with no contribution: ``main_grad`` reads as zeros after
    finalize (as a zeroed one did), and after a discarded step too."""
    w = distwgrad.ShardedWeight.from_full(torch.randn(4, 4))
    m = Linear(4, 4, bias=False, weight=w, delay_wgrad_compute=True)
    m(torch.randn(2, 4)).sum().backward()
    distwgrad.drain_deferred_wgrads(m)
    distwgrad.finalize_model_grads(m)
    w.keep_main_grad()
    w._life.use_first_flag(w)
    for end in ("finish", "discard"):
        w.main_grad.fill_(3.0)
        w.expect_contribution(0)
        assert w._life.armed and bool((w.main_grad == 3.0).all())
        w.finish_step() if end == "finish" else w.discard_step()
        assert not w._life.armed and not w.main_grad.any(), end
        assert int(w._life.first_flag.item()) == 0


def test_graphing_flags_and_reset_unflags(modelled_cuda):  # noqa: F811
    """``make_graphed_callables`` gives a weight that accumulates in place its flag (refcounted over the sets
    that graph it) and ``reset()`` drops it; a weight reducing over ranks keeps zeroing its graph buffer."""
    w = distwgrad.ShardedWeight.from_full(torch.randn(8, 8))
    m = Linear(8, 8, bias=False, weight=w, delay_wgrad_compute=True)
    x = _x(4, 8)
    g1 = distwgrad.make_graphed_callables(m, (x,))
    flag = w._life.first_flag
    assert flag is not None and w._life.flag_users == 1 and int(flag.item()) == 0 and not w._life.armed
    g1(x).sum().backward()
    assert w._life.armed and w.pending_contributions == 1, "the replayed forward opened the step: flagged"
    m.backward_dw()
    assert not w._life.armed, "the replayed deferred wgrad was the step's first contribution"
    distwgrad.finalize_model_grads(m)
    other = copy.copy(m)  # a second set of graphs over the same weight
    g2 = distwgrad.make_graphed_callables(other, (x,))
    assert w._life.first_flag is flag and w._life.flag_users == 2
    g1.reset()
    assert w._life.first_flag is flag, "the other set's graphs still read it"
    g2.reset()
    assert w._life.first_flag is None and w._life.flag_users == 0


# ---- GPU ------------------------------------------------------------------------------------------

_gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("path", ["default", "triton", "triton/tma_add", "triton/load/l2pf"])
@pytest.mark.parametrize("gpu", [pytest.param(None, marks=_gpu)])
def test_gpu_bf16_wgrad(path, gpu):
    from distwgrad.kernels import grouped_gemm as k
    from distwgrad.kernels._grouped_gemm_configs import TileConfig
    gen = torch.Generator().manual_seed(4)
    dy, x, offs, shape = _bf16_problem(torch.bfloat16, "cuda", gen, T=640, K=256, N=384)
    kind, *opts = path.split("/")
    cfg = None if kind == "default" else TileConfig(128, 128, 32, num_warps=4, num_stages=4,
                                                    add_mode=opts[0] if opts else "atomic", l2_prefetch="l2pf" in opts)

    def run(out, first):
        return k._wgrad(dy, x, offs, out, config=cfg, first=first)
    _check_flag(run, shape, "cuda", path, gen)


@pytest.mark.parametrize("recipe", ["per_tensor", "blockwise"])
@pytest.mark.parametrize("gpu", [pytest.param(None, marks=_gpu)])
def test_gpu_fp8_wgrad(recipe, gpu):
    """The Gluon FP8 wgrad (per-tensor) and the Triton one (blockwise; per-tensor too, forced), stacked and list."""
    from grouped_gemm_fp8_cases import _kernels
    pb = _fp8_problem(recipe, "cuda")
    gen = torch.Generator().manual_seed(5)
    for gluon in ((True, False) if recipe == "per_tensor" else (False,)):
        run = _fp8_launch(_kernels(), pb, gluon=gluon)
        _check_flag(run, (pb.E, pb.N, pb.K), "cuda", f"{recipe} gluon={gluon}", gen)
        _check_flag(_as_list(run), (pb.E, pb.N, pb.K), "cuda", f"{recipe} gluon={gluon} list", gen)


@pytest.mark.parametrize("gpu", [pytest.param(None, marks=_gpu)])
def test_gpu_flagged_zero_in_a_graph(gpu):
    """One captured ``zero_where_flagged``: each replay zeroes or keeps as the flag says at that replay."""
    out, flag = torch.randn(3 * 8192 + 7, device="cuda"), first_write.new_flag("cuda")
    first_write.zero_where_flagged(out, flag)  # builds the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        first_write.zero_where_flagged(out, flag)
    old = out.clone()
    graph.replay()
    assert torch.equal(out, old)
    flag.fill_(1)
    graph.replay()
    assert not out.any()


@pytest.mark.parametrize("recipe", [None, "per_tensor", "blockwise"])
@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("gpu", [pytest.param(None, marks=_gpu)])
def test_gpu_graphed_steps_write_first(nccl_world, recipe, microbatches, gpu):  # noqa: F811
    """Graphed packed experts (the Gluon wgrad: 512 tokens per group on average) and a Linear on one-rank
    ShardedWeights (bf16 compute on fp32 masters), against the same model eager with its weights flagged as
    the graphs flag them (so the same kernels run in the same order; ``test_flagged_steps_match_zeroed_steps``
    and the kernel tests pin flagged against zeroed): two steps, ``main_grad`` poisoned with NaN before each,
    equal bit for bit (a replay that added into the stale values would carry the NaN); one expert has no
    tokens."""
    from distwgrad.fp8 import BlockwiseScaling, PerTensorScaling, fp8_autocast
    rec = {None: None, "per_tensor": PerTensorScaling(), "blockwise": BlockwiseScaling()}[recipe]

    def build():
        torch.manual_seed(0)
        E, K = len(_SPLITS), 256
        experts = GroupedLinear(E, K, K, bias=False, single_grouped_weight=True, delay_wgrad_compute=True,
                                device="meta")
        experts.weight = distwgrad.ShardedWeight.from_full(torch.randn(E, K, K, device="cuda") / 16, group=nccl_world,
                                                           param_dtype=torch.bfloat16)
        lin = Linear(K, K, bias=False, delay_wgrad_compute=True, device="cuda",
                     weight=distwgrad.ShardedWeight.from_full(torch.randn(K, K, device="cuda") / 16, group=nccl_world,
                                                              param_dtype=torch.bfloat16))

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.experts, self.lin = experts, lin

            def forward(self, x, splits):
                return self.lin(self.experts(x, splits))
        return M()

    splits = torch.tensor([64 * s for s in _SPLITS], device="cuda")
    T = int(splits.sum())
    eager, graphed = build(), build()
    for p in eager.parameters():
        p.keep_main_grad()
        p._life.use_first_flag(p)
    x0 = torch.randn(T, 256, device="cuda", dtype=torch.bfloat16)
    g = distwgrad.make_graphed_callables(graphed, (x0, splits), fp8_enabled=rec is not None, fp8_recipe=rec)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(2):
        xs = [torch.randn(T, 256, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(microbatches)]
        for p in [*eager.parameters(), *graphed.parameters()]:
            p.main_grad.fill_(float("nan"))
        for m, run in ((eager, eager), (graphed, g)):
            for x in xs:
                with fp8_autocast(rec, enabled=rec is not None and m is eager):
                    run(x, splits).float().square().sum().backward()
                distwgrad.drain_deferred_wgrads(m)
            distwgrad.finalize_model_grads(m)
        for (name, a), b in zip(eager.named_parameters(), graphed.parameters()):
            assert torch.equal(a.main_grad, b.main_grad), f"step {step}: {name}"
        eager.zero_grad(set_to_none=True)
        graphed.zero_grad(set_to_none=True)
    g.reset()


if __name__ == "__main__":  # child process of test_interpreter: TRITON_INTERPRET=1 is set
    assert _INTERPRETED, "run through pytest, or set TRITON_INTERPRET=1"
    sys.path.insert(0, os.path.dirname(_HERE))
    _INTERPRETER_CASES[sys.argv[1]]()
    print(f"interpreter case {sys.argv[1]}: ok")
