"""``make_graphed_callables``' arguments: TransformerEngine's keywords resolved to what distwgrad does, and
the checks of the modules and sample inputs.

TransformerEngine renamed its FP8 keywords and accepts both spellings; so does distwgrad (both spellings of
one option at once is an error). Each keyword, TE's older spelling in brackets:

* ``enabled`` (``fp8_enabled``), ``recipe`` (``fp8_recipe``): warm up and capture the forwards under
  ``fp8_autocast(recipe)``.
* ``cache_quantized_params=True`` (``fp8_weight_caching``): the graphs keep FP8 weights across a step's
  microbatches; each replay then takes ``is_first_microbatch`` (or runs inside ``fp8.microbatch(first=...)``)
  ([Note: fp8 weights kept in CUDA graphs] in ``fp8/graph_kept.py``). Otherwise a replay quantizes each weight
  at each use and ignores the keyword.
* ``calibrating=True`` (``fp8_calibrating``), an ``amax_reduction_group`` (``fp8_group``): refused:
  calibration and amax reduction groups serve delayed scaling; distwgrad's recipes scale from the current
  amax, and a weight's amax is of its full (gathered) value.
* ``_order``, ``_num_layers_per_chunk``: capture in a pipeline schedule's order (``graph_order.py``).
* ``_reuse_graph_input_output_buffers=True`` (with ``_order`` only, as in TE): accepted with a warning, and no
  buffer is shared: each forward pass keeps static buffers of its own, so its outputs also stay valid past
  its backward (TE's memory saving is not made).
* ``clone_param_grads_on_return=False``: the backward replay hands autograd the graph's static parameter
  gradients instead of clones: an existing ``.grad`` adds them with no copy; a new ``.grad`` is still a copy
  (the replay's gradients are held, so autograd cannot keep a static buffer that the next replay rewrites);
  a parameter's gradient hook sees the static buffer.
* ``pre_warmup_hook``, ``post_warmup_hook``: called once before and once after all the warm-up iterations.
* ``capture_time_hooks``: per module, a dict of ``forward_pre_hooks``, ``forward_hooks``,
  ``backward_pre_hooks``, ``backward_hooks`` (each ``{id: hook(module)}``), run around that module's forward
  and backward in every warm-up iteration and at capture, outside the capture, and never replayed (host
  work a graph cannot hold). A hook returns None.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from distwgrad.fp8.recipe import Recipe
from distwgrad.weights.base import DistributedParameter
from distwgrad.wgrad.store import DeferredWgradError

__all__ = ["GraphOptions", "resolve_options", "check_capture_time_hooks", "HOOK_KINDS", "as_tuple_of_modules",
           "per_callable", "check_inputs", "check_module",
           "distributed_weights", "check_devices"]


@dataclass(frozen=True)
class GraphOptions:
    num_warmup_iters: int
    fp8: bool  # capture the forwards under fp8_autocast(recipe)
    recipe: Recipe | None
    clone_param_grads: bool = True
    pre_warmup_hook: Any = None
    post_warmup_hook: Any = None
    cache_weights: bool = False  # [Note: fp8 weights kept in CUDA graphs]


def _one(name: str, value: Any, old: str, old_value: Any) -> Any:
    if value is not None and old_value is not None:
        raise ValueError(f"make_graphed_callables: {name}={value!r} and {old}={old_value!r} are one option (TE's "
                         f"new and old spelling); pass one")
    return value if value is not None else old_value


def resolve_options(*, num_warmup_iters: Any, enabled: Any, fp8_enabled: Any, recipe: Any, fp8_recipe: Any,
                    calibrating: Any, fp8_calibrating: Any, amax_reduction_group: Any, fp8_group: Any,
                    cache_quantized_params: Any, fp8_weight_caching: Any,
                    _reuse_graph_input_output_buffers: Any, clone_param_grads_on_return: Any = True,
                    pre_warmup_hook: Any = None, post_warmup_hook: Any = None) -> GraphOptions:
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
    if _reuse_graph_input_output_buffers:
        warnings.warn("make_graphed_callables: _reuse_graph_input_output_buffers=True is accepted but shares no "
                      "buffer: each forward pass keeps static input and output buffers of its own (no memory is "
                      "saved)", UserWarning, stacklevel=3)
    if not isinstance(clone_param_grads_on_return, bool):
        raise TypeError(f"make_graphed_callables: clone_param_grads_on_return must be a bool, got "
                        f"{clone_param_grads_on_return!r}")
    for name, hook in (("pre_warmup_hook", pre_warmup_hook), ("post_warmup_hook", post_warmup_hook)):
        if hook is not None and not callable(hook):
            raise TypeError(f"make_graphed_callables: {name} must be a callable or None, got {hook!r}")
    return GraphOptions(num_warmup_iters, fp8, chosen, clone_param_grads_on_return, pre_warmup_hook,
                        post_warmup_hook, bool(cache))


HOOK_KINDS = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")


def check_capture_time_hooks(hooks: Any, n_modules: int) -> list[dict | None] | None:
    """TE's ``capture_time_hooks``: None, or one entry per module, each None or ``{kind: {id: hook}}``."""
    if hooks is None:
        return None
    if not isinstance(hooks, list | tuple) or len(hooks) != n_modules:
        raise ValueError(f"make_graphed_callables: capture_time_hooks must be a list with one entry per module "
                         f"({n_modules}), got {hooks!r}")
    for i, spec in enumerate(hooks):
        if spec is None:
            continue
        unknown = set(spec) - set(HOOK_KINDS) if isinstance(spec, dict) else None
        if unknown is None or unknown:
            raise ValueError(f"make_graphed_callables: capture_time_hooks[{i}] must be a dict with keys from "
                             f"{HOOK_KINDS}, got {spec!r}")
        for kind, fns in spec.items():
            if not isinstance(fns, dict) or not all(callable(f) for f in fns.values()):
                raise TypeError(f"make_graphed_callables: capture_time_hooks[{i}][{kind!r}] must be a dict of "
                                f"callables (hook_id: hook(module)), got {fns!r}")
    return list(hooks)


