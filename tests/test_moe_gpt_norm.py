"""The model's RMSNorm (``distwgrad.models.moe_gpt.rms_norm``, torch's ``F.rms_norm``): the fp32 formula the
model documents, ``x * rsqrt(mean(x^2) + eps)`` computed in fp32 and rounded to ``x``'s dtype, bit for bit on the
CPU, forward and backward; on a GPU (``-m gpu``) torch's fused kernel, against the formula in float64 within the
output's rounding and the fp32 work's worst case (its sums run in another order)."""

from __future__ import annotations

import pytest
import torch

from distwgrad.models.moe_gpt import rms_norm

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _formula(x: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps)`` computed in ``dtype`` (autograd through it)."""
    x = x.to(dtype)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_fp32_formula_bit_for_bit_on_the_cpu(dtype):
    torch.manual_seed(0)
    x = (torch.randn(4, 33, 256) * 3).to(dtype).requires_grad_()
    ref = x.detach().clone().requires_grad_()
    y = rms_norm(x, eps=1e-6)
    want = _formula(ref, 1e-6, torch.float32).to(dtype)
    assert y.dtype == dtype and torch.equal(y, want)
    dy = torch.randn_like(y)
    y.backward(dy)
    want.backward(dy)
    assert torch.equal(x.grad, ref.grad)


def test_a_constant_row_and_a_zero_row():
    x = torch.stack([torch.full((64,), 2.5), torch.zeros(64)]).bfloat16()
    y = rms_norm(x)
    assert torch.equal(y[0], torch.ones(64, dtype=torch.bfloat16))  # 2.5 / sqrt(6.25 + 1e-6) rounds to 1
    assert torch.equal(y[1], torch.zeros(64, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_within_the_fp32_bound_of_the_formula_on_a_gpu(dtype):
    """The bound: the output's rounding (one ulp of ``dtype``, as a rounding boundary may fall either side of the
    fp32 value) plus the fp32 work's worst case: the mean of n squares within n/2 ulps after the square root's
    halving, ``rsqrt`` within 2 (CUDA's ``rsqrtf``), the product within 1."""
    torch.manual_seed(0)
    n = 2048
    x = (torch.randn(n, n, device="cuda") * 3).to(dtype)
    y = rms_norm(x).double()
    want = _formula(x, 1e-6, torch.float64)
    rel = torch.finfo(dtype).eps + (n / 2 + 3) * 2.0**-24
    bound = rel * want.abs() + torch.finfo(dtype).tiny
    assert ((y - want).abs() <= bound).all(), ((y - want).abs() / want.abs().clamp_min(1e-30)).max().item()
