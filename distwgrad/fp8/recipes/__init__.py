"""The FP8 recipes, one file each, and their registry: the names the job's ``--recipe`` and
``recipe_by_name`` take ([Note: fp8 recipe objects] in ``base.py``). A new recipe is a new file with a
``Recipe`` subclass and a ``register_recipe`` line."""

from __future__ import annotations

from collections.abc import Callable

from distwgrad.fp8.formats import FP8_DTYPES, Fp8Format, fp8_format
from distwgrad.fp8.recipes.base import GEMMS, MMParams, Recipe
from distwgrad.fp8.recipes.blockwise import BlockwiseScaling
from distwgrad.fp8.recipes.per_tensor import PerTensorScaling

__all__ = ["Recipe", "PerTensorScaling", "BlockwiseScaling", "MMParams", "Fp8Format", "fp8_format", "FP8_DTYPES",
           "GEMMS", "RECIPES", "register_recipe", "recipe_by_name"]

RECIPES: dict[str, Callable[[], Recipe]] = {}


def register_recipe(name: str, make: Callable[[], Recipe]) -> None:
    """Makes ``recipe_by_name(name)`` (and the job's ``--recipe name``, for a registry line here) build
    ``make()``; a name is registered once."""
    if not isinstance(name, str) or not name or name == "none":
        raise ValueError(f"register_recipe: name must be a non-empty string other than 'none', got {name!r}")
    if name in RECIPES:
        raise ValueError(f"register_recipe: {name!r} is registered already ({RECIPES[name]!r})")
    if not callable(make):
        raise TypeError(f"register_recipe: make must build a Recipe, got {make!r}")
    RECIPES[name] = make


def recipe_by_name(name: str) -> Recipe | None:
    """The recipe registered as ``name``; None for ``"none"`` (no FP8)."""
    if name == "none":
        return None
    if name not in RECIPES:
        raise ValueError(f"recipe {name!r} is not registered; the recipes: {['none', *RECIPES]}")
    recipe = RECIPES[name]()
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe {name!r} built {recipe!r}, not a Recipe")
    return recipe


register_recipe("fp8_per_tensor", PerTensorScaling)
# TransformerEngine's Float8CurrentScaling accumulation: fprop without the split accumulator
register_recipe("fp8_per_tensor_te", lambda: PerTensorScaling(fp8_gemm_fprop=MMParams(False)))
register_recipe("fp8_blockwise", BlockwiseScaling)
