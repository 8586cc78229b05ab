"""FP8 weights kept across microbatches: TransformerEngine's ``is_first_microbatch``.

[Note: fp8 weights kept across microbatches] in ``distwgrad/fp8/weights.py``. A kept copy is the one a fresh
quantization would make, so every comparison with the unkept run is bit-exact (the same operations, in the same
order); the counts are of weight quantizations, which keeping must halve or better and never skip across a step.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import distwgrad
from distwgrad import ShardedWeight
from distwgrad.fp8 import BlockwiseScaling, PerTensorScaling, current_first_microbatch, fp8_autocast, microbatch
from distwgrad.fp8 import weights as fp8_weights
from distwgrad.nn import GroupedLinear, LayerNormMLP, Linear
from distwgrad.testing.multiprocess import run_distributed

RECIPES = [PerTensorScaling(), BlockwiseScaling(act_block=(1, 16), weight_block=(16, 16))]
K, N, T = 32, 48, 24


def _sharded(module: torch.nn.Module, group=None) -> torch.nn.Module:
    """Every matrix of ``module`` as a ShardedWeight (one rank: held whole), with the same values."""
    for name, p in list(module.named_parameters()):
        if p.dim() >= 2:
            setattr(module, name, ShardedWeight.from_full(p.detach().clone(), group=group))
    return module


def _module(kind: str, device: str = "cpu", k: int = K, n: int = N) -> torch.nn.Module:
    torch.manual_seed(0)
    kw = dict(params_dtype=torch.bfloat16, device=device)
    if kind == "linear":
        return Linear(k, n, **kw)
    if kind in ("grouped", "grouped_discrete"):
        return GroupedLinear(3, k, n, single_grouped_weight=kind == "grouped", delay_wgrad_compute=True, **kw)
    return LayerNormMLP(k, n, **kw)


def _kept(w) -> list:
    """The FP8 copies ``w`` keeps for its step."""
    return [v for key, (_, _, v) in w._life.caches.items() if isinstance(key, tuple) and key[0] == "fp8 weight"]


def _call(module, x, first):
    kw = {} if first is None else {"is_first_microbatch": first}
    if isinstance(module, GroupedLinear):
        t = x.shape[0]
        return module(x, [t // 2, 0, t - t // 2], **kw)
    return module(x, **kw)


@pytest.fixture
def quantizations(monkeypatch) -> list[int]:
    """Counts the weights' materializations in FP8 (each one a kept copy did not answer)."""
    count = [0]
    orig = fp8_weights._kept

    def kept(weights, keep, key, make):
        def counted():
            count[0] += 1
            return make()
        return orig(weights, keep, key, counted)
    monkeypatch.setattr(fp8_weights, "_kept", kept)
    return count


