"""FP8 GEMMs by emulation: quantize with the recipe's scales, dequantize to fp32, fp32 GEMM.

This is what an FP8 GEMM computes up to the order of its fp32 accumulation, on any device; it is the
CPU path of the FP8 modules and the reference of the FP8 kernels. Operands are quantized as the GEMM
that reads them would: an activation or gradient with tiles along the contraction dim (rows of
``x_TK`` for fprop, of ``dy_TN`` for dgrad; columns, i.e. along the tokens, for wgrad), a weight in
its recipe's blocks (``distwgrad.fp8.weights``).

Legend: T tokens, K in-features, N out-features, E experts.
"""

from __future__ import annotations

import torch

from distwgrad.fp8.quantize import Quantized, dequantize, quantize_rowwise_and_columnwise
from distwgrad.fp8.recipe import Recipe

__all__ = ["fake_quant_rows", "fake_quant_cols", "dequantize_weights"]


def fake_quant_rows(x_MK: torch.Tensor, recipe: Recipe, *, grad: bool) -> torch.Tensor:
    """fp32 values of ``x`` quantized for a GEMM contracting over its columns (K)."""
    q, _ = quantize_rowwise_and_columnwise(x_MK, recipe, grad=grad)
    return dequantize(q, dtype=torch.float32)


def fake_quant_cols(x_MK: torch.Tensor, recipe: Recipe, *, grad: bool) -> torch.Tensor:
    """fp32 values of ``x`` quantized for a GEMM contracting over its rows (M, the tokens), as ``[M, K]``."""
    _, qt = quantize_rowwise_and_columnwise(x_MK, recipe, grad=grad)
    return dequantize(qt, dtype=torch.float32).t()


def dequantize_weights(qs: list[Quantized], packed: bool) -> torch.Tensor:
    """``[N, K]`` (one matrix) or ``[E, N, K]`` (packed / discrete experts) fp32 values."""
    mats = [dequantize(q, dtype=torch.float32) for q in qs]
    return torch.stack(mats) if packed or len(mats) > 1 else mats[0]
