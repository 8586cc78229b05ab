"""FP8 recipes: which format, which scaling granularity, and which recipe is active.

A recipe is a frozen description, not a stateful object: the scales are recomputed from the tensor
being quantized every time ("current" or just-in-time scaling), so there is no amax history to keep
in sync across ranks, microbatches or re-materializations. That is what lets a sharded weight be
re-gathered in backward and re-quantized to the same bits it had in forward (the re-gather bug of
PRIOR_ART section 1: a bf16 shard under an FP8 recipe must be re-quantized, with the same scales).

Two recipes:

- ``PerTensorScaling``: one fp32 scale per tensor, ``scale = fp8_max / amax``. E4M3 (more mantissa)
  for forward tensors, E5M2 (more range) or E4M3 for gradients. A sharded weight's amax is all-reduced
  (MAX) across ranks before the scale is computed, so every rank quantizes with the same scale.
- ``BlockwiseScaling``: the DeepSeek-V3 recipe. Activations and gradients get one scale per 1x128
  tile along the GEMM's contraction dim; weights one per 128x128 block. A local outlier only costs
  precision inside its tile. Square weight blocks make the weight transpose exact: transposing the
  fp8 data and the scale grid IS the quantization of the transposed weight, so dgrad needs no
  re-quantization (``distwgrad.fp8.quantize.transpose_quantized``).

``fp8_autocast(recipe)`` makes a recipe active for the current thread / task (a ``ContextVar``);
modules read it with ``current_recipe()``. ``None`` means no FP8.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = [
    "Fp8Format", "fp8_format", "FP8_DTYPES",
    "MMParams", "PerTensorScaling", "BlockwiseScaling", "Recipe", "split_accumulator",
    "fp8_autocast", "current_recipe",
    "Format", "Float8CurrentScaling", "Float8BlockScaling", "DelayedScaling",
]


@dataclass(frozen=True)
class Fp8Format:
    """The constants of one float8 format that the quantizers need.

    Attributes:
        dtype: the torch float8 dtype.
        max: largest finite value (448 for E4M3FN, 57344 for E5M2).
        mantissa_bits: explicit mantissa bits (3 or 2). Round-to-nearest has relative error at most
            ``2 ** -(mantissa_bits + 1)`` for normal values.
        min_normal_exp: unbiased exponent of the smallest normal value (-6 or -14). Below
            ``2 ** min_normal_exp`` values are subnormal, spaced ``2 ** (min_normal_exp - mantissa_bits)``.
    """

    dtype: torch.dtype
    max: float
    mantissa_bits: int
    min_normal_exp: int

    @property
    def subnormal_step(self) -> float:
        """Spacing of the subnormal values (absolute rounding error is at most half of it)."""
        return 2.0 ** (self.min_normal_exp - self.mantissa_bits)


_FORMATS = {
    torch.float8_e4m3fn: Fp8Format(torch.float8_e4m3fn, 448.0, 3, -6),
    torch.float8_e5m2: Fp8Format(torch.float8_e5m2, 57344.0, 2, -14),
}
FP8_DTYPES = tuple(_FORMATS)


def fp8_format(dtype: torch.dtype) -> Fp8Format:
    """Returns the format constants of ``dtype``; ValueError for anything but E4M3FN / E5M2."""
    try:
        return _FORMATS[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"unsupported fp8 dtype {dtype!r}; expected one of {list(FP8_DTYPES)}") from None


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


@dataclass(frozen=True)
class PerTensorScaling:
    """Current (just-in-time) per-tensor scaling.

    ``scale = fp8_max * 2**-margin / amax`` in fp32 (``amax == 0`` gives scale 1), recomputed from
    the tensor every time it is quantized; see ``distwgrad.fp8.quantize.compute_scale`` for the exact
    arithmetic.

    Args:
        fwd_dtype: format of forward tensors (activations, weights). E4M3FN by default: 3 mantissa
            bits, range +-448.
        grad_dtype: format of gradients. E5M2 by default (range +-57344 for the wide dynamic range of
            gradients, 2 mantissa bits); E4M3FN is allowed.
        margin: extra headroom in powers of two, ``0 <= margin <= 16``; the scaled amax lands at
            ``fp8_max / 2**margin``.
        fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: accumulation of each GEMM (``MMParams``). All
            split (full fp32 promotion every 128 products) by default. TransformerEngine's
            ``Float8CurrentScaling`` defaults fprop to ``MMParams(use_split_accumulator=False)``; pass
            that here for the same trade (a faster fprop whose error grows with K).
    """

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


def _is_pow2(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1 and (v & (v - 1)) == 0


def _check_block(name: str, block: object) -> None:
    if not (isinstance(block, tuple) and len(block) == 2 and all(_is_pow2(b) for b in block)):
        raise ValueError(f"BlockwiseScaling.{name} must be a tuple of two powers of two, got {block!r}")


@dataclass(frozen=True)
class BlockwiseScaling:
    """DeepSeek-V3 blockwise scaling: 1x128 tiles for activations and gradients, 128x128 for weights.

    Each tile or block gets its own fp32 scale ``fp8_max / amax(block)``. With ``power_of_two=True``
    (the default, as TransformerEngine's blockwise recipe) the scale is rounded DOWN to a power of two:
    then ``x * scale`` and ``data * scale_inv`` are exact in fp32, the only error is the fp8 rounding,
    and re-quantizing a dequantized tensor reproduces its values exactly (a bf16 copy of an fp8
    weight, e.g. a re-gathered shard, re-quantizes losslessly). The price is up to one bit of fp8
    range left unused in each block.

    The weight transpose is exact because weight blocks are square (enforced): block ``(i, j)`` of
    ``W`` transposed is block ``(j, i)`` of ``W^T`` with the same amax, hence the same scale and the
    same fp8 bits. This holds with or without power-of-two scales.

    Args:
        act_block: tile of activations and gradients, ``(1, L)`` along the contraction dim, L a power
            of two >= 16.
        weight_block: square block ``(B, B)`` of weights, B a power of two >= 16.
        dtype: one format for all tensors (DeepSeek-V3 uses E4M3FN for gradients too; the small
            tiles provide the range that E5M2 would).
        power_of_two: round scales down to powers of two.
    """

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


Recipe = PerTensorScaling | BlockwiseScaling


# [Note: TransformerEngine's fp8_autocast]
# A TransformerEngine user swaps ``import transformer_engine.pytorch as te`` for ``import distwgrad.nn as
# te`` and ``from transformer_engine.common import recipe`` for ``from distwgrad.fp8 import recipe``; their
# FP8 tests then call ``te.fp8_autocast(enabled=..., fp8_recipe=recipe.Float8CurrentScaling(...))``. So
# ``fp8_autocast`` also takes TE's keywords (and TE's positional ``enabled``), and TE's recipe names are
# factories of our recipes, with TE's defaults: ``Float8CurrentScaling()`` is per-tensor current scaling
# whose fprop runs without the split accumulator (TE's choice; our ``PerTensorScaling()`` keeps it),
# ``Float8BlockScaling()`` the blockwise recipe. What we do not implement is refused by name:
# ``DelayedScaling`` (amax history), ``calibrating``, ``fp8_group``, E5M2-only or hybrid blockwise formats.


class Format(enum.Enum):
    """TransformerEngine's FP8 formats: (forward dtype, gradient dtype)."""

    E4M3 = (torch.float8_e4m3fn, torch.float8_e4m3fn)
    E5M2 = (torch.float8_e5m2, torch.float8_e5m2)
    HYBRID = (torch.float8_e4m3fn, torch.float8_e5m2)


def Float8CurrentScaling(fp8_format: Format = Format.HYBRID,  # noqa: N802 - TransformerEngine's name
                         fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False),
                         fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True),
                         fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True),
                         fp8_dpa: bool = False, fp8_mha: bool = False) -> PerTensorScaling:
    """TransformerEngine's current-scaling recipe, with its defaults, as a ``PerTensorScaling``
    ([Note: TransformerEngine's fp8_autocast])."""
    if not isinstance(fp8_format, Format):
        raise ValueError(f"Float8CurrentScaling: fp8_format must be a Format, got {fp8_format!r}")
    if fp8_dpa or fp8_mha:
        raise ValueError(f"Float8CurrentScaling: fp8_dpa={fp8_dpa}, fp8_mha={fp8_mha}: distwgrad has no "
                         f"attention; both must be False")
    fwd, grad = fp8_format.value
    return PerTensorScaling(fwd_dtype=fwd, grad_dtype=grad, fp8_gemm_fprop=fp8_gemm_fprop,
                            fp8_gemm_dgrad=fp8_gemm_dgrad, fp8_gemm_wgrad=fp8_gemm_wgrad)


