"""``BlockwiseScaling``: DeepSeek-V3's tiles and square weight blocks ([Note: fp8 recipe objects])."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from distwgrad.fp8.formats import _FORMATS, FP8_DTYPES
from distwgrad.fp8.quantize import Quantized, _cast, experts_of, quantize_blockwise, quantize_per_tensor
from distwgrad.fp8.recipes.base import Recipe

if TYPE_CHECKING:
    from distwgrad.weights.sharded import ShardedWeight

__all__ = ["BlockwiseScaling"]


def _is_pow2(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1 and (v & (v - 1)) == 0


def _check_block(name: str, block: object) -> None:
    if not (isinstance(block, tuple) and len(block) == 2 and all(_is_pow2(b) for b in block)):
        raise ValueError(f"BlockwiseScaling.{name} must be a tuple of two powers of two, got {block!r}")


@dataclass(frozen=True)
class BlockwiseScaling(Recipe):
    """DeepSeek-V3 blockwise scaling: 1x128 tiles for activations and gradients, 128x128 blocks for weights.

    Each block gets its own fp32 scale ``fp8_max / amax(block)``. ``power_of_two`` (default, as in
    TransformerEngine) rounds it down to a power of two: scaling is then exact in fp32 and re-quantizing a
    dequantized tensor (e.g. a re-gathered bf16 shard) is lossless, at up to one bit of unused range. Square
    weight blocks make the weight transpose exact (each block keeps its amax, scale and bits).

    Args:
        act_block: ``(1, L)`` tile along the contraction dim, L a power of two >= 16.
        weight_block: square ``(B, B)`` block, B a power of two >= 16.
        dtype: one format for all tensors (E4M3FN: the small tiles give gradients their range).
        power_of_two: round scales down to powers of two.
    """

    family: ClassVar[str | None] = "blockwise"

    act_block: tuple[int, int] = (1, 128)
    weight_block: tuple[int, int] = (128, 128)
    dtype: torch.dtype = torch.float8_e4m3fn
    power_of_two: bool = True

    def __post_init__(self) -> None:
        _check_block("act_block", self.act_block)
        _check_block("weight_block", self.weight_block)
        if self.act_block[0] != 1 or self.act_block[1] < 16:
            raise ValueError(f"BlockwiseScaling.act_block must be (1, L) with L >= 16, "
                             f"got {self.act_block!r}")
        bm, bn = self.weight_block
        if bm != bn or bm < 16:
            raise ValueError("BlockwiseScaling.weight_block must be square (the exact weight transpose needs "
                             f"it) with side >= 16, got {self.weight_block!r}")
        if self.dtype not in _FORMATS:
            raise ValueError(f"BlockwiseScaling.dtype must be one of {list(FP8_DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.power_of_two, bool):
            raise ValueError(f"BlockwiseScaling.power_of_two must be a bool, got {self.power_of_two!r}")

    def dtype_for(self, *, grad: bool) -> torch.dtype:
        """The format for a gradient or a forward tensor: the same one in this recipe."""
        del grad
        return self.dtype

    def split_accumulator(self, gemm: str) -> bool:
        """Always: every block's dot is scaled before it is added."""
        del gemm
        return True

    def quantize_rowwise_and_columnwise(self, x: torch.Tensor, *, grad: bool) -> tuple[Quantized, Quantized]:
        """``act_block`` tiles along N for ``x`` and along M for ``x^T``, each from the original values."""
        dtype = self.dtype_for(grad=grad)
        return (quantize_blockwise(x, self.act_block, dtype, power_of_two=self.power_of_two),
                quantize_blockwise(x.t(), self.act_block, dtype, power_of_two=self.power_of_two))

    def quantize_weight(self, w: torch.Tensor, *, amax: torch.Tensor | None = None,
                        quantizers: tuple[Callable, Callable, bool] | None = None) -> list[Quantized]:
        """``weight_block`` blocks per matrix (``amax`` unused: each block has its own)."""
        del amax
        _, blockwise, kernels = quantizers or (quantize_per_tensor, quantize_blockwise, False)
        bm = self.weight_block[0]
        if w.dim() == 3 and w.shape[0] and w.shape[1] % bm == 0 and w.is_contiguous():
            # no block straddles two experts, so the stacked rows quantize as each expert alone: one pass
            q = blockwise(w.reshape(-1, w.shape[2]), self.weight_block, self.dtype, power_of_two=self.power_of_two)
            return experts_of(q, w.shape, block=self.weight_block)
        mats = [w] if w.dim() == 2 else list(w.unbind(0))
        return [blockwise(m.contiguous() if kernels else m, self.weight_block, self.dtype,
                          power_of_two=self.power_of_two) for m in mats]

    def quantize_sharded(self, w: ShardedWeight) -> list[Quantized]:
        """Quantized before the gather (experts on their own grids, a matrix on the full weight's block scales,
        blocks straddling ranks combining partial amaxes), then the FP8 bytes gathered."""
        from distwgrad.fp8.weights import gather_fp8, global_block_scales, quantize_weight  # late: it imports this

        local = w.detach()
        if len(w.shard_rows) == 1:
            return quantize_weight(local, self)
        if local.dim() == 3:  # experts are whole on one rank: gather data and each expert's grid
            qs = quantize_weight(local, self)
            _, N, K = w.full_shape
            grid = (-(-N // self.weight_block[0]), -(-K // self.weight_block[1]))
            data = gather_fp8(torch.stack([q.data for q in qs]) if qs else
                              local.new_empty(local.shape, dtype=self.dtype), w)
            scales = torch.stack([q.scale_inv for q in qs]) if qs else local.new_empty(0, *grid, dtype=torch.float32)
            scales = w.gather_rows(scales)
            return [Quantized(d, s, self.weight_block, w.dtype, d.shape)
                    for d, s in zip(data.unbind(0), scales.unbind(0))]
        scale = global_block_scales(w, self)
        bm = self.weight_block[0]
        rows = torch.arange(w.shard_offset, w.shard_offset + local.shape[0], device=local.device) // bm
        cols = torch.arange(local.shape[1], device=local.device) // self.weight_block[1]
        # The same fp32 multiply, clamp and cast as quantize_blockwise on the full weight: identical bits.
        data = _cast(local.float() * scale[rows][:, cols], self.dtype)
        scale_inv = torch.ones_like(scale) / scale
        return [Quantized(gather_fp8(data, w), scale_inv, self.weight_block, w.dtype, w.full_shape)]
