"""Emulated FP8 GEMM (``fp8_matmul_reference``): exact w.r.t. its dequantized operands, and within a
derived bound of the unquantized fp32 product.

The bound. Write the dequantized operands as A' = A + dA, B' = B + dB, with the elementwise round-trip
bounds |dA| <= Ea, |dB| <= Eb (``roundtrip_error_bound``: |x| * 2^-(m+1) plus half a subnormal step
over the scale, i.e. eps_fp8 * |x| + tiny). Then

    A'B' - AB = dA B + A dB + dA dB      so      |A'B' - AB| <= Ea|B| + |A|Eb + Ea Eb
                                                             ~= sum_k |a||b| (2 eps + eps^2) + tiny.

Both fp32 products are computed by a BLAS in some summation order; each adds at most
gamma_K * (|X| @ |Y|), gamma_K = K u / (1 - K u), u = 2^-24 (Higham, Thm 3.5). The test bound is the
sum of the three, evaluated in float64.
"""

from __future__ import annotations

import pytest
import torch

from distwgrad.fp8 import (
    BlockwiseScaling,
    PerTensorScaling,
    Quantized,
    dequantize,
    fp8_format,
    fp8_matmul_reference,
    quantize_blockwise,
    quantize_per_tensor,
    quantize_rowwise_and_columnwise,
    roundtrip_error_bound,
    transpose_quantized,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def gemm_error_bound(a: torch.Tensor, a_q: Quantized, b: torch.Tensor, b_q: Quantized) -> torch.Tensor:
    """Bound on |fp8_matmul_reference(a_q, b_q, fp32) - fp32(a @ b)|, elementwise, float64."""
    A, B = a.double().abs(), b.double().abs()
    Ea, Eb = roundtrip_error_bound(a, a_q), roundtrip_error_bound(b, b_q)
    Aq = dequantize(a_q, dtype=torch.float32).double().abs()
    Bq = dequantize(b_q, dtype=torch.float32).double().abs()
    K, u = a.shape[1], 2.0**-24
    gamma = K * u / (1 - K * u)
    return (Ea @ B + A @ Eb + Ea @ Eb + gamma * (A @ B + Aq @ Bq)) * (1 + 1e-9)


def operands(M: int, K: int, N: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(M, K, generator=g) * torch.logspace(-2, 2, K)).to(dtype)
    b = torch.randn(K, N, generator=g).to(dtype)
    return a, b


QUANT = {
    "per_tensor_e4m3": lambda x: quantize_per_tensor(x, E4M3),
    "per_tensor_e5m2": lambda x: quantize_per_tensor(x, E5M2),
    "1x128": lambda x: quantize_blockwise(x, (1, 128), E4M3),
    "128x128": lambda x: quantize_blockwise(x, (128, 128), E4M3),
    "128x128_fp32_scales": lambda x: quantize_blockwise(x, (128, 128), E4M3, power_of_two=False),
}


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qa, qb", [("per_tensor_e4m3", "per_tensor_e5m2"), ("1x128", "128x128"),
                                    ("128x128_fp32_scales", "1x128")])
def test_emulation_is_the_product_of_the_dequantized_operands(qa, qb, out_dtype):
    a, b = operands(70, 300, 130, torch.bfloat16)
    a_q, b_q = QUANT[qa](a), QUANT[qb](b)
    want = dequantize(a_q, dtype=torch.float32) @ dequantize(b_q, dtype=torch.float32)
    got = fp8_matmul_reference(a_q, b_q, out_dtype)
    assert got.dtype == out_dtype
    assert torch.equal(got, want.to(out_dtype))  # error 0, bit for bit


@pytest.mark.parametrize("qa, qb", [("per_tensor_e4m3", "per_tensor_e4m3"),
                                    ("per_tensor_e4m3", "per_tensor_e5m2"),
                                    ("1x128", "128x128"), ("128x128_fp32_scales", "1x128")])
