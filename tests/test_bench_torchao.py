"""torchao's FP8 peer of ``qa/bench/train_step.py`` (``qa/bench/_torchao_fp8.py``) on the ``tiny`` preset.

Skipped where torchao does not import (the optional extra ``bench``). On a CPU the attention projections run
torchao's ``Float8Linear`` and the experts stay bf16 (``torch._scaled_grouped_mm`` is CUDA only); the padding
of the experts' token groups is checked against the unpadded grouped GEMM; the GPU test runs the whole
recipe, experts included, on an SM90 device.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "qa" / "bench"))
import _torchao_fp8  # noqa: E402
import train_step  # noqa: E402

from distwgrad.models import MoEGPT, MoEGPTConfig  # noqa: E402
from distwgrad.models.moe_gpt import _TorchExperts  # noqa: E402

# torchao is imported by the tests that use it, never at collection: each xdist worker collects every file,
# and importing torchao takes seconds
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                reason="torchao is not installed (the optional extra bench)")


@pytest.fixture(scope="module", autouse=True)
def _torchao():
    """Skips where torchao is installed but does not import (one built for another torch)."""
    why = _torchao_fp8.import_error()
    if why:
        pytest.skip(why)


def _float8_linear() -> type:
    from torchao.float8.float8_linear import Float8Linear
    return Float8Linear


def _expert_weight() -> type:
    from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor
    return Float8TrainingWeightWrapperTensor

# e4m3 keeps 3 mantissa bits to bf16's 7, so an FP8 GEMM rounds its operands 2^4 = 16 times as coarsely as the
# bf16 build rounds them. The bf16 build's own distance from fp32 (same weights, same data) is what bf16's
# rounding does to this loss; the FP8 build may be 16 times as far from bf16, times 2 for the luck of one
# sample (the roundings' errors partly cancel in a mean over tokens, more or less in each build).
FP8_OVER_BF16 = 2 * 2 ** (7 - 3)


@pytest.fixture(scope="module")
def world():
    """A one-rank gloo group, as the bench's ``_runtime`` makes without torchrun (FSDP2 needs one)."""
    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if mine:
        dist.destroy_process_group()


def _rt(world, device: torch.device) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    return {"device": device, "rank": 0, "world": 1, "group": world, "mesh": init_device_mesh(device.type, (1,))}


def _args():
    args = train_step.parse_args(["--model", "tiny", "--precisions", "bf16,fp8_per_tensor", "--modes", "eager",
                                  "--no-record"])
    _, cfg, args.batch, args.microbatches = train_step.model_config(args)
    return args, cfg


def test_conversion_keeps_the_parameters():
    """Float8Linear on the attention projections holding the same Parameter objects; the experts' wrappers on
    the same storage (converted on any device: only their GEMMs need CUDA); the rest untouched."""
    model = MoEGPT(MoEGPTConfig(), sharded=False, experts="grouped_mm", param_dtype=torch.bfloat16)
    before = dict(model.named_parameters())
    values = {n: p.detach().clone() for n, p in before.items()}
    facts = _torchao_fp8.convert(model, tokens=8 * 63, experts=True)
    after = dict(model.named_parameters())
    assert list(after) == list(before) and facts["fp8_experts"] and facts["recipe"] == "torchao"
    for name, p in after.items():
        if ".moe.fc" in name:
            assert isinstance(p, _expert_weight()), name
            assert p._data.untyped_storage().data_ptr() == before[name].untyped_storage().data_ptr(), name
            assert torch.equal(p._data, values[name]), name
        else:
            assert p is before[name], name
    for block in model.blocks:
        assert isinstance(block.attn.qkv, _float8_linear()) and isinstance(block.attn.proj, _float8_linear())
        assert not isinstance(block.moe.router, _float8_linear())
    assert model.lm_head.weight is model.embedding.weight and not isinstance(model.lm_head, _float8_linear())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_experts_match_the_grouped_mm(dtype):
    """Token groups padded to 16 rows (an empty expert, groups off 16) give the unpadded GEMM's outputs and
    gradients: the padding is zero rows that no output reads."""
    torch.manual_seed(0)
    m_splits_E = torch.tensor([3, 0, 17, 5, 16])
    w = torch.randn(5, 32, 48, dtype=dtype)  # [E, N, K]
    x = torch.randn(int(m_splits_E.sum()), 48, dtype=dtype)
    outs = []
    for module in (_TorchExperts(w.clone().requires_grad_(), None, "grouped_mm"),
                   _torchao_fp8.Float8Experts(torch.nn.Parameter(w.clone()))):
        xi = x.clone().requires_grad_()
        y = module(xi, m_splits_E)
        y.backward(torch.ones_like(y))
        outs.append((y, xi.grad, module.weight.grad))
    src_P, _, offs_E = _torchao_fp8.pad_plan(m_splits_E, x.shape[0])
    assert offs_E.tolist() == [16, 32, 64, 80, 96] and src_P.numel() % 16 == 0
    for got, want in zip(outs[1], outs[0], strict=True):
        torch.testing.assert_close(got, want)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # FSDP2's DTensor: this rank's shard