def Float8BlockScaling(fp8_format: Format = Format.E4M3) -> BlockwiseScaling:  # noqa: N802
    """TransformerEngine's blockwise recipe (1x128 activation and gradient tiles, 128x128 weight
    blocks, E4M3, power-of-two scales) as a ``BlockwiseScaling``."""
    if fp8_format is not Format.E4M3:
        raise ValueError(f"Float8BlockScaling: fp8_format must be Format.E4M3 (one format for every tensor; "
                         f"the tiles give gradients their range), got {fp8_format!r}")
    return BlockwiseScaling()


def DelayedScaling(*args, **kwargs):  # noqa: N802 - TransformerEngine's name
    """Refused: delayed scaling keeps an amax history; use ``Float8CurrentScaling`` (per-tensor current
    scaling) or ``Float8BlockScaling``."""
    raise NotImplementedError("DelayedScaling is not implemented: distwgrad's recipes scale from the current "
                              "tensor (no amax history); use Float8CurrentScaling() or Float8BlockScaling()")


def split_accumulator(recipe: Recipe, gemm: str) -> bool:
    """Whether ``gemm`` ("fprop", "dgrad" or "wgrad") promotes its partial sums every 128 products under
    ``recipe``: the recipe's ``MMParams`` for per-tensor scaling, always for blockwise scaling (every
    block's dot is scaled before it is added)."""
    if gemm not in GEMMS:
        raise ValueError(f"split_accumulator: gemm must be one of {GEMMS}, got {gemm!r}")
    if isinstance(recipe, PerTensorScaling):
        return getattr(recipe, f"fp8_gemm_{gemm}").use_split_accumulator
    if isinstance(recipe, BlockwiseScaling):
        return True
    raise TypeError(f"split_accumulator: expected a PerTensorScaling or a BlockwiseScaling, got {recipe!r}")