def _train(module, recipe, flags, *, steps=2, write_data=False, fused=False, t=T):
    """``steps`` steps of ``len(flags)`` microbatches, microbatch i called with ``flags[i]``; returns every
    output and gradient, in order."""
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2, fused=fused)
    gen = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(steps):
        for first in flags:
            device = next(module.parameters()).device
            k = next(p for p in module.parameters() if p.dim() >= 2).shape[-1]
            x = torch.randn(t, k, generator=gen).to(device, torch.bfloat16).requires_grad_()
            with fp8_autocast(recipe):
                y = _call(module, x, first)
            y.backward(torch.randn(y.shape, generator=gen).to(device, torch.bfloat16))
            module.backward_dw()
            seen += [y.detach(), x.grad]  # dgrad reads the weight in its other layout
        distwgrad.finalize_model_grads([module])
        seen += [p.grad.clone() for p in module.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        if write_data:  # a write no version counter sees, between steps
            with torch.no_grad():
                for p in module.parameters():
                    p.data.mul_(0.5)
    return seen


@pytest.mark.parametrize("recipe", RECIPES, ids=["per_tensor", "blockwise"])
@pytest.mark.parametrize("kind", ["linear", "grouped", "grouped_discrete", "mlp"])
def test_kept_weights_give_the_same_bits_and_quantize_once_a_step(kind, recipe, quantizations):
    fresh = _train(_sharded(_module(kind)), recipe, [None, None, None])
    per_step_fresh = quantizations[0] // 2
    quantizations[0] = 0
    kept = _train(_sharded(_module(kind)), recipe, [True, False, False])
    assert len(kept) == len(fresh)
    for a, b in zip(kept, fresh):
        assert torch.equal(a, b)
    # three microbatches quantize each weight twice each (forward, dgrad); kept, once a layout a step; the
    # MLP's checkpoint-free backward reads its two weights as Linear does
    assert quantizations[0] // 2 == per_step_fresh // 3, (quantizations[0], per_step_fresh)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("recipe", [PerTensorScaling(), BlockwiseScaling()], ids=["per_tensor", "blockwise"])
@pytest.mark.parametrize("kind", ["linear", "grouped", "grouped_discrete", "mlp"])
def test_kept_weights_on_the_kernels(kind, recipe, quantizations):
    """On CUDA, where the weights take the kernels' fast paths (a stacked layout, cuBLASLt's), at shapes the
    128-wide blocks tile: the same bits, and no kept copy is written by a GEMM that reads it."""
    fresh = _train(_sharded(_module(kind, "cuda", 256, 384)), recipe, [None, None, None], fused=True, t=512)
    per_step_fresh = quantizations[0] // 2
    quantizations[0] = 0
    kept = _train(_sharded(_module(kind, "cuda", 256, 384)), recipe, [True, False, False], fused=True, t=512)
    for a, b in zip(kept, fresh):
        assert torch.equal(a, b)
    assert quantizations[0] // 2 == per_step_fresh // 3


@pytest.mark.parametrize("recipe", RECIPES, ids=["per_tensor", "blockwise"])
def test_no_step_reads_a_copy_kept_by_an_earlier_one(recipe, quantizations):
    """``is_first_microbatch=False`` everywhere (a misuse: no microbatch says the weights changed), with a fused
    AdamW and ``.data`` writes between steps, neither of which moves ``_version``: each step still quantizes the
    weights it has, as the unkept run does."""
    fresh = _train(_sharded(_module("linear")), recipe, [None, None], steps=3, write_data=True, fused=True)
    quantizations[0] = 0
    kept = _train(_sharded(_module("linear")), recipe, [False, False], steps=3, write_data=True, fused=True)
    for a, b in zip(kept, fresh):
        assert torch.equal(a, b)
    assert quantizations[0] == 3 * 2  # each step: forward's layout and dgrad's, once each


def test_kept_copies_are_one_byte_an_element_a_layout_and_die_at_finalize():
    lin = _sharded(_module("linear"))
    x = torch.randn(T, K).to(torch.bfloat16).requires_grad_()
    with fp8_autocast(PerTensorScaling()):
        lin(x, is_first_microbatch=True).sum().backward()
    kept = _kept(lin.weight)
    assert len(kept) == 2  # forward's layout and dgrad's
    datas = [q.data for v in kept for q in (v if isinstance(v, list) else [v])]
    assert sum(d.numel() * d.element_size() for d in datas) == 2 * N * K
    refs = [weakref.ref(d) for d in datas]
    del kept, datas
    distwgrad.finalize_model_grads([lin])
    gc.collect()
    assert not _kept(lin.weight)
    assert all(r() is None for r in refs)


def test_several_weights_copy_is_dropped_at_a_boundary_of_any(quantizations):
    """A discrete GroupedLinear's experts share one kept copy, held by the first expert's weight; a step boundary
    of another expert's weight alone (here forced) makes the next call quantize afresh."""
    module = _sharded(_module("grouped_discrete"))
    x = torch.randn(T, K).to(torch.bfloat16)
    with fp8_autocast(RECIPES[0]):
        for first, want in ((True, 1), (False, 1), (False, 2)):
            if want == 2:
                module.weight2._life._boundary()  # weight2 alone finalized, written or loaded
            _call(module, x, first).sum().backward()
            module.backward_dw()
            assert quantizations[0] == want
    distwgrad.finalize_model_grads([module], discard=True)


def test_a_retained_graph_and_two_losses_read_the_kept_copy(quantizations):
    """Two losses on one forward (``retain_graph=True``): each backward's dgrad reads the copy the first kept,
    and the gradients are those of the unkept run."""
    grads = {}
    for first in (None, True):
        lin = _sharded(_module("linear"))
        x = torch.randn(T, K, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).requires_grad_()
        quantizations[0] = 0
        with fp8_autocast(RECIPES[1]):
            y = _call(lin, x, first)
        y.sum().backward(retain_graph=True)
        (y * y).sum().backward()
        assert quantizations[0] == (3 if first is None else 2)  # forward's, and dgrad's once (kept) or twice
        distwgrad.finalize_model_grads([lin])
        grads[first] = [x.grad, lin.weight.grad, lin.bias.grad]
    for a, b in zip(grads[None], grads[True]):
        assert torch.equal(a, b)


def test_what_is_never_kept(quantizations):
    """A plain weight (no step bounds its copy), an eval forward (no step is open), None (the default)."""
    plain = _module("linear")
    x = torch.randn(T, K).to(torch.bfloat16).requires_grad_()
    with fp8_autocast(PerTensorScaling()):
        for first in (True, False):
            plain(x, is_first_microbatch=first).sum().backward()
        assert quantizations[0] == 4  # forward's and dgrad's, each microbatch
        lin = _sharded(_module("linear"))
        with torch.no_grad():
            lin(x, is_first_microbatch=True)
        assert not _kept(lin.weight)
        lin(x).sum().backward()
        assert not _kept(lin.weight)


def test_the_microbatch_context_gives_calls_the_flag(quantizations):
    """``microbatch(first=...)`` stands for the argument where a call gives none, is read when the module runs
    (the same bits as the argument), and an explicit ``is_first_microbatch`` overrides it."""
    by_arg = _train(_sharded(_module("grouped")), RECIPES[1], [True, False])
    quantizations[0] = 0
    module = _sharded(_module("grouped"))
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(2):
        for first in (True, False):
            x = torch.randn(T, K, generator=gen).to(torch.bfloat16).requires_grad_()
            with fp8_autocast(RECIPES[1]), microbatch(first=first):
                y = _call(module, x, None)
            y.backward(torch.randn(y.shape, generator=gen).to(torch.bfloat16))
            module.backward_dw()
            seen += [y.detach(), x.grad]
        distwgrad.finalize_model_grads([module])
        seen += [p.grad.clone() for p in module.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
    for a, b in zip(seen, by_arg):
        assert torch.equal(a, b)
    assert quantizations[0] == 2 * 2
    x = torch.randn(T, K).to(torch.bfloat16)
    with fp8_autocast(RECIPES[1]), microbatch(first=True):
        assert current_first_microbatch() is True
        _call(module, x, None).sum().backward()  # keeps forward's copy
        module.backward_dw()
        quantizations[0] = 0
        with microbatch(first=False):
            assert current_first_microbatch() is False
            _call(module, x, None).sum().backward()  # the context's False: the kept copy
            module.backward_dw()
            assert quantizations[0] == 0
            _call(module, x, True).sum().backward()  # the argument wins: quantized afresh
            module.backward_dw()
            assert quantizations[0] == 1
    assert current_first_microbatch() is None
    distwgrad.finalize_model_grads([module])


def test_the_compiled_path_carries_the_flag():
    """``distwgrad::module_forward`` hands ``is_first_microbatch`` to the module (its ``first`` argument)."""
    lin = _sharded(_module("linear"))
    x = torch.randn(T, K).to(torch.bfloat16)
    with fp8_autocast(PerTensorScaling()), torch.no_grad():
        for first, kept in ((None, 0), (True, 1)):
            _, token = torch.ops.distwgrad.module_forward(x, [lin.weight, lin.bias], [], [], lin._op_handle, True,
                                                          [False, False], N, first)
            assert len(_kept(lin.weight)) == kept  # while the token holds the call's use, the step is open
    del token
    distwgrad.finalize_model_grads([lin], discard=True)


def _two_ranks(rank: int, world: int) -> None:
    import torch.distributed as dist

    lin = _sharded(_module("linear"), group=dist.group.WORLD)
    assert len(lin.weight.shard_rows) == 2
    x = torch.randn(T, K).to(torch.bfloat16)
    with fp8_autocast(PerTensorScaling()):
        lin(x, is_first_microbatch=True).sum().backward()
    assert not _kept(lin.weight)


def test_a_weight_sharded_over_ranks_keeps_no_gathered_copy():
    run_distributed(_two_ranks, world_size=2)


def test_the_study_runs_its_three_arms(tmp_path):
    """``qa/studies/fp8_weights_kept.py`` on the tiny preset: a median and a minimum line, and rows for each arm."""
    import json
    from pathlib import Path

    from train_job_cases import _run_forked

    script = Path(__file__).resolve().parents[1] / "qa" / "studies" / "fp8_weights_kept.py"
    results = tmp_path / "rows.jsonl"
    # one process forked from one that imported torch ([Note: forked job ranks])
    proc = _run_forked(["--model", "tiny", "--batch", "4", "--modes", "eager", "--recipes", "fp8_blockwise",
                        "--rounds", "1", "--steps", "1", "--warmup", "1", "--results", str(results)], None,
                       timeout=120, target=str(script))
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("fp8_blockwise")]
    assert [line.split()[-1] for line in lines] == ["median", "min"]
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["precision"], r.get("variant")) for r in rows] == [
        ("bf16", None), ("fp8_blockwise", "fresh"), ("fp8_blockwise", "kept")]
    assert all(r["case"] == "tiny b4x64 mb2 eager, fp8 weights kept, interleaved" for r in rows)


def test_the_jobs_step_keeps_weights_across_its_microbatches(quantizations):
    """``launch.step.forward_backward``: the same bits as ``keep_fp8_weights=False`` (``--no-fp8-weight-cache``),
    half the weights' quantizations with two microbatches."""
    from distwgrad.launch.step import forward_backward

    from distwgrad.models import MoEGPT, MoEGPTConfig

    cfg = MoEGPTConfig(vocab_size=64, seq_len=17, d_model=32, n_layers=1, n_heads=2, n_experts=2, top_k=2, d_ff=32)
    out, counts = {}, {}
    for keep in (False, True):
        torch.manual_seed(0)
        model = MoEGPT(cfg, device=torch.device("cpu"), sharded=True, param_dtype=torch.bfloat16)
        quantizations[0] = 0
        loss = forward_backward(model, torch.randint(0, 64, (4, 17)), 2, "fp8_blockwise", keep_fp8_weights=keep)
        distwgrad.finalize_model_grads([model])
        out[keep], counts[keep] = [loss, *(p.grad for p in model.parameters())], quantizations[0]
    assert all(torch.equal(a, b) for a, b in zip(out[True], out[False]))
    assert counts[True] * 2 == counts[False], counts
