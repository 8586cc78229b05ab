"""The model's rotary position embedding: the formula everywhere, one fused kernel in eager mode on CUDA.

``rotate_halves(x, cos, sin)`` rotates each head's two halves by the angles of its position:
``cat([x1 cos - x2 sin, x1 sin + x2 cos], -1)``. Where its kernel can run ([Note: rotary in one pass] in
``kernels/rotary.py``) it computes that in fp32 with one rounding, as inductor's fused kernel does; elsewhere torch
runs the formula itself: on the CPU, under ``torch.compile`` (which fuses the formula) and ``torch.jit.trace``,
in functorch transforms, and with differentiable tables. A dispatch mode (``FakeTensorMode``, an operation counter)
sees the kernel as one custom op, ``distwgrad::rotary``.
"""

from __future__ import annotations

import torch

from distwgrad.ops.grouped_gemm import kernels_available

__all__ = ["rotate_halves", "rotate_halves_formula"]


def rotate_halves_formula(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation as torch operations in ``x``'s dtype (the reference, and the route under tracing)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class _Rotate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        from distwgrad.kernels import rotary

        ctx.save_for_backward(cos, sin)
        return rotary.rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, dy):
        from distwgrad.kernels import rotary

        cos, sin = ctx.saved_tensors
        return rotary.rotate(dy, cos, sin, inverse=True), None, None


def _fused_ok(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Eager mode (a dispatch mode, FakeTensorMode or a counter, sees the kernel's custom op), the kernel's
    device, tables without gradients; not under compile or ``torch.jit.trace`` (the formula fuses there), nor
    a functorch transform (the op has no batching rule)."""
    if torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None:
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None or cos.requires_grad or sin.requires_grad:
        return False
    return x.dim() == 4 and kernels_available(x)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, H, S, D]`` rotated by the angles whose ``cos`` and ``sin`` are ``[S, D / 2]``: the fused kernel
    (fp32 arithmetic, one rounding, a contiguous result) where it can run, else :func:`rotate_halves_formula`."""
    if _fused_ok(x, cos, sin):
        return _Rotate.apply(x, cos.contiguous(), sin.contiguous())
    return rotate_halves_formula(x, cos, sin)