_ACTIVE: contextvars.ContextVar[Recipe | None] = contextvars.ContextVar("distwgrad_fp8_recipe", default=None)


_UNSET = object()


@contextlib.contextmanager
def fp8_autocast(recipe: Recipe | None | bool | object = _UNSET, *, enabled: bool | None = None,
                 fp8_recipe: Recipe | None = None, calibrating: bool = False,
                 fp8_group: object = None) -> Iterator[Recipe | None]:
    """Makes ``recipe`` the active FP8 recipe inside the ``with`` block (``None``: FP8 off).

    Nested blocks restore the outer recipe on exit. The recipe lives in a ``ContextVar``: it is per
    thread and per asyncio task, and it is NOT seen by autograd's backward threads (CUDA backward runs
    on a device thread). Modules must read ``current_recipe()`` in forward and carry it into backward
    themselves (e.g. on the autograd ``ctx``).

    TransformerEngine's form works too ([Note: TransformerEngine's fp8_autocast]):
    ``fp8_autocast(enabled=True, fp8_recipe=recipe.Float8CurrentScaling())``, ``fp8_autocast(False)``, and
    ``fp8_autocast()`` (FP8 on with the default ``PerTensorScaling()``).

    Args:
        recipe: a ``PerTensorScaling``, a ``BlockwiseScaling`` or ``None``; a bool is TransformerEngine's
            positional ``enabled``.
        enabled: False turns FP8 off whatever the recipe; True with no recipe uses ``PerTensorScaling()``.
        fp8_recipe: TransformerEngine's name for ``recipe`` (give one of the two).
        calibrating, fp8_group: TransformerEngine's; only their defaults (False, None) are supported.

    Raises:
        TypeError: a recipe of another type.
        ValueError: ``recipe`` and ``fp8_recipe`` both given, or an ``fp8_group``.
        NotImplementedError: ``calibrating=True``.
    """
    if isinstance(recipe, bool):  # TransformerEngine's positional ``enabled``
        if enabled is not None:
            raise ValueError(f"fp8_autocast: enabled given twice ({recipe!r} and enabled={enabled!r})")
        enabled = bool(recipe)
        recipe = _UNSET
    if fp8_recipe is not None:
        if recipe is not _UNSET:
            raise ValueError(f"fp8_autocast: give the recipe once, as recipe or fp8_recipe; got {recipe!r} "
                             f"and {fp8_recipe!r}")
        recipe = fp8_recipe
    if calibrating:
        raise NotImplementedError("fp8_autocast: calibrating=True collects amaxes for delayed scaling; "
                                  "distwgrad's recipes scale from the current tensor and keep no amax history")
    if fp8_group is not None:
        raise ValueError("fp8_autocast: fp8_group is not supported: a sharded weight reduces its amax over "
                         "its own shard group, and activation scales are per rank (docs/fp8.md)")
    if enabled is False:
        recipe = None
    elif recipe is _UNSET or (enabled and recipe is None):  # TransformerEngine: enabled=True by default
        recipe = PerTensorScaling()
    if recipe is not None and not isinstance(recipe, PerTensorScaling | BlockwiseScaling):
        raise TypeError("fp8_autocast expects a PerTensorScaling, a BlockwiseScaling or None, "
                        f"got {recipe!r}")
    token = _ACTIVE.set(recipe)  # type: ignore[arg-type]
    try:
        yield recipe  # type: ignore[misc]
    finally:
        _ACTIVE.reset(token)


def current_recipe() -> Recipe | None:
    """The recipe of the innermost active ``fp8_autocast``, or ``None`` (no FP8)."""
    return _ACTIVE.get()