# --- the modules and sample inputs (no CUDA needed) --------------------------------------------------
def as_tuple_of_modules(modules: Any) -> tuple[bool, tuple[nn.Module, ...]]:
    just_one = not isinstance(modules, tuple)
    mods = (modules,) if just_one else modules
    if not mods:
        raise ValueError("make_graphed_callables: modules is an empty tuple")
    bad = [f"{i}: {type(m).__name__}" for i, m in enumerate(mods) if not isinstance(m, nn.Module)]
    if bad:
        raise TypeError(f"make_graphed_callables graphs nn.Modules; got {bad}")
    return just_one, mods


def per_callable(name: str, value: Any, n: int, just_one: bool, kind: type) -> tuple:
    if value is None:
        return tuple(kind() for _ in range(n))
    given = value
    if just_one:
        value = (value,)
    if not isinstance(value, tuple) or len(value) != n or not all(isinstance(v, kind) for v in value):
        shown = (type(given).__name__ if just_one or not isinstance(given, tuple)
                 else [type(v).__name__ for v in given])
        raise TypeError(f"make_graphed_callables: {name} must be a {kind.__name__}"
                        f"{'' if just_one else f' per module (a tuple of {n})'}, got {shown}")
    return value


def check_inputs(args: tuple, kwargs: dict, i: int) -> tuple[torch.Tensor, ...]:
    flat = tuple(pytree.arg_tree_leaves(*args)) + tuple(pytree.tree_leaves([kwargs[k] for k in sorted(kwargs)]))
    bad = [type(a).__name__ for a in flat if not isinstance(a, torch.Tensor)]
    if bad:
        raise TypeError(f"make_graphed_callables: sample inputs of module {i} must be tensors, got {bad}")
    return flat


def check_module(m: nn.Module, i: int) -> None:
    if m._backward_hooks or m._forward_hooks or m._forward_pre_hooks:
        raise ValueError(f"make_graphed_callables: module {i} ({type(m).__name__}) has hooks registered; register "
                         f"them after graphing")
    trainable = [name for name, b in m.named_buffers() if b.requires_grad]
    if trainable:
        raise ValueError(f"make_graphed_callables: module {i} has buffers requiring grad {trainable}")
    queued = [f"{s.wgrad_store.owner} '{n or '<root>'}' ({len(s.wgrad_store)} queued)" for n, s in m.named_modules()
              if len(getattr(s, "wgrad_store", ()))]
    if queued:
        raise DeferredWgradError(f"make_graphed_callables: module {i} has deferred wgrads queued: {queued}; "
                                 f"drain them (distwgrad.drain_deferred_wgrads) before graphing")


def distributed_weights(mods: tuple[nn.Module, ...]) -> list[DistributedParameter]:
    seen: dict[int, DistributedParameter] = {}
    for m in mods:
        for p in m.parameters():
            if isinstance(p, DistributedParameter):
                seen.setdefault(id(p), p)
    return list(seen.values())


def check_devices(mods: tuple[nn.Module, ...], flat_inputs: list[tuple[torch.Tensor, ...]]) -> None:
    for i, (m, flat) in enumerate(zip(mods, flat_inputs)):
        off = [n for n, p in m.named_parameters() if not p.is_cuda]
        off += [f"input {j}" for j, a in enumerate(flat) if not a.is_cuda]
        if off:
            raise ValueError(f"make_graphed_callables: module {i} has tensors off CUDA: {off}")
