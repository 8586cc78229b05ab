"""FP8 quantization in plain torch: the oracle of the Triton kernels and the CPU emulation path.

Legend: ``(bm, bn)`` a scaling block of a 2-D ``[M, N]`` tensor; ``gm, gn = ceil(M/bm), ceil(N/bn)`` the scale
grid. ``distwgrad.kernels.quantize`` must match this module bit for bit, so each step is one correctly rounded
IEEE fp32 operation (nothing fused or approximate):

[Note: fp8 scale arithmetic]
    amax      = max |x| over the tensor or block (valid elements only), fp32; +inf if any is NaN or +-inf
    s         = fl32(fp8_max * 2**-margin / amax)
    s         = min(max(s, 2**-126), FLT_MAX)               tiny amax -> FLT_MAX; 1/s stays finite
    s         = s with its mantissa bits cleared            only with power_of_two: round DOWN to 2**k
    s         = 1 where amax == 0 (all zeros, or empty); NaN where amax is not finite
    scale_inv = fl32(1 / s)
    data      = fp8_rne(clamp(fl32(x * s), -fp8_max, fp8_max))
    dequant   = fl32(fp32(data) * scale_inv)

[Note: fp8 saturation and non-finite policy]
Values scaled past fp8_max saturate to +-fp8_max, never inf; zeros keep their sign. A NaN or +-inf (or a
non-finite caller amax; amax must be >= 0) POISONS its scaling unit: scale, scale_inv and every fp8 value NaN,
so the overflow reaches the loss scaler instead of plausible numbers. No host sync, no exception, as in the
kernels; NaN bits are unspecified.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from distwgrad.fp8.formats import fp8_format

if TYPE_CHECKING:
    from distwgrad.fp8.recipes.base import Recipe

__all__ = [
    "Quantized", "compute_amax", "compute_scale", "quantize_per_tensor", "quantize_blockwise",
    "quantize_rowwise_and_columnwise", "dequantize", "transpose_quantized", "fp8_matmul_reference",
    "roundtrip_error_bound",
]

FLT_MAX = torch.finfo(torch.float32).max
FLT_MIN_NORMAL = 2.0**-126
_EXPONENT_MASK = 0x7F800000


@dataclass(frozen=True, eq=False)
class Quantized:
    """An FP8 tensor with its scales (TransformerEngine's ``Float8Tensor``). ``scale_inv``: fp32, 0-d with
    ``block=None`` (per tensor), else the ``[gm, gn]`` grid of ``block``; ``data`` has ``shape``, never padded."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int] | None
    orig_dtype: torch.dtype
    shape: torch.Size

    def __post_init__(self) -> None:
        fp8_format(self.data.dtype)
        if self.scale_inv.dtype != torch.float32:
            raise ValueError(f"Quantized.scale_inv must be float32, got {self.scale_inv.dtype}")
        if tuple(self.data.shape) != tuple(self.shape):
            raise ValueError(f"Quantized.data has shape {tuple(self.data.shape)}, "
                             f"expected {tuple(self.shape)}")
        expected = () if self.block is None else _grid(self.shape, self.block)
        if tuple(self.scale_inv.shape) != expected:
            raise ValueError(f"Quantized.scale_inv has shape {tuple(self.scale_inv.shape)}, expected "
                             f"{expected} for shape {tuple(self.shape)} and block {self.block}")


def _grid(shape: tuple[int, ...] | torch.Size, block: tuple[int, int]) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(f"blockwise scaling needs a 2-D tensor, got shape {tuple(shape)}")
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float64):
        raise ValueError(f"can only quantize float32/float16/bfloat16 tensors, got {x.dtype}")


def _nonfinite_to_inf(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(amax), math.inf, amax)


def compute_amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` as 0-d fp32 on ``x.device``, 0 if empty, +inf if ``x`` has a NaN or inf: a cross-rank MAX
    of NaN is undefined, +inf gives the same NaN scale. One reduction (the infinity norm): one read of ``x``."""
    _check_input(x)
    return _nonfinite_to_inf(_abs_max(x))


def _abs_max(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` as 0-d fp32, NaN kept (``compute_amax`` without its mapping; 0 if empty)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return torch.linalg.vector_norm(x, ord=math.inf).float()


