"""What every FP8 recipe is: the ``Recipe`` base class and how a GEMM accumulates (``MMParams``).

[Note: fp8 recipe objects]
A recipe is one frozen object that says how tensors are quantized and how the FP8 GEMMs accumulate; modules,
weights and GEMMs call its methods and never ask which recipe it is. ``family`` names the scaling that the
Triton kernels and the weights' fast paths implement ("per_tensor", "blockwise"); a recipe of family None runs
through its own methods and the emulated GEMMs ([Note: fp8 gemm dispatch]). A new recipe is one file here and
a registry line. Recipes hold no state: scales come from the tensor itself, so no amax history must agree.
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
    """How one FP8 GEMM accumulates (TransformerEngine's name): ``use_split_accumulator`` promotes the partial sums
    to fp32 every 128 products, else Hopper accumulates at its ~13-mantissa-bit fp8-MMA precision (faster). CPU
    emulation is exact fp32 either way. [Note: fp8 split accumulator] in ``kernels/grouped_gemm_fp8.py``."""

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
        """A weight ``[N, K]`` (one entry) or packed ``[E, N, K]`` (one per expert). ``amax``: the whole weight's;
        ``quantizers``: ``(per_tensor, blockwise, kernels)`` to quantize with (kernels' or reference: same bits)."""

    def quantize_sharded(self, w: ShardedWeight) -> list[Quantized]:
        """A ``ShardedWeight``'s full weight quantized from its all-gathered value at every use (never kept: [Note:
        weight lifecycle]); the built-in recipes quantize before the gather ([Note: fp8 distributed weights])."""
        from distwgrad.protocol import materialize_weight_for_forward

        return self.quantize_weight(materialize_weight_for_forward([w])[0])