def _step_losses(impls_precisions, rt, args, cfg) -> dict:
    """Each build's step-1 loss on the bench's first batch, checking the converted peers on the way."""
    from distwgrad.data import MarkovCorpus

    tok = MarkovCorpus(cfg.vocab_size, cfg.seq_len, cfg.seed).global_batch(1, args.batch).to(rt["device"])
    losses = {}
    for impl, precision in impls_precisions:
        b = train_step.make_build(impl, precision, "eager", cfg, rt, args)
        params = list(b.model.parameters())
        before = [_local(p).detach().clone() for p in params]
        stepped = [p for g in b.optimizer.param_groups for p in g["params"]]
        assert len(stepped) == len(params) and all(p is q for p, q in zip(stepped, params)), impl  # the model's own
        losses[(impl, precision)] = b.run_step(tok).item()
        if precision == "fp8_per_tensor":
            assert b.facts["recipe"] == "torchao" and b.facts["fp8_experts"] == (rt["device"].type == "cuda")
            assert all(isinstance(blk.attn.qkv, _float8_linear()) for blk in b.model.blocks)
            unchanged = [i for i, (p, q) in enumerate(zip(params, before, strict=True)) if torch.equal(_local(p), q)]
            assert not unchanged, unchanged  # the optimizer stepped every parameter
    return losses


@pytest.mark.parametrize("impl", ["torch", "fsdp2"])
def test_one_step_of_the_peer_on_cpu(world, impl):
    args, cfg = _args()
    args.param_dtype = "bf16"
    losses = _step_losses([("torch", "fp32"), ("torch", "bf16"), (impl, "fp8_per_tensor")],
                          _rt(world, torch.device("cpu")), args, cfg)
    bf16_err = abs(losses[("torch", "bf16")] - losses[("torch", "fp32")])
    fp8_gap = abs(losses[(impl, "fp8_per_tensor")] - losses[("torch", "bf16")])
    assert fp8_gap <= FP8_OVER_BF16 * bf16_err, (fp8_gap, bf16_err, losses)


@pytest.mark.gpu
def test_the_whole_recipe_on_sm90(world):
    """Attention and experts in FP8 (torch._scaled_grouped_mm, SM90): one step near plain bf16's loss."""
    if not torch.cuda.is_available() or _torchao_fp8.experts_why(torch.device("cuda")):
        pytest.skip("needs an SM90 GPU: " + str(_torchao_fp8.experts_why(torch.device("cuda"))
                                                if torch.cuda.is_available() else "no CUDA"))
    args, cfg = _args()
    rt = _rt(world, torch.device("cuda"))
    losses = _step_losses([("torch", "fp32"), ("torch", "bf16"), ("torch", "fp8_per_tensor")], rt, args, cfg)
    bf16_err = abs(losses[("torch", "bf16")] - losses[("torch", "fp32")])
    fp8_gap = abs(losses[("torch", "fp8_per_tensor")] - losses[("torch", "bf16")])
    assert fp8_gap <= FP8_OVER_BF16 * bf16_err, (fp8_gap, bf16_err, losses)
