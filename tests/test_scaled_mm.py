"""A Linear's FP8 GEMMs on cuBLASLt ([Note: a Linear's fp8 GEMMs on cuBLASLt] in ``distwgrad/ops/scaled_mm.py``):
which GEMMs it takes, and on a GPU (``-m gpu``) its products against the fp32 oracle of the dequantized operands
within ``reference_fp8.error_bound`` (the Triton kernels' bound: the two differ only in the order of fp32 sums),
with the switch off as the control; blockwise also at the widths cuBLASLt gets wrong ([Note: cuBLASLt's blockwise
scale layouts]), which must stay with the kernels.
"""

from __future__ import annotations

import pytest
import torch

from distwgrad.fp8 import BlockwiseScaling, MMParams, PerTensorScaling, fp8_autocast, quantize_per_tensor
from distwgrad.fp8.quantize import Quantized, transpose_quantized
from distwgrad.nn import Linear
from distwgrad.ops import scaled_mm
from distwgrad.testing import reference_fp8 as ref

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _fp8(rows, cols, dtype=E4, *, column_major=False):
    t = torch.zeros(cols, rows, dtype=dtype).t() if column_major else torch.zeros(rows, cols, dtype=dtype)
    return t


@pytest.mark.parametrize("case,ok", [
    ("fprop layout", True),
    ("e4m3 x e5m2", True),
    ("e5m2 x e5m2", False),
    ("b row-major", False),
    ("a column-major", False),
    ("contraction not a multiple of 16", False),
    ("width not a multiple of 16", False),
    ("no rows", False),
    ("misaligned address", False),
    ("bf16 operand", False),
])
def test_layout_ok(case, ok):
    a, b = _fp8(64, 128), _fp8(128, 96, column_major=True)
    if case == "e4m3 x e5m2":
        b = _fp8(128, 96, E5, column_major=True)
    elif case == "e5m2 x e5m2":
        a, b = _fp8(64, 128, E5), _fp8(128, 96, E5, column_major=True)
    elif case == "b row-major":
        b = _fp8(128, 96)
    elif case == "a column-major":
        a = _fp8(64, 128, column_major=True)
    elif case == "contraction not a multiple of 16":
        a, b = _fp8(64, 120), _fp8(120, 96, column_major=True)
    elif case == "width not a multiple of 16":
        b = _fp8(128, 100, column_major=True)
    elif case == "no rows":
        a = _fp8(0, 128)
    elif case == "misaligned address":
        a = torch.zeros(64, 144, dtype=E4)[:, 8:136]
    elif case == "bf16 operand":
        a = torch.zeros(64, 128, dtype=torch.bfloat16)
    assert scaled_mm.layout_ok(a, b) is ok


@pytest.mark.parametrize("M,K,N,weight,ok", [
    (1024, 512, 384, True, True),
    (1000, 2048, 128, True, True),      # rows a multiple of 4 suffice by a weight
    (1022, 512, 384, True, False),      # a scale column not 16-byte aligned
    (1024, 640, 384, True, False),      # 5 weight blocks along the contraction: wrong numbers on the H100
    (1024, 384, 384, True, False),
    (1024, 512, 200, True, False),      # a partial weight block in the output
    (0, 512, 384, True, False),
    (384, 1024, 512, False, True),      # wgrad: rows and output width are features, contraction tokens
    (384, 1000, 512, False, False),     # tokens not a multiple of 128
    (200, 1024, 512, False, False),
])
def test_blockwise_ok(M, K, N, weight, ok):
    assert scaled_mm.blockwise_ok(M, K, N, weight=weight) is ok


def test_nothing_runs_off_cuda():
    x = quantize_per_tensor(torch.randn(32, 64), E4)
    w = quantize_per_tensor(torch.randn(48, 64), E4)
    assert scaled_mm.linear_fprop(x, [w], torch.bfloat16, True) is None
    assert scaled_mm.linear_dgrad(quantize_per_tensor(torch.randn(32, 48), E5), [transpose_quantized(w)],
                                  torch.bfloat16, True) is None
    assert scaled_mm.linear_wgrad(transpose_quantized(x), transpose_quantized(x), None, torch.float32, True) is None
    bw = BlockwiseScaling()
    x_q, x_qt = bw.quantize_rowwise_and_columnwise(torch.randn(128, 512), grad=False)
    w_q = bw.quantize_weight(torch.randn(512, 512))
    assert scaled_mm.linear_fprop(x_q, w_q, torch.bfloat16, True) is None
    assert scaled_mm.linear_dgrad(x_q, w_q, torch.bfloat16, True) is None
    assert scaled_mm.linear_wgrad(x_qt, x_qt, None, torch.float32, True) is None