@pytest.mark.parametrize("shape", [(64, 256, 96), (33, 300, 129)])
def test_error_vs_unquantized_product_is_within_the_derived_bound(qa, qb, shape):
    M, K, N = shape
    a, b = operands(M, K, N, torch.float32, seed=K)
    a_q, b_q = QUANT[qa](a), QUANT[qb](b)
    err = (fp8_matmul_reference(a_q, b_q, torch.float32).double() - (a @ b).double()).abs()
    bound = gemm_error_bound(a, a_q, b, b_q)
    assert bool((err <= bound).all()), f"worst err/bound {(err / bound).max().item():.3f}"
    assert err.max().item() > 0  # quantization did happen
    # The bound is the leading term sum_k |a||b| (2 eps + eps^2), up to subnormal and fp32 slack.
    eps = max(2.0 ** -(fp8_format(q.data.dtype).mantissa_bits + 1) for q in (a_q, b_q))
    lead = (2 * eps + eps**2) * (a.double().abs() @ b.double().abs())
    assert bool((bound <= lead * 1.01 + 1e-3 * lead.max()).all())


@pytest.mark.parametrize("f8", [E4M3, E5M2], ids=str)
def test_bound_is_attained_by_coherent_rounding(f8):
    """Every element a tie that rounds up: the errors add with one sign and reach most of the bound."""
    fmt = fp8_format(f8)
    tie = 1.0 + 1.5 * 2.0**-fmt.mantissa_bits  # halfway between 1 + 2^-m and 1 + 2^(1-m): rounds up (even)
    K = 256
    a = torch.full((4, K), tie)
    b = torch.full((K, 4), tie)
    amax = torch.tensor(fmt.max)  # scale exactly 1: the fp8 rounding is the only error
    a_q, b_q = quantize_per_tensor(a, f8, amax=amax), quantize_per_tensor(b, f8, amax=amax)
    err = (fp8_matmul_reference(a_q, b_q, torch.float32).double() - (a @ b).double()).abs()
    bound = gemm_error_bound(a, a_q, b, b_q)
    assert bool((err <= bound).all())
    assert (err / bound).min().item() > 0.6


@pytest.mark.parametrize("recipe", [BlockwiseScaling(), PerTensorScaling()], ids=["blockwise", "per_tensor"])
def test_linear_fprop_dgrad_wgrad_emulation(recipe):
    """The three GEMMs of a linear layer, each from the operands a recipe would hand the FP8 GEMM."""
    T, K, N = 96, 256, 160  # tokens, in-features, out-features
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, K, generator=g)
    w = torch.randn(N, K, generator=g) * 0.05
    dy = torch.randn(T, N, generator=g)
    x_q, xt_q = quantize_rowwise_and_columnwise(x, recipe)
    dy_q, dyt_q = quantize_rowwise_and_columnwise(dy, recipe, grad=True)
    if isinstance(recipe, BlockwiseScaling):
        w_q = quantize_blockwise(w, recipe.weight_block, recipe.dtype)
    else:
        w_q = quantize_per_tensor(w, recipe.fwd_dtype)
    wt_q = transpose_quantized(w_q)  # exact: W^T for fprop, no re-quantization
    cases = {
        "fprop y = x @ W^T": (x, x_q, w.t(), wt_q),
        "dgrad dx = dy @ W": (dy, dy_q, w, w_q),
        "wgrad dW = dy^T @ x": (dy.t(), dyt_q, x, transpose_quantized(xt_q)),
    }
    for name, (a, a_q, b, b_q) in cases.items():
        err = (fp8_matmul_reference(a_q, b_q, torch.float32).double() - (a @ b).double()).abs()
        assert bool((err <= gemm_error_bound(a, a_q, b, b_q)).all()), name


def test_shape_mismatch_is_rejected():
    a_q = quantize_per_tensor(torch.ones(4, 8), E4M3)
    with pytest.raises(ValueError, match=r"\(4, 8\) @ \(4, 8\)"):
        fp8_matmul_reference(a_q, a_q, torch.float32)
