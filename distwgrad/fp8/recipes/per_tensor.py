"""``PerTensorScaling``: one fp32 scale per tensor, from its current amax ([Note: fp8 recipe objects])."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from distwgrad.fp8.formats import _FORMATS, FP8_DTYPES
from distwgrad.fp8.quantize import (
    Quantized,
    _grid,
    compute_amax,
    compute_scale,
    experts_of,
    quantize_blockwise,
    quantize_per_tensor,
    transpose_quantized,
)
from distwgrad.fp8.recipes.base import GEMMS, MMParams, Recipe

if TYPE_CHECKING:
    from distwgrad.weights.sharded import ShardedWeight

__all__ = ["PerTensorScaling"]


@dataclass(frozen=True)
class PerTensorScaling(Recipe):
    """Current (just-in-time) per-tensor scaling: ``scale = fp8_max * 2**-margin / amax`` in fp32 (amax 0: scale
    1), recomputed at every quantization (the exact arithmetic: ``distwgrad.fp8.quantize.compute_scale``).

    Args:
        fwd_dtype: format of activations and weights (E4M3FN: range +-448, 3 mantissa bits).
        grad_dtype: format of gradients (E5M2: range +-57344, 2 mantissa bits; E4M3FN allowed).
        margin: headroom in powers of two, ``0 <= margin <= 16``.
        fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: each GEMM's ``MMParams``; all split (fp32 promotion
            every 128 products) by default. ``MMParams(use_split_accumulator=False)`` for fprop, as in TE's
            ``Float8CurrentScaling``, gives a faster fprop whose error grows with K.
    """

    family: ClassVar[str | None] = "per_tensor"

    fwd_dtype: torch.dtype = torch.float8_e4m3fn
    grad_dtype: torch.dtype = torch.float8_e5m2
    margin: int = 0
    fp8_gemm_fprop: MMParams = MMParams()
    fp8_gemm_dgrad: MMParams = MMParams()
    fp8_gemm_wgrad: MMParams = MMParams()

    def __post_init__(self) -> None:
        for name in ("fwd_dtype", "grad_dtype"):
            value = getattr(self, name)
            if value not in _FORMATS:
                raise ValueError(f"PerTensorScaling.{name} must be one of {list(FP8_DTYPES)}, got {value!r}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or not 0 <= self.margin <= 16:
            raise ValueError(f"PerTensorScaling.margin must be an int in [0, 16], got {self.margin!r}")
        for gemm in GEMMS:
            value = getattr(self, f"fp8_gemm_{gemm}")
            if not isinstance(value, MMParams):
                raise ValueError(f"PerTensorScaling.fp8_gemm_{gemm} must be an MMParams, got {value!r}")

    def dtype_for(self, *, grad: bool) -> torch.dtype:
        """The format for a gradient (``grad=True``) or a forward tensor."""
        return self.grad_dtype if grad else self.fwd_dtype

    def split_accumulator(self, gemm: str) -> bool:
        """The recipe's ``MMParams`` for ``gemm``."""
        return getattr(self, f"fp8_gemm_{gemm}").use_split_accumulator

    def quantize_rowwise_and_columnwise(self, x: torch.Tensor, *, grad: bool) -> tuple[Quantized, Quantized]:
        """One scale for ``x``; ``x^T`` is the transposed data with the same scale."""
        _grid(x.shape, (1, 1))
        q = quantize_per_tensor(x, self.dtype_for(grad=grad), margin=self.margin)
        return q, transpose_quantized(q)

    def quantize_weight(self, w: torch.Tensor, *, amax: torch.Tensor | None = None,
                        quantizers: tuple[Callable, Callable, bool] | None = None) -> list[Quantized]:
        """One amax for the whole tensor (``amax`` if given: the group-wide one)."""
        per_tensor, _, kernels = quantizers or (quantize_per_tensor, quantize_blockwise, False)
        amax = compute_amax(w) if amax is None else amax
        if kernels:
            amax = amax.reshape(1)
        if w.dim() == 3 and w.shape[0] and w.is_contiguous():  # elementwise given the amax: one pass
            q = per_tensor(w.reshape(-1, w.shape[2]), self.fwd_dtype, amax=amax, margin=self.margin)
            return experts_of(q, w.shape, block=None)
        mats = [w] if w.dim() == 2 else list(w.unbind(0))
        return [per_tensor(m.contiguous() if kernels else m, self.fwd_dtype, amax=amax, margin=self.margin)
                for m in mats]

    def quantize_sharded(self, w: ShardedWeight) -> list[Quantized]:
        """Quantized with the global amax (one MAX all-reduce, kept for the step), then the FP8 bytes gathered:
        the bits of quantizing the full weight."""
        from distwgrad.fp8.weights import gather_fp8, global_amax, quantize_weight  # late: it imports this

        local = w.detach()
        amax = global_amax(w)
        qs = quantize_weight(local, self, amax=amax)
        if len(w.shard_rows) == 1:
            return qs
        if local.dim() == 2:
            return [Quantized(gather_fp8(qs[0].data, w), qs[0].scale_inv, None, w.dtype, w.full_shape)]
        stacked = torch.stack([q.data for q in qs]) if qs else local.new_empty(local.shape, dtype=self.fwd_dtype)
        data = gather_fp8(stacked, w)
        scale = compute_scale(amax, self.fwd_dtype, self.margin)
        scale_inv = torch.ones_like(scale) / scale  # the same fp32 division as quantize_per_tensor
        return [Quantized(d, scale_inv, None, w.dtype, d.shape) for d in data.unbind(0)]
