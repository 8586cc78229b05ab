"""FP8 recipes: the active one (``fp8_autocast``, ``current_recipe``) and TransformerEngine's names for them.

The recipes, ``PerTensorScaling`` and ``BlockwiseScaling`` (DeepSeek-V3's 1x128 tiles, 128x128 weight blocks),
are objects of ``distwgrad.fp8.recipes`` ([Note: fp8 recipe objects]; docs/fp8.md), re-exported here. Every
recipe scales from the tensor it quantizes, so a weight re-gathered in backward gets its forward bits.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Iterator

import torch

from distwgrad.fp8.recipes import (
    FP8_DTYPES,
    GEMMS,
    BlockwiseScaling,
    Fp8Format,
    MMParams,
    PerTensorScaling,
    Recipe,
    fp8_format,
)

__all__ = [
    "Fp8Format", "fp8_format", "FP8_DTYPES",
    "MMParams", "PerTensorScaling", "BlockwiseScaling", "Recipe", "split_accumulator",
    "fp8_autocast", "autocast", "current_recipe", "microbatch", "current_first_microbatch",
    "Format", "Float8CurrentScaling", "Float8BlockScaling", "DelayedScaling",
]


# [Note: TransformerEngine's fp8_autocast]
# A TE user swaps ``transformer_engine.pytorch`` for ``distwgrad.nn`` and ``transformer_engine.common.recipe`` for
# ``distwgrad.fp8.recipe``. So ``fp8_autocast`` takes TE's keywords (and positional ``enabled``), and TE's recipe
# names are factories of our recipes with TE's defaults (``Float8CurrentScaling()`` runs fprop without the split
# accumulator; our ``PerTensorScaling()`` keeps it). What we lack is refused by name: ``DelayedScaling``,
# ``calibrating``, ``fp8_group``, E5M2-only or hybrid blockwise formats.


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
    """TransformerEngine's blockwise recipe (E4M3 everywhere, power-of-two scales): ``BlockwiseScaling()``."""
    if fp8_format is not Format.E4M3:
        raise ValueError(f"Float8BlockScaling: fp8_format must be Format.E4M3 (one format for every tensor; "
                         f"the tiles give gradients their range), got {fp8_format!r}")
    return BlockwiseScaling()


class DelayedScaling:
    """TransformerEngine's delayed-scaling recipe: it builds and answers TE's predicates (a TE test's recipe
    list may hold one), but ``fp8_autocast`` refuses it: distwgrad keeps no amax history."""

    def __init__(self, *args, **kwargs) -> None:
        self.args, self.kwargs = args, kwargs

    def delayed(self) -> bool:
        return True

    def float8_per_tensor_scaling(self) -> bool:
        return True

    def float8_current_scaling(self) -> bool:
        return False

    float8_block_scaling = mxfp8 = nvfp4 = custom = float8_current_scaling

    def __repr__(self) -> str:
        return "DelayedScaling()"


def split_accumulator(recipe: Recipe, gemm: str) -> bool:
    """Whether ``gemm`` ("fprop", "dgrad" or "wgrad") promotes its partial sums to fp32 every 128 products
    under ``recipe`` (always under blockwise scaling)."""
    if gemm not in GEMMS:
        raise ValueError(f"split_accumulator: gemm must be one of {GEMMS}, got {gemm!r}")
    if not isinstance(recipe, Recipe):
        raise TypeError(f"split_accumulator: expected an FP8 Recipe, got {recipe!r}")
    return recipe.split_accumulator(gemm)


_ACTIVE: contextvars.ContextVar[Recipe | None] = contextvars.ContextVar("distwgrad_fp8_recipe", default=None)


_UNSET = object()


@contextlib.contextmanager
def fp8_autocast(recipe: Recipe | None | bool | object = _UNSET, *, enabled: bool | None = None,
                 fp8_recipe: Recipe | None = None, calibrating: bool = False,
                 fp8_group: object = None) -> Iterator[Recipe | None]:
    """Makes ``recipe`` the active FP8 recipe inside the ``with`` block (``None``: FP8 off); nesting restores.
    It lives in a ``ContextVar`` (per thread and task) that autograd's backward threads do NOT see: modules read
    ``current_recipe()`` in forward and carry it into backward on the autograd ``ctx``.

    Args:
        recipe: a ``Recipe`` or ``None``; a bool is TransformerEngine's positional ``enabled``.
        enabled: False turns FP8 off; True with no recipe (or no argument at all) uses ``PerTensorScaling()``.
        fp8_recipe, calibrating, fp8_group: TransformerEngine's ([Note: TransformerEngine's fp8_autocast]):
            ``recipe`` by another name; the other two only at their defaults (False, None).

    Raises:
        TypeError: a recipe of another type.
        ValueError: the recipe or ``enabled`` given twice, or an ``fp8_group``.
        NotImplementedError: ``calibrating=True``, or an enabled ``DelayedScaling``.
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
    if isinstance(recipe, DelayedScaling) and enabled is not False:
        raise NotImplementedError("DelayedScaling is not implemented: distwgrad's recipes scale from the current "
                                  "tensor (no amax history); use Float8CurrentScaling() or Float8BlockScaling()")
    if enabled is False:
        recipe = None
    elif recipe is _UNSET or (enabled and recipe is None):  # TransformerEngine: enabled=True by default
        recipe = PerTensorScaling()
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"fp8_autocast expects an FP8 Recipe (PerTensorScaling, BlockwiseScaling, ...) or None, "
                        f"got {recipe!r}")
    token = _ACTIVE.set(recipe)  # type: ignore[arg-type]
    try:
        yield recipe  # type: ignore[misc]
    finally:
        _ACTIVE.reset(token)


def autocast(enabled: bool = True, calibrating: bool = False, recipe: Recipe | None = None,
             amax_reduction_group: object = None) -> contextlib.AbstractContextManager[Recipe | None]:
    """TransformerEngine 2's name and signature for ``fp8_autocast``: ``autocast(recipe=...)``. Raises what
    ``fp8_autocast`` raises, and ValueError for an ``amax_reduction_group`` (weights reduce over their own)."""
    if amax_reduction_group is not None:
        raise ValueError(f"autocast: amax_reduction_group={amax_reduction_group!r} is not supported: a sharded "
                         f"weight reduces its amax over its own shard group, and activation scales are per rank")
    return fp8_autocast(_UNSET if recipe is None else recipe, enabled=bool(enabled), calibrating=calibrating)


def current_recipe() -> Recipe | None:
    """The recipe of the innermost active ``fp8_autocast``, or ``None`` (no FP8)."""
    return _ACTIVE.get()


_FIRST: contextvars.ContextVar[bool | None] = contextvars.ContextVar("distwgrad_fp8_first_microbatch", default=None)


@contextlib.contextmanager
def microbatch(*, first: bool) -> Iterator[None]:
    """Module calls inside given no ``is_first_microbatch`` take ``first`` ([Note: fp8 weights kept across
    microbatches] in ``distwgrad/fp8/weights.py``), read when the module runs as the recipe is: so a compiled
    region traces no argument (dynamo would specialize a graph on each value); nesting restores."""
    if type(first) is not bool:
        raise TypeError(f"microbatch: first must be True or False, got {first!r}")
    token = _FIRST.set(first)
    try:
        yield
    finally:
        _FIRST.reset(token)


def current_first_microbatch() -> bool | None:
    """The ``first`` of the innermost active ``microbatch``, or ``None`` (no FP8 weight is kept)."""
    return _FIRST.get()
