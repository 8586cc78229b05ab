"""Dense GEMM helpers for Linear: the wgrad product, written or accumulated into an fp32 target."""

from __future__ import annotations

import torch

__all__ = ["wgrad_mm"]


def _fp32_epilogue(dy_TN: torch.Tensor) -> bool:
    """Whether the GEMM itself can emit fp32 from these 16-bit inputs (CUDA's ``out_dtype``)."""
    return dy_TN.device.type == "cuda" and dy_TN.dtype in (torch.bfloat16, torch.float16)


def wgrad_mm(dy_TN: torch.Tensor, x_TK: torch.Tensor, out: torch.Tensor | None = None, *,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``dW_NK = dy_TN^T @ x_TK``; with ``out`` the product is added into ``out`` and ``out`` returned.

    On CUDA with bf16/fp16 inputs and an fp32 ``out``, the GEMM accumulates into ``out`` itself
    (``addmm`` with ``out_dtype``, ``beta=1``: the epilogue adds the fp32 product to ``out``), so the
    contribution is never rounded to the input dtype and no fp32 product is written and read back. On
    CPU the product is taken in the input dtype, exactly as ``torch.nn.Linear``'s backward does (the CPU
    tests are bit-exact against it).

    ``out_dtype`` (without ``out``): a fresh product's dtype, the inputs' by default. ``torch.float32``
    holds what adding the product into fp32 zeros would: on CUDA the GEMM's fp32 accumulator itself
    (``mm`` with ``out_dtype``), elsewhere the product in the input dtype, cast.
    """
    if out is not None and out_dtype is not None:
        raise ValueError(f"wgrad_mm: out_dtype={out_dtype} is a fresh output's dtype; pass out (added into) or "
                         f"out_dtype, not both")
    if out is None:
        if out_dtype == torch.float32 and _fp32_epilogue(dy_TN):
            return torch.mm(dy_TN.t(), x_TK, out_dtype=torch.float32)
        dW_NK = dy_TN.t().mm(x_TK)
        return dW_NK if out_dtype is None else dW_NK.to(out_dtype)
    if out.dtype == torch.float32 and _fp32_epilogue(dy_TN):
        return torch.addmm(out, dy_TN.t(), x_TK, out_dtype=torch.float32, out=out)
    return out.add_(dy_TN.t().mm(x_TK))
