"""Dense GEMM helpers for Linear: the wgrad product, written or accumulated into an fp32 target."""

from __future__ import annotations

import torch

__all__ = ["wgrad_mm"]


def wgrad_mm(dy_TN: torch.Tensor, x_TK: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``dW_NK = dy_TN^T @ x_TK``; with ``out`` the product is added into ``out`` and ``out`` returned.

    On CUDA with bf16/fp16 inputs and an fp32 ``out``, the GEMM produces fp32 directly
    (``out_dtype``), so the contribution is not rounded to the input dtype before the fp32 add. On CPU the
    product is taken in the input dtype, exactly as ``torch.nn.Linear``'s backward does (the CPU tests
    are bit-exact against it).
    """
    if out is None:
        return dy_TN.t().mm(x_TK)
    if (out.device.type == "cuda" and out.dtype == torch.float32
            and dy_TN.dtype in (torch.bfloat16, torch.float16)):
        return out.add_(torch.mm(dy_TN.t(), x_TK, out_dtype=torch.float32))
    return out.add_(dy_TN.t().mm(x_TK))
