"""``make_graphed_callables``' keywords: TransformerEngine's whole signature, resolved to what distwgrad does.

TransformerEngine renamed its FP8 keywords and accepts both spellings; so does distwgrad (both spellings of
one option at once is an error). Each keyword, TE's older spelling in brackets:

* ``enabled`` (``fp8_enabled``), ``recipe`` (``fp8_recipe``): warm up and capture the forwards under
  ``fp8_autocast(recipe)``.
* ``cache_quantized_params`` (``fp8_weight_caching``): accepted, changes nothing: a weight is quantized at
  each use, to the values TE's cache would hold within a step, and never kept ([Note: weight lifecycle] in
  ``weights/lifecycle.py``).
* ``calibrating=True`` (``fp8_calibrating``), an ``amax_reduction_group`` (``fp8_group``): refused:
  calibration and amax reduction groups serve delayed scaling; distwgrad's recipes scale from the current
  amax, and a weight's amax is of its full (gathered) value.
* ``_order``, ``_num_layers_per_chunk``, ``_reuse_graph_input_output_buffers``: refused: capture in an
  interleaved pipeline schedule's order is not implemented; graph each model chunk with its own call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distwgrad.fp8.recipe import Recipe

__all__ = ["GraphOptions", "resolve_options"]


@dataclass(frozen=True)
class GraphOptions:
    num_warmup_iters: int
    fp8: bool  # capture the forwards under fp8_autocast(recipe)
    recipe: Recipe | None


def _one(name: str, value: Any, old: str, old_value: Any) -> Any:
    if value is not None and old_value is not None:
        raise ValueError(f"make_graphed_callables: {name}={value!r} and {old}={old_value!r} are one option (TE's "
                         f"new and old spelling); pass one")
    return value if value is not None else old_value


def resolve_options(*, num_warmup_iters: Any, enabled: Any, fp8_enabled: Any, recipe: Any, fp8_recipe: Any,
                    calibrating: Any, fp8_calibrating: Any, amax_reduction_group: Any, fp8_group: Any,
                    cache_quantized_params: Any, fp8_weight_caching: Any, _order: Any, _num_layers_per_chunk: Any,
                    _reuse_graph_input_output_buffers: Any) -> GraphOptions:
    """Checks every keyword and returns what the capture uses; each refusal names the keyword and why."""
    if not isinstance(num_warmup_iters, int) or isinstance(num_warmup_iters, bool) or num_warmup_iters < 1:
        raise ValueError(f"make_graphed_callables: num_warmup_iters must be an int >= 1 (the last warm-up "
                         f"iteration checks for host syncs), got {num_warmup_iters!r}")
    fp8 = _one("enabled", enabled, "fp8_enabled", fp8_enabled)
    fp8 = False if fp8 is None else fp8
    if not isinstance(fp8, bool):
        raise TypeError(f"make_graphed_callables: fp8_enabled must be a bool, got {fp8!r}")
    chosen = _one("recipe", recipe, "fp8_recipe", fp8_recipe)
    if chosen is not None and not fp8:
        raise ValueError(f"make_graphed_callables: fp8_recipe={chosen!r} given with fp8_enabled=False")
    if _one("calibrating", calibrating, "fp8_calibrating", fp8_calibrating):
        raise ValueError("make_graphed_callables: calibrating=True is delayed scaling's calibration; distwgrad's "
                         "recipes scale from the current amax and have nothing to calibrate")
    group = _one("amax_reduction_group", amax_reduction_group, "fp8_group", fp8_group)
    if group is not None:
        raise ValueError(f"make_graphed_callables: amax_reduction_group={group!r}: distwgrad takes a weight's amax "
                         f"of its full (gathered) value and an activation's on its own rank, and has no tensor "
                         f"parallelism to reduce over; pass None")
    cache = _one("cache_quantized_params", cache_quantized_params, "fp8_weight_caching", fp8_weight_caching)
    if cache is not None and not isinstance(cache, bool):
        raise TypeError(f"make_graphed_callables: cache_quantized_params must be a bool, got {cache!r}")
    for name, value in (("_order", _order), ("_num_layers_per_chunk", _num_layers_per_chunk),
                        ("_reuse_graph_input_output_buffers", _reuse_graph_input_output_buffers or None)):
        if value is not None:
            raise NotImplementedError(f"make_graphed_callables: {name}={value!r} (capture in TransformerEngine's "
                                      f"interleaved pipeline schedule order) is not implemented; graph each model "
                                      f"chunk with its own call")
    return GraphOptions(num_warmup_iters, fp8, chosen)
