"""Dense GEMM helpers for Linear: the wgrad product, written or accumulated into an fp32 target."""

from __future__ import annotations

import torch

__all__ = ["wgrad_mm"]


def wgrad_mm(dy_TN: torch.Tensor, x_TK: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``dW_NK = dy_TN^T @ x_TK``; with ``out`` the product is added into ``out`` and ``out`` returned.

    On CUDA with bf16/fp16 inputs and an fp32 ``out``, the GEMM accumulates into ``out`` itself
    (``addmm`` with ``out_dtype``, ``beta=1``: the epilogue adds the fp32 product to ``out``), so the
    contribution is never rounded to the input dtype and no fp32 product is written and read back. On
    CPU the product is taken in the input dtype, exactly as ``torch.nn.Linear``'s backward does (the CPU
    tests are bit-exact against it).
    """
    if out is None:
        return dy_TN.t().mm(x_TK)
    if (out.device.type == "cuda" and out.dtype == torch.float32
            and dy_TN.dtype in (torch.bfloat16, torch.float16)):
        return torch.addmm(out, dy_TN.t(), x_TK, out_dtype=torch.float32, out=out)
    return out.add_(dy_TN.t().mm(x_TK))
