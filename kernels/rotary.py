"""``rotate(x, cos, sin)``: a rotary position embedding in one pass over ``x``.

[Note: rotary in one pass]
The model rotates each head's halves: ``y1 = x1 cos - x2 sin``, ``y2 = x1 sin + x2 cos`` (``distwgrad.ops.rotary``).
In eager mode torch runs that formula as six elementwise kernels and a ``cat`` over strided views of the qkv
projection, each rounding to the activations' dtype; at the ``large`` preset on an H100 those kernels took 16 ms
of a 118 ms bf16 step (docs/benchmarks/LOG.md). This kernel reads ``x`` (any strides) and the tables once,
computes in fp32, rounds once, and writes a contiguous result: what inductor's fused kernel does in compiled
mode. Backward is the rotation by the opposite angle (``inverse=True``: ``sin`` negated, exact in fp32).
"""

import torch
import triton
import triton.language as tl

from ._context import ensure_context
from ._dispatch import call
from ._host import cdiv, next_pow2
from ._launch import launch

__all__ = ["rotate"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, H, S, HALF, sxb, sxh, sxs, sxd,
                   SIGN: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_bh = tl.program_id(0)
    b, h = pid_bh // H, pid_bh % H
    offs_s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_s[:, None] < S) & (offs_d[None, :] < HALF)
    x_row = x_ptr + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + offs_s[:, None].to(tl.int64) * sxs
    x1 = tl.load(x_row + offs_d[None, :] * sxd, mask=mask).to(tl.float32)
    x2 = tl.load(x_row + (offs_d[None, :] + HALF) * sxd, mask=mask).to(tl.float32)
    table = offs_s[:, None] * HALF + offs_d[None, :]
    c = tl.load(cos_ptr + table, mask=mask).to(tl.float32)
    s = tl.load(sin_ptr + table, mask=mask).to(tl.float32) * SIGN
    y_row = y_ptr + (pid_bh.to(tl.int64) * S + offs_s[:, None]) * (2 * HALF)
    tl.store(y_row + offs_d[None, :], (x1 * c - x2 * s).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_row + offs_d[None, :] + HALF, (x1 * s + x2 * c).to(y_ptr.dtype.element_ty), mask=mask)


def _impl(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    B, H, S, D = x.shape
    y = torch.empty((B, H, S, D), dtype=x.dtype, device=x.device)
    block_s = 32  # positions a program rotates: with 64-wide halves, 4096 elements in and out over 4 warps
    if y.numel():
        ensure_context(x.device)  # [Note: a current context on any thread] in _context.py
        launch(_rotary_kernel, (B * H, cdiv(S, block_s)), x, cos, sin, y, H, S, D // 2, *x.stride(),
               SIGN=-1.0 if inverse else 1.0, BLOCK_S=block_s, BLOCK_D=next_pow2(D // 2), num_warps=4)
    return y


_op = torch.library.custom_op("distwgrad::rotary", _impl, mutates_args=())


@_op.register_fake
def _(x, cos, sin, inverse):
    return x.new_empty(x.shape)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """``x`` ``[B, H, S, D]`` (any strides) rotated by the angles whose ``cos`` and ``sin`` are ``[S, D / 2]``
    (contiguous): ``cat([x1 cos - x2 sin, x1 sin + x2 cos], -1)`` with ``x1, x2`` the halves of the last dim,
    computed in fp32 and returned contiguous in ``x``'s dtype; ``inverse``: by the opposite angles."""
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"rotate: x must be [B, H, S, D] with an even D, got shape {tuple(x.shape)}")
    B, H, S, D = x.shape
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (S, D // 2) or not t.is_contiguous() or t.device != x.device:
            raise ValueError(f"rotate: {name} must be a contiguous [S, D / 2] = [{S}, {D // 2}] tensor on "
                             f"{x.device}, got shape {tuple(t.shape)}, strides {t.stride()} on {t.device}")
    if x.dtype not in _DTYPES or cos.dtype not in _DTYPES or sin.dtype not in _DTYPES:
        raise ValueError(f"rotate: x, cos and sin must be bf16, fp16 or fp32, got {x.dtype}, {cos.dtype}, "
                         f"{sin.dtype}")
    return call(torch.ops.distwgrad.rotary, _impl, x, cos, sin, inverse)