def _counting(monkeypatch) -> list:
    calls, real = [], torch._scaled_mm

    def counted(*args, **kwargs):
        calls.append(kwargs["use_fast_accum"])
        return real(*args, **kwargs)
    monkeypatch.setattr(torch, "_scaled_mm", counted)
    return calls


def _q(t: torch.Tensor, dtype) -> Quantized:
    return quantize_per_tensor(t, dtype)


def _check(ours, expected, S, depth, split, out_dtype, addend=None):
    mma = ref.hopper_mma_rel(128 if split else depth)
    res = ref.check(ours, expected, S, depth=depth, out_dtype=out_dtype, mma_rel=mma, addend=addend)
    assert res["ok"], res


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("split", [True, False], ids=["split", "fast"])
@pytest.mark.parametrize("cublas", [True, False], ids=["cublas", "kernels"])
def test_linear_gemms_within_the_bound(split, cublas, monkeypatch):
    """fprop, dgrad and two microbatches' wgrads into an fp32 ``main_grad``, each against the oracle of the
    operands the module quantized (the kernels' quantization is the reference's, bit for bit); the second wgrad
    is bounded as an add into what the first left."""
    from distwgrad.kernels._tuning import tuning
    torch.manual_seed(0)
    T, K, N = 1024, 512, 384
    mm = MMParams(use_split_accumulator=split)
    recipe = PerTensorScaling(fp8_gemm_fprop=mm, fp8_gemm_dgrad=mm, fp8_gemm_wgrad=mm)
    lin = Linear(K, N, bias=False, params_dtype=torch.bfloat16, device="cuda", fuse_wgrad_accumulation=True)
    lin.weight.main_grad = torch.zeros(N, K, device="cuda")
    calls = _counting(monkeypatch)
    one = torch.tensor([T], dtype=torch.int32, device="cuda")
    w_q = _q(lin.weight.detach(), recipe.fwd_dtype)
    for _ in range(2):
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
        before = lin.weight.main_grad.clone()
        with tuning(grouped_gemm_fp8=dict(linear_cublas=cublas)):
            with fp8_autocast(recipe):
                y = lin(x)
            y.backward(dy)
        x_q, dy_q = _q(x.detach(), recipe.fwd_dtype), _q(dy, recipe.grad_dtype)
        _check(y, ref.grouped_fprop_fp8(x_q, [w_q], one, out_dtype=torch.float32),
               ref.grouped_fprop_fp8(x_q, [w_q], one, absolute=True), K, split, torch.bfloat16)
        _check(x.grad, ref.grouped_dgrad_fp8(dy_q, [w_q], one, out_dtype=torch.float32),
               ref.grouped_dgrad_fp8(dy_q, [w_q], one, absolute=True), N, split, torch.bfloat16)
        operands = (transpose_quantized(dy_q), transpose_quantized(x_q), one)
        want = ref.grouped_wgrad_fp8(*operands, out=before.clone()[None])[0]
        S = ref.grouped_wgrad_fp8(*operands, absolute=True)[0]
        _check(lin.weight.main_grad, want, S, T, split, torch.float32, addend=before)
    assert calls == ([not split] * 6 if cublas else [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_bias_stays_with_the_kernels(monkeypatch):
    """A bias keeps fprop in the kernels' fp32 epilogue (dgrad and wgrad still run on cuBLASLt)."""
    torch.manual_seed(0)
    recipe, want = PerTensorScaling(), 2
    lin = Linear(512, 384, bias=True, params_dtype=torch.bfloat16, device="cuda")
    calls = _counting(monkeypatch)
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with fp8_autocast(recipe):
        y = lin(x)
    y.float().square().mean().backward()
    assert len(calls) == want
    assert torch.isfinite(x.grad).all() and torch.isfinite(lin.weight.grad).all()


def _blockwise_capable() -> bool:
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and cuda >= (12, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _blockwise_capable(), reason="cuBLASLt's block scaling needs Hopper and CUDA 12.9")
@pytest.mark.parametrize("cublas", [True, False], ids=["cublas", "kernels"])
@pytest.mark.parametrize("T,K,N,dtype,fuse,on_cublas", [
    (1024, 512, 512, torch.bfloat16, True, 3),   # fprop, dgrad and wgrad
    (1000, 2048, 512, torch.bfloat16, True, 2),  # tokens not a multiple of 128: the wgrad stays with the kernels
    (1024, 640, 384, torch.bfloat16, True, 1),   # contractions cuBLASLt gets wrong (fprop 640, dgrad 384)
    (1024, 384, 640, torch.bfloat16, True, 1),
    (1024, 256, 256, torch.bfloat16, True, 1),
    (1024, 512, 512, torch.float32, True, 1),    # fp32 outputs: fprop and dgrad stay, the fp32 wgrad goes
    (1024, 512, 512, torch.bfloat16, False, 2),  # a fresh bf16 wgrad stays with the kernels
], ids=["all", "tokens", "640x384", "384x640", "256x256", "fp32", "unfused"])
def test_blockwise_linear_gemms_within_the_bound(T, K, N, dtype, fuse, on_cublas, cublas, monkeypatch):
    """Blockwise, as the per-tensor test above, on both sides of ``blockwise_ok`` and of the outputs measured:
    wherever a GEMM runs, its product is within the oracle's bound, and the count says which ran on cuBLASLt
    (1x128 by 128x128 at contractions 256, 384 and 640 wide returned wrong numbers there). Fused: two
    microbatches into ``main_grad``; unfused: one, its fresh wgrad in ``.grad``."""
    from distwgrad.kernels._tuning import tuning
    torch.manual_seed(0)
    recipe = BlockwiseScaling()
    lin = Linear(K, N, bias=False, params_dtype=dtype, device="cuda", fuse_wgrad_accumulation=fuse)
    if fuse:
        lin.weight.main_grad = torch.zeros(N, K, device="cuda")
    calls = _counting(monkeypatch)
    one = torch.tensor([T], dtype=torch.int32, device="cuda")
    w_q = recipe.quantize_weight(lin.weight.detach())
    microbatches = 2 if fuse else 1
    for _ in range(microbatches):
        x = torch.randn(T, K, device="cuda", dtype=dtype, requires_grad=True)
        dy = torch.randn(T, N, device="cuda", dtype=dtype)
        before = lin.weight.main_grad.clone() if fuse else None
        with tuning(grouped_gemm_fp8=dict(linear_cublas=cublas)):
            with fp8_autocast(recipe):
                y = lin(x)
            y.backward(dy)
        x_q, x_qt = recipe.quantize_rowwise_and_columnwise(x.detach(), grad=False)
        dy_q, dy_qt = recipe.quantize_rowwise_and_columnwise(dy, grad=True)
        _check(y, ref.grouped_fprop_fp8(x_q, w_q, one, out_dtype=torch.float32),
               ref.grouped_fprop_fp8(x_q, w_q, one, absolute=True), K, True, dtype)
        _check(x.grad, ref.grouped_dgrad_fp8(dy_q, w_q, one, out_dtype=torch.float32),
               ref.grouped_dgrad_fp8(dy_q, w_q, one, absolute=True), N, True, dtype)
        S = ref.grouped_wgrad_fp8(dy_qt, x_qt, one, absolute=True)[0]
        if fuse:
            want = ref.grouped_wgrad_fp8(dy_qt, x_qt, one, out=before.clone()[None])[0]
            _check(lin.weight.main_grad, want, S, T, True, torch.float32, addend=before)
        else:
            _check(lin.weight.grad, ref.grouped_wgrad_fp8(dy_qt, x_qt, one)[0], S, T, True, dtype)
    assert calls == ([False] * microbatches * on_cublas if cublas else [])
