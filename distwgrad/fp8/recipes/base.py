"""What every FP8 recipe is: the ``Recipe`` base class, the float8 formats and a GEMM's accumulation.

[Note: fp8 recipe objects]
A recipe is one frozen object that says how tensors are quantized and how the FP8 GEMMs accumulate; the
modules, the weights and the GEMMs call its methods and never ask which recipe it is:

* ``dtype_for(grad=)``: the float8 format of a forward tensor or a gradient;
* ``split_accumulator(gemm)``: whether ``gemm`` ("fprop", "dgrad", "wgrad") promotes its partial sums;
* ``quantize_rowwise_and_columnwise(x, grad=)``: an activation or gradient ``x`` [M, N] quantized along its
  rows and ``x^T`` along its rows, the torch reference (the kernels give the same bits);
* ``quantize_weight(w, amax=, quantizers=)``: a weight [N, K] (or packed [E, N, K]) as one ``Quantized``
  per matrix;
* ``quantize_sharded(w)``: a ``ShardedWeight``'s full weight quantized, by default from its all-gathered
  value (a recipe may quantize before the gather, as both built-in ones do: [Note: fp8 distributed weights]).

``family`` names the scaling the Triton kernels and the weights' fast paths implement ("per_tensor",
"blockwise"); a recipe of another family (None) runs through its own methods and the emulated GEMMs
(dequantized operands, an fp32 GEMM: [Note: fp8 gemm dispatch]), on any device. One file per recipe in
this package and a line in its registry (``distwgrad.fp8.recipes``) make a recipe; ``fp8_autocast`` takes
any ``Recipe``. A recipe has no state: the scales are recomputed from the tensor every time it is
quantized (current scaling), so there is no amax history to keep in sync across ranks, microbatches or
re-materializations.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from distwgrad.fp8.quantize import Quantized
    from distwgrad.weights.sharded import ShardedWeight

__all__ = ["Recipe", "MMParams", "GEMMS"]


@dataclass(frozen=True)
class MMParams:
    """How one FP8 GEMM accumulates (TransformerEngine's name and field).

    Args:
        use_split_accumulator: promote the tensor cores' partial sums to an fp32 accumulator every 128
            products (True), or let Hopper accumulate the whole contraction at its reduced fp8-MMA
            precision (~13 mantissa bits; faster). [Note: fp8 split accumulator] in
            ``distwgrad/kernels/grouped_gemm_fp8.py``. CPU emulation is exact fp32 either way.
    """

    use_split_accumulator: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.use_split_accumulator, bool):
            raise ValueError(f"MMParams.use_split_accumulator must be a bool, got {self.use_split_accumulator!r}")


GEMMS = ("fprop", "dgrad", "wgrad")


class Recipe(abc.ABC):
    """An FP8 recipe: [Note: fp8 recipe objects]. Subclasses are frozen dataclasses."""

    family: ClassVar[str | None] = None  # the kernels' and fast paths' scaling, or None: emulated

    # TransformerEngine's recipe predicates, which TE's tests branch on
    def float8_per_tensor_scaling(self) -> bool:
        return self.family == "per_tensor"

    float8_current_scaling = float8_per_tensor_scaling

    def float8_block_scaling(self) -> bool:
        return self.family == "blockwise"

    def delayed(self) -> bool:
        return False

    mxfp8 = nvfp4 = delayed

    def custom(self) -> bool:
        return self.family is None

    @abc.abstractmethod
    def dtype_for(self, *, grad: bool) -> torch.dtype:
        """The float8 format of a gradient (``grad=True``) or of a forward tensor."""

    @abc.abstractmethod
    def split_accumulator(self, gemm: str) -> bool:
        """Whether ``gemm`` ("fprop", "dgrad", "wgrad") promotes its partial sums to fp32 every 128 products."""

    @abc.abstractmethod
    def quantize_rowwise_and_columnwise(self, x: torch.Tensor, *, grad: bool) -> tuple[Quantized, Quantized]:
        """``(q_x, q_xt)``: ``x`` [M, N] quantized along its rows, and ``x^T`` [N, M] along its rows."""

    @abc.abstractmethod
    def quantize_weight(self, w: torch.Tensor, *, amax: torch.Tensor | None = None,
                        quantizers: tuple[Callable, Callable, bool] | None = None) -> list[Quantized]:
        """A weight ``[N, K]`` (one entry) or packed ``[E, N, K]`` (one per expert). ``amax``: the whole
        weight's, where the recipe scales by it; ``quantizers``: ``(quantize_per_tensor,
        quantize_blockwise, kernels)`` to quantize with (the kernels' or the reference's: the same bits)."""

    def quantize_sharded(self, w: ShardedWeight) -> list[Quantized]:
        """The full weight of a ``ShardedWeight`` quantized: from its all-gathered value, re-gathered at
        every use (never kept: [Note: weight lifecycle])."""
        from distwgrad.protocol import materialize_weight_for_forward

        return self.quantize_weight(materialize_weight_for_forward([w])[0])