def compute_scale(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0, *,
                  power_of_two: bool = False) -> torch.Tensor:
    """The fp32 scale(s) for ``amax`` (any shape, ``>= 0``) as [Note: fp8 scale arithmetic] says; ``margin``:
    headroom in powers of two; ``power_of_two``: round each scale down to a power of two."""
    fmt = fp8_format(dtype)
    amax = amax.float()
    scale = torch.full_like(amax, fmt.max * 2.0**-margin) / amax
    scale = torch.clamp(scale, min=FLT_MIN_NORMAL, max=FLT_MAX)
    if power_of_two:
        scale = (scale.view(torch.int32) & _EXPONENT_MASK).view(torch.float32)
    scale = torch.where(amax == 0, 1.0, scale)
    return torch.where(torch.isfinite(amax), scale, math.nan)


def _reciprocal(scale: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(scale) / scale


def _cast(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fmax = fp8_format(dtype).max
    return torch.clamp(y, -fmax, fmax).to(dtype)


def _as_amax(amax: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    if not isinstance(amax, torch.Tensor):
        return torch.tensor(float(amax), dtype=torch.float32, device=device)
    if amax.numel() != 1:
        raise ValueError(f"amax must hold one value, got shape {tuple(amax.shape)}")
    if amax.device != device:
        raise ValueError(f"amax is on {amax.device} but the tensor is on {device}")
    return amax.reshape(()).float()


def quantize_per_tensor(x: torch.Tensor, dtype: torch.dtype, *, amax: torch.Tensor | float | None = None,
                        margin: int = 0) -> Quantized:
    """Quantizes ``x`` (any shape) with one scale. ``amax`` replaces ``compute_amax(x)``: for a sharded weight, the
    MAX over its shard group, so that every rank's shard quantizes as in the full weight; a smaller one saturates."""
    _check_input(x)
    amax_t = compute_amax(x) if amax is None else _as_amax(amax, x.device)
    scale = compute_scale(amax_t, dtype, margin)
    data = _cast(x.float() * scale, dtype)
    return Quantized(data, _reciprocal(scale), None, x.dtype, x.shape)


def quantize_blockwise(x: torch.Tensor, block: tuple[int, int], dtype: torch.dtype, *,
                       power_of_two: bool = True) -> Quantized:
    """Quantizes a 2-D ``x_MN`` with one scale per ``block`` ``(bm, bn)``, e.g. ``(1, 128)`` or ``(128, 128)``;
    a partial edge block is scaled from its valid elements only. Flatten leading dims first."""
    _check_input(x)
    if not (isinstance(block, tuple) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        raise ValueError(f"block must be a tuple of two positive ints, got {block!r}")
    (gm, gn), (bm, bn) = _grid(x.shape, block), block
    M, N = x.shape
    x_pad = F.pad(x.float(), (0, gn * bn - N, 0, gm * bm - M))  # zeros never raise a max of |x|
    x_blk = x_pad.view(gm, bm, gn, bn)
    amax = _nonfinite_to_inf(x_blk.abs().amax(dim=(1, 3)))
    scale = compute_scale(amax, dtype, power_of_two=power_of_two)
    data = _cast(x_blk * scale[:, None, :, None], dtype).view(gm * bm, gn * bn)[:M, :N].contiguous()
    return Quantized(data, _reciprocal(scale), block, x.dtype, x.shape)


def quantize_rowwise_and_columnwise(x: torch.Tensor, recipe: Recipe, *,
                                    grad: bool = False) -> tuple[Quantized, Quantized]:
    """``(q_x, q_xt)``: ``x_MN`` and ``x^T_NM`` quantized along their rows, by ``recipe``'s method ([Note: fp8 recipe
    objects]). ``x^T`` (with 1xL tiles, scales of its own) is quantized from ``x``, never from its fp8 data."""
    from distwgrad.fp8.recipes.base import Recipe  # late: the recipes quantize with this module

    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be an FP8 Recipe, got {recipe!r}")
    return recipe.quantize_rowwise_and_columnwise(x, grad=grad)


def experts_of(q: Quantized, shape: torch.Size, *, block: tuple[int, int] | None) -> list[Quantized]:
    """Per-expert views of the quantization of a packed ``[E, N, K]`` weight taken as ``[E * N, K]``."""
    E, N, K = shape
    data = q.data.view(E, N, K)
    if block is None:
        return [Quantized(d, q.scale_inv, None, q.orig_dtype, d.shape) for d in data.unbind(0)]
    scales = q.scale_inv.view(E, N // block[0], -1)
    return [Quantized(d, s, block, q.orig_dtype, d.shape) for d, s in zip(data.unbind(0), scales.unbind(0))]


def _expanded_scale_inv(q: Quantized) -> torch.Tensor:
    if q.block is None:
        return q.scale_inv
    (bm, bn), (M, N) = q.block, q.shape
    return q.scale_inv.repeat_interleave(bm, 0)[:M].repeat_interleave(bn, 1)[:, :N]


@dataclass(frozen=True, eq=False)
class QuantizedExperts:
    """E ``[N, K]`` weights quantized per tensor or in square ``(B, B)`` blocks, stacked for a grouped GEMM: one
    object instead of E ``Quantized`` (at E=128 those cost more host time than the GEMMs), no stacking copies.
    ``data``: float8 ``[E, N, K]``, any strides; ``scale_inv``: fp32 ``[E]`` or ``[E, cdiv(N, B), cdiv(K, B)]``;
    ``amax``: fp32 ``[E]``, the per-tensor scales' amaxes (reusable while the weights are unchanged), or None."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    orig_dtype: torch.dtype
    amax: torch.Tensor | None = None
    block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        fp8_format(self.data.dtype)
        if self.data.dim() != 3:
            raise ValueError(f"QuantizedExperts: data must be [E, N, K], got {tuple(self.data.shape)}")
        E, N, K = self.data.shape
        grid: tuple[int, ...]
        if self.block is None:
            grid = (E,)
        elif (len(self.block) != 2 or self.block[0] != self.block[1] or not all(isinstance(b, int) and b > 0
                                                                                for b in self.block)):
            raise ValueError(f"QuantizedExperts.block must be None or a square (B, B), got {self.block!r}")
        else:
            grid = (E, -(-N // self.block[0]), -(-K // self.block[1]))
        if tuple(self.scale_inv.shape) != grid:
            raise ValueError(f"QuantizedExperts: data {tuple(self.data.shape)} with block {self.block} needs "
                             f"scale_inv {list(grid)}, got {tuple(self.scale_inv.shape)}")
        if self.scale_inv.dtype != torch.float32:
            raise ValueError(f"QuantizedExperts.scale_inv must be float32, got {self.scale_inv.dtype}")

    def __len__(self) -> int:
        return self.data.shape[0]

    def unbind(self) -> list[Quantized]:
        """One ``Quantized`` per expert (views)."""
        return [Quantized(d, s, self.block, self.orig_dtype, d.shape) for d, s in zip(self.data, self.scale_inv)]


def dequantize(q: Quantized, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``fp32(data) * scale_inv`` (per element's block), cast to ``dtype`` (default ``q.orig_dtype``)."""
    out = q.data.float() * _expanded_scale_inv(q)
    return out.to(q.orig_dtype if dtype is None else dtype)


def transpose_quantized(q: Quantized) -> Quantized:
    """The quantization of ``x^T`` from that of ``x`` by moving bits: exact, no re-quantization. Square weight
    blocks keep the recipe's layout, which is why ``BlockwiseScaling`` requires them (dgrad reads W, forward W^T)."""
    _grid(q.shape, (1, 1))
    scale_inv = q.scale_inv if q.block is None else q.scale_inv.t().contiguous()
    block = None if q.block is None else (q.block[1], q.block[0])
    return Quantized(q.data.t().contiguous(), scale_inv, block, q.orig_dtype, torch.Size(q.shape[::-1]))


def fp8_matmul_reference(a_q: Quantized, b_q: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """Emulated FP8 GEMM ``y_MN = a_MK @ b_KN``: the fp32 product of the dequantized operands, so its error is
    the quantization's alone (turn TF32 off on CUDA). For ``x @ W^T`` pass ``transpose_quantized(w_q)``."""
    if len(a_q.shape) != 2 or len(b_q.shape) != 2 or a_q.shape[1] != b_q.shape[0]:
        raise ValueError(f"fp8_matmul_reference needs [M, K] @ [K, N], got {tuple(a_q.shape)} @ "
                         f"{tuple(b_q.shape)}")
    a = dequantize(a_q, dtype=torch.float32)
    b = dequantize(b_q, dtype=torch.float32)
    return (a @ b).to(out_dtype)


def roundtrip_error_bound(x: torch.Tensor, q: Quantized) -> torch.Tensor:
    """Elementwise float64 bound on ``|x - dequantize(q, dtype=float32)|``, THE quantization tolerance: half an fp8
    ulp, half a subnormal step over the scale, fp32 slack. For finite ``x``, quantized without saturation."""
    fmt = fp8_format(q.data.dtype)
    s_inv = _expanded_scale_inv(q).double()
    ax = x.double().abs()
    return (ax * 2.0 ** -(fmt.mantissa_bits + 1) + 0.5 * fmt.subnormal_step * s_inv) * (1 + 2.0**-20) \
        + ax * 2.0**-21
