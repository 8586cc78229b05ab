"""The Triton FP8 quantize kernels on the runtime's types: recipes in, ``Quantized`` / ``QuantizedExperts`` out.

Each function is the kernel twin of its namesake in ``distwgrad.fp8.quantize`` (same arguments, same bits). No
device dispatch here ([Note: fp8 gemm dispatch] in ``distwgrad/ops/grouped_gemm_fp8.py``); the kernel modules are
imported at the first call, so importing this module needs no Triton.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from distwgrad.fp8.quantize import Quantized, QuantizedExperts
from distwgrad.fp8.recipes import BlockwiseScaling, PerTensorScaling, Recipe, fp8_format

__all__ = ["quantize_per_tensor", "quantize_blockwise", "quantize_rowwise_and_columnwise",
           "quantize_weights_per_tensor", "quantize_weights_alike", "quantize_packed_per_tensor",
           "quantize_experts_blockwise"]


def quantize_per_tensor(x: torch.Tensor, dtype: torch.dtype, *, amax: torch.Tensor | None = None,
                        margin: int = 0) -> Quantized:
    """Kernel twin of ``distwgrad.fp8.quantize.quantize_per_tensor``. ``amax``: a one-element fp32 tensor on
    ``x``'s device (e.g. the shard group's MAX all-reduce), read on the device, never synced."""
    from distwgrad.kernels import quantize as kq
    fp8_format(dtype)
    data, scale_inv = kq.quantize_per_tensor(x, dtype, amax=amax, margin=margin)
    return Quantized(data, scale_inv, None, x.dtype, x.shape)


def quantize_blockwise(x: torch.Tensor, block: tuple[int, int], dtype: torch.dtype, *,
                       power_of_two: bool = True) -> Quantized:
    """Kernel twin of ``distwgrad.fp8.quantize.quantize_blockwise``; blocks must be powers of two."""
    from distwgrad.kernels import quantize as kq
    fp8_format(dtype)
    data, scale_inv = kq.quantize_blockwise(x, block, dtype, power_of_two=power_of_two)
    return Quantized(data, scale_inv, (int(block[0]), int(block[1])), x.dtype, x.shape)


def quantize_rowwise_and_columnwise(x: torch.Tensor, recipe: Recipe, *,
                                    grad: bool = False) -> tuple[Quantized, Quantized]:
    """Kernel twin of ``distwgrad.fp8.quantize.quantize_rowwise_and_columnwise``: both outputs from one read of
    ``x`` (per-tensor: after the amax pass). Raises TypeError for a family the kernels do not run."""
    from distwgrad.kernels import quantize as kq
    dtype = recipe.dtype_for(grad=grad)
    if recipe.family == "blockwise":  # the kernels' families: [Note: fp8 recipe objects]
        bw = cast(BlockwiseScaling, recipe)
        L = bw.act_block[1]
        data, s_inv, data_t, s_inv_t = kq.quantize_rowwise_and_columnwise(x, dtype, block=L,
                                                                          power_of_two=bw.power_of_two)
        return (Quantized(data, s_inv, (1, L), x.dtype, x.shape),
                Quantized(data_t, s_inv_t, (1, L), x.dtype, torch.Size((x.shape[1], x.shape[0]))))
    if recipe.family == "per_tensor":
        data, s_inv, data_t, _ = kq.quantize_rowwise_and_columnwise(x, dtype, block=0,
                                                                    margin=cast(PerTensorScaling, recipe).margin)
        return Quantized(data, s_inv, None, x.dtype, x.shape), Quantized(data_t, s_inv, None, x.dtype, data_t.shape)
    raise TypeError(f"the quantize kernels run the per-tensor and blockwise families, got {recipe!r}")


def quantize_weights_per_tensor(weights: Sequence[torch.Tensor], dtype: torch.dtype, *, margin: int = 0,
                                transpose: bool = False, shared: Sequence[int] | None = None,
                                amax: torch.Tensor | None = None) -> QuantizedExperts:
    """``kernels.weights_fp8.quantize_weights_per_tensor`` as one ``QuantizedExperts``: E alike ``[N, K]``
    weights per tensor ([Note: a group of weights in two launches])."""
    from distwgrad.kernels import weights_fp8 as kw
    data, scale_inv, amax = kw.quantize_weights_per_tensor(weights, dtype, margin=margin, transpose=transpose,
                                                           shared=shared, amax=amax)
    return QuantizedExperts(data, scale_inv, weights[0].dtype, amax)


def quantize_weights_alike(weights: Sequence[torch.Tensor], dtype: torch.dtype, *, margin: int = 0,
                           transpose: bool = False, shared: Sequence[int] | None = None,
                           amax: torch.Tensor | None = None) -> QuantizedExperts | None:
    """:func:`quantize_weights_per_tensor` where the weights are alike (one shape, dtype and device, each
    contiguous), else None (the caller quantizes each alone); a first weight the kernels cannot take raises."""
    from distwgrad.kernels import weights_fp8 as kw
    got = kw._quantize_alike(weights, dtype, margin=margin, transpose=transpose, shared=shared, amax=amax)
    if got is None:
        return None
    data, scale_inv, amax = got
    return QuantizedExperts(data, scale_inv, weights[0].dtype, amax)


def quantize_packed_per_tensor(w_ENK: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor, *, margin: int = 0,
                               transpose: bool = False) -> QuantizedExperts:
    """``kernels.weights_fp8.quantize_packed_per_tensor`` as one ``QuantizedExperts``: a packed ``[E, N, K]``
    weight with one amax (every expert's), one launch; stored ``[E, K, N]`` with ``transpose``."""
    from distwgrad.kernels import weights_fp8 as kw
    fp8_format(dtype)
    data, scale_inv = kw.quantize_packed_per_tensor(w_ENK, dtype, amax, margin=margin, transpose=transpose)
    return QuantizedExperts(data, scale_inv, w_ENK.dtype, amax.reshape(1).expand(w_ENK.shape[0]))


def quantize_experts_blockwise(w_ENK: torch.Tensor, recipe: BlockwiseScaling, *, transpose: bool = False
                               ) -> QuantizedExperts:
    """``kernels.weights_fp8.quantize_experts_blockwise`` as one ``QuantizedExperts``: a packed ``[E, N, K]`` weight
    in square blocks, one launch (``[E, K, N]`` with ``transpose``); each expert's bits as if quantized alone."""
    from distwgrad.kernels import weights_fp8 as kw
    fp8_format(recipe.dtype)
    data, scale_inv = kw.quantize_experts_blockwise(w_ENK, recipe.weight_block, recipe.dtype,
                                                    power_of_two=recipe.power_of_two, transpose=transpose)
    bm, bn = recipe.weight_block
    return QuantizedExperts(data, scale_inv, w_ENK.dtype, None, (bm, bn))
