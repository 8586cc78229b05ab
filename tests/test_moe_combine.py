"""The MoE layer's combine of its experts' outputs ([Note: the experts' combine] in distwgrad/models/moe_gpt.py)
against the ``index_add`` it replaces: bit-equal, forward and backward, for ``top_k <= 2``; for more, the
sum in a fixed order, within one rounding per addition of the exact sum."""

from __future__ import annotations

import pytest
import torch

from distwgrad.models.moe_gpt import combine


def _routing(T: int, k: int, E: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    expert_A = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).reshape(-1)
    return torch.argsort(expert_A, stable=True)


def _index_add(y_AD: torch.Tensor, order_A: torch.Tensor, k: int) -> torch.Tensor:
    return torch.zeros(order_A.numel() // k, y_AD.shape[1], dtype=y_AD.dtype).index_add(0, order_A // k, y_AD)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("seed", range(3))
def test_combine_is_the_index_add_bit_for_bit(dtype, k, seed):
    T, D, E = 37, 24, 6
    order_A = _routing(T, k, E, seed)
    y = (torch.randn(T * k, D, generator=torch.Generator().manual_seed(seed)) * 4).to(dtype)
    y1, y2 = y.clone().requires_grad_(), y.clone().requires_grad_()
    got, want = combine(y1, order_A, k), _index_add(y2, order_A, k)
    assert got.dtype == want.dtype and torch.equal(got, want)
    dy = torch.randn(T, D, generator=torch.Generator().manual_seed(seed + 10)).to(dtype)
    got.backward(dy)
    want.backward(dy)
    assert torch.equal(y1.grad, y2.grad)


@pytest.mark.parametrize("k", [3, 4])
def test_combine_of_more_than_two_is_the_sum_within_its_roundings(k):
    T, D, E = 29, 16, 8
    order_A = _routing(T, k, E, 0)
    y = (torch.randn(T * k, D, generator=torch.Generator().manual_seed(1)) * 4).to(torch.bfloat16)
    got = combine(y, order_A, k)
    exact = _index_add(y.double(), order_A, k)
    # the sum accumulates in fp32 (k - 1 roundings of 2^-24) and rounds once to bf16 (2^-8), each relative to
    # at most the sum of the token's |rows|
    mags = _index_add(y.double().abs(), order_A, k)
    assert ((got.double() - exact).abs() <= (2.0**-8 + (k - 1) * 2.0**-24) * mags).all()
    assert torch.equal(got, combine(y, order_A, k))  # a fixed order: the same bits every call
