"""``make_graphed_callables``: CUDA graphs of forward, backward and the deferred wgrads.

``torch.cuda.make_graphed_callables``'s structure with TransformerEngine's keywords, plus one graph per
deferred wgrad a captured backward queues, which ``backward_dw()`` replays (docs/cuda_graphs.md).

[Note: graphed deferred wgrads]
* No graph writes ``.grad``: a deferred wgrad writes a graph-owned gradient (``graph_owned_gradients`` in
  ``wgrad/accumulate.py``) that ``backward_dw()`` clones or adds into ``.grad`` outside the graph ([Note:
  accumulate, never assign]), so ``zero_grad(set_to_none=True)`` is safe. The main backward returns clones,
  else autograd would keep a static pool tensor as ``.grad`` for the next replay to overwrite.
* Fused ``main_grad`` accumulates in place in the graph: zero it in place; a replaced one raises at replay.
* Per microbatch: forward, backward, ``backward_dw()``. A forward replay overwrites the static buffers a
  queued deferred graph reads, so it raises ``DeferredWgradError``; queued graphs replay in any order.
* ``reset()`` (on any callable of the set: they share one pool) frees it all; it refuses while wgrads are
  queued, and later replays raise.

[Note: captured distributed weights]
A graph cannot follow ``grad_buffer()``'s allocate-then-free life, so a captured weight gets a persistent
fp32 buffer, zeroed under capture where ``grad_buffer()`` would allocate; each replay reduces it (captured
NCCL) into the stable ``main_grad`` where its capture did. A group of one accumulates in ``main_grad``
itself ([Note: a group of one] in ``weights/base.py``). Replays skip the Python accounting, so each applies
its capture's counts and raises if they no longer line up (an eager use interleaved, a drain order other
than ``drain_deferred_wgrads``' default). Refused: non-NCCL groups, ``async_reduce=True`` (a host-side wait),
``ReducePolicy.PER_STEP`` (its buffer outlives a microbatch's graphs).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from distwgrad.fp8 import graph_kept
from distwgrad.fp8.graph_kept import GraphKept, replay_first
from distwgrad.fp8.recipe import Recipe, fp8_autocast
from distwgrad.graph_addresses import CapturedTensors, MainGrads
from distwgrad.graph_options import (
    as_tuple_of_modules,
    check_capture_time_hooks,
    check_devices,
    check_inputs,
    check_module,
    distributed_weights,
    per_callable,
    resolve_options,
)
from distwgrad.graph_order import plan_order
from distwgrad.protocol import is_distributed_weight
from distwgrad.weights.base import main_grad_of
from distwgrad.weights.capture import CapturedWeights, CaptureLedger
from distwgrad.wgrad.accumulate import graph_owned_gradients
from distwgrad.wgrad.store import DeferredWgradError

__all__ = ["make_graphed_callables"]


# --- bookkeeping -------------------------------------------------------------------------------------
def _deferred_modules(m: nn.Module) -> list[nn.Module]:
    return [s for s in m.modules() if getattr(s, "need_backward_dw", None) is not None and s.need_backward_dw()]  # type: ignore[operator]  # nn.Module attributes


def _deferred_params(m: nn.Module) -> set[int]:
    """Parameters whose gradient a deferring module delivers in ``backward_dw()``, not the main backward."""
    out: set[int] = set()
    for s in _deferred_modules(m):
        names = getattr(s, "deferred_param_names", None)
        out |= {id(p) for n, p in s.named_parameters(recurse=False) if names is None or n in names}
    return out


def _prepare_main_grads(mods: tuple[nn.Module, ...]) -> None:
    """Creates fused weights' ``main_grad`` outside any capture (distributed ones: ``CapturedWeights``)."""
    for m in mods:
        for s in m.modules():
            if getattr(s, "fuse_wgrad_accumulation", False):
                names = getattr(s, "deferred_param_names", None)  # e.g. LayerNormMLP's FC parameters
                for n, p in s.named_parameters(recurse=False):
                    if "weight" in n and (names is None or n in names):
                        main_grad_of(p)


class _DwItem:
    """One captured ``backward_dw()`` of one module."""

    def __init__(self, module: nn.Module, owner: _Callable) -> None:
        self.module, self.owner, self.graph = module, owner, torch.cuda.CUDAGraph()
        self.owned: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, graph-owned gradient)
        self.main_grads: MainGrads | None = None
        self.ledger: CaptureLedger | None = None


class _Replay:
    """Queued on a module's store by a graphed backward; ``backward_dw()`` runs it."""

    def __init__(self, graphs: _GraphSet, item: _DwItem) -> None:
        self.graphs, self.item = graphs, item
        graphs.pending.add(self)

    def __call__(self) -> None:
        item, what = self.item, f"backward_dw() of {self.item.module.wgrad_store.owner}"
        self.graphs.check_alive(what)
        assert item.main_grads is not None and item.ledger is not None
        item.main_grads.check(what)
        item.graph.replay()
        item.ledger.apply(what)
        for p, g in item.owned:  # outside the captured region: [Note: accumulate, never assign]
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.add_(g.to(p.grad.dtype))
        item.main_grads.mark_added()


class _GraphSet:
    """What one ``make_graphed_callables`` call owns: its graphs, pool, static and graph-owned tensors."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.callables: list[_Callable] = []
        self.pending: weakref.WeakSet[_Replay] = weakref.WeakSet()
        self.captured = CapturedWeights([])
        self.stream: Any = None  # the warm-up's and the captures' side stream
        self.alive = True
        self.per_forward = False  # each forward pass has buffers of its own: [Note: capture in schedule order]
        self.clone_param_grads = True  # TE's clone_param_grads_on_return

    def check_alive(self, what: str) -> None:
        if not self.alive:
            raise RuntimeError(f"{what}: these graphed callables were reset(); their graphs and pool are gone. "
                               f"Call make_graphed_callables again")

    def check_forward(self, what: str, c: _Callable) -> None:
        self.check_alive(what)
        pending = [r for r in self.pending if not self.per_forward or r.item.owner is c]
        if pending:
            owners = sorted({r.item.module.wgrad_store.owner for r in pending})  # type: ignore[type-var]  # nn.Module attributes
            raise DeferredWgradError(
                f"{what}: graphed deferred wgrads of {owners} are still queued; a forward replay overwrites the "
                f"static buffers they read. Call backward_dw() (or distwgrad.drain_deferred_wgrads) after each "
                f"backward. [Note: graphed deferred wgrads]")

    def reset(self) -> None:
        if not self.alive:
            return
        if len(self.pending):
            owners = sorted({r.item.module.wgrad_store.owner for r in self.pending})  # type: ignore[type-var]  # nn.Module attributes
            raise DeferredWgradError(f"reset(): graphed deferred wgrads of {owners} are still queued; drain them "
                                     f"(or clear their stores) first")
        self.alive = False
        for c in self.callables:
            for g in [c.fwd_graph, c.bwd_graph] + [it.graph for it in c.dw_items]:
                g.reset()
            c.release()
        self.captured.release()
        self.callables = []
        torch.cuda.empty_cache()


class _Callable:
    """One module's capture: its static input surface, graphs and replay state."""

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict, flat: tuple[torch.Tensor, ...]) -> None:
        self.module, self.args, self.kwargs = module, args, kwargs
        self.kw_keys = tuple(sorted(kwargs))
        self.n_user = len(flat)
        named = list(module.named_parameters())
        self.param_names = {id(p): n for n, p in named}
        self.params = tuple(p for _, p in named)
        self.surface = flat + self.params
        self.deferred = _deferred_params(module)
        self.fwd_graph, self.bwd_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        self.uncloned: tuple = ()  # the last backward's uncloned parameter gradients (clone_param_grads_on_return)
        self.bwd_inputs: tuple[int, ...] = ()  # surface indices that require grad
        self.static_outputs: tuple[torch.Tensor, ...] = ()
        self.spec: Any = None
        self.static_grad_outputs: tuple[torch.Tensor | None, ...] = ()
        self.static_grad_inputs: tuple[torch.Tensor | None, ...] = ()
        self.dw_items: list[_DwItem] = []
        self.main_grads: MainGrads | None = None
        self.tensors: CapturedTensors | None = None  # [Note: a graph reads captured addresses]
        self.fwd_ledger: CaptureLedger | None = None
        self.bwd_ledger: CaptureLedger | None = None
        self.training = module.training
        self.kept: GraphKept | None = None  # [Note: fp8 weights kept in CUDA graphs]
        self.first: bool | None = None  # the replay's is_first_microbatch

    def name(self, t: torch.Tensor) -> str:
        return self.param_names.get(id(t), "?")

    def release(self) -> None:
        self.surface = self.static_outputs = self.static_grad_outputs = self.static_grad_inputs = ()
        self.args, self.kwargs, self.dw_items, self.tensors = (), {}, [], None
        if self.kept is not None:
            self.kept.release()


# --- warm-up and capture -----------------------------------------------------------------------------
@contextlib.contextmanager
def _explain(what: str, recipe: Recipe | None) -> Iterator[None]:
    """Turns a host sync or a capture failure into an error naming the callable and the phase."""
    try:
        yield
    except RuntimeError as e:
        text = str(e)
        if "synchroniz" in text or "capturing" in text or "capture" in text:
            fp8 = f" under the FP8 recipe {recipe!r}" if recipe is not None else ""
            raise RuntimeError(f"make_graphed_callables: {what}{fp8} synchronizes with the host or does something a "
                               f"CUDA graph cannot capture ({text.splitlines()[0]}). Keep every input on the device "
                               f"(e.g. m_splits as a CUDA tensor) and avoid .item()/.tolist() in the graphed "
                               f"region") from e
        raise


@contextlib.contextmanager
def _sync_check(on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _drain_into(sink: dict, modules: list[nn.Module]) -> None:
    """Runs (without hooks) every queued deferred wgrad, ``.grad`` contributions going to ``sink``."""
    with graph_owned_gradients(sink):
        for m in modules:
            while len(m.wgrad_store):  # type: ignore[arg-type]  # nn.Module attributes
                m.wgrad_store.pop()  # type: ignore[operator]  # nn.Module attributes


class _Hooks:
    """TE's ``capture_time_hooks``, run by forward pass around the warm-up and capture steps, outside capture."""

    def __init__(self, per_module: list[dict | None] | None, modules: tuple[nn.Module, ...],
                 module_of: Callable[[int], int]) -> None:
        self.per_module, self.modules, self.module_of = per_module, modules, module_of

    def run(self, i: int, kind: str) -> None:
        if self.per_module is None:
            return
        m = self.module_of(i)
        for hook_id, hook in ((self.per_module[m] or {}).get(kind) or {}).items():
            result = hook(self.modules[m])
            if result is not None:
                raise RuntimeError(f"make_graphed_callables: capture_time_hooks[{m}][{kind!r}][{hook_id!r}] "
                                   f"returned {result!r}; a capture-time hook must return None")


def _warmup(calls: list[_Callable], captures: Sequence[tuple[str, int]], n: int, allow_unused: bool, fp8: Callable,
            recipe: Recipe | None, stream: torch.cuda.Stream, hooks: _Hooks) -> None:
    """``n`` iterations of the forwards and backwards in ``captures``' order (TE's), each backward's deferred
    wgrads drained after it; then the unused-input checks."""
    all_deferred = [s for c in calls for s in _deferred_modules(c.module)]
    wants = [[j for j, t in enumerate(c.surface) if t.requires_grad] for c in calls]
    grads: dict[int, tuple] = {i: () for i in range(len(calls))}
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        for it in range(n):
            outs: dict[int, list[torch.Tensor]] = {}
            for kind, i in captures:
                c = calls[i]
                what = f"the warm-up of module {i} ({type(c.module).__name__})"
                hooks.run(i, "forward_pre_hooks" if kind == "fwd" else "backward_pre_hooks")
                last = it == n - 1  # records the copies the graphs keep: [Note: fp8 weights kept in CUDA graphs]
                with _explain(what, recipe), _sync_check(last), fp8(), \
                        graph_kept.recording(c.kept if last else None):
                    if kind == "fwd":
                        outs[i] = [o for o in pytree.tree_leaves(c.module(*c.args, **c.kwargs)) if o.requires_grad]
                    else:
                        if outs[i] and wants[i]:
                            grads[i] = torch.autograd.grad(outs[i], [c.surface[j] for j in wants[i]],
                                                           [torch.ones_like(o) for o in outs[i]], allow_unused=True)
                        del outs[i]
                        _drain_into({}, all_deferred)
                hooks.run(i, "forward_hooks" if kind == "fwd" else "backward_hooks")
    for i, c in enumerate(calls):
        used = [j for j, g in zip(wants[i], grads[i]) if g is not None]
        for j in set(wants[i]) - set(used):
            t = c.surface[j]
            if j < c.n_user and not allow_unused:
                raise ValueError(f"make_graphed_callables: input {j} of module {i} requires grad but gets none "
                                 f"(pass allow_unused_input=True if that is intended)")
            if j >= c.n_user and not (allow_unused or id(t) in c.deferred or is_distributed_weight(t)):
                raise ValueError(f"make_graphed_callables: parameter {c.name(t)!r} of module {i} requires grad "
                                 f"but its forward does not use it (pass allow_unused_input=True)")
        c.bwd_inputs = tuple(wants[i])  # a deferred parameter's slot stays None (never empty inputs)
    torch.cuda.synchronize()


def _capture(gs: _GraphSet, calls: list[_Callable], captures: Sequence[tuple[str, int]], fp8: Callable,
             retain_graph: bool, recipe: Recipe | None, hooks: _Hooks) -> None:
    """Forwards and backwards in ``captures``' order, then each backward's deferred wgrads in that order."""
    queued: dict[int, list[nn.Module]] = {}
    stores = {id(s): s for c in calls for s in _deferred_modules(c.module)}
    for kind, i in captures:
        if kind == "fwd":
            hooks.run(i, "forward_pre_hooks")
            _capture_forward(gs, calls[i], i, fp8, recipe)
            hooks.run(i, "forward_hooks")
        else:
            hooks.run(i, "backward_pre_hooks")
            queued[i] = _capture_backward(gs, calls[i], i, stores, retain_graph, recipe)
            hooks.run(i, "backward_hooks")
    _capture_wgrads(gs, calls, queued, recipe)


def _capture_forward(gs: _GraphSet, c: _Callable, i: int, fp8: Callable, recipe: Recipe | None) -> None:
    c.fwd_ledger = gs.captured.ledger()
    with _explain(f"the forward capture of module {i}", recipe), \
            torch.cuda.graph(c.fwd_graph, pool=gs.pool, stream=gs.stream), fp8(), graph_kept.capturing(c.kept):
        out = c.module(*c.args, **c.kwargs)
    c.fwd_ledger.close()
    flat, c.spec = pytree.tree_flatten(out)
    c.static_outputs = tuple(flat)


def _capture_backward(gs: _GraphSet, c: _Callable, i: int, stores: dict[int, nn.Module], retain_graph: bool,
                      recipe: Recipe | None) -> list[nn.Module]:
    """One backward graph; returns the modules it queued deferred work on, once per item."""
    c.static_grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None for o in c.static_outputs)
    outs = [o for o in c.static_outputs if o.requires_grad]
    before = {k: len(s.wgrad_store) for k, s in stores.items()}  # type: ignore[arg-type]  # nn.Module attributes
    c.bwd_ledger = gs.captured.ledger()
    grads: tuple = ()
    if outs:
        with _explain(f"the backward capture of module {i}", recipe), \
                torch.cuda.graph(c.bwd_graph, pool=gs.pool, stream=gs.stream), graph_kept.capturing(c.kept):
            grads = torch.autograd.grad(outs, [c.surface[j] for j in c.bwd_inputs],
                                        [g for g in c.static_grad_outputs if g is not None],
                                        only_inputs=True, allow_unused=True, retain_graph=retain_graph)
    c.bwd_ledger.close()
    by_index = dict(zip(c.bwd_inputs, grads))
    c.static_grad_inputs = tuple(by_index.get(j) for j in range(len(c.surface)))
    # reverse registration order: drain_deferred_wgrads' default, so a distributed weight's captured
    # buffer zeroing and reduction sit where that drain meets them ([Note: captured distributed weights])
    return [s for k, s in reversed(stores.items()) for _ in range(len(s.wgrad_store) - before[k])]  # type: ignore[arg-type]  # nn.Module attributes


def _capture_wgrads(gs: _GraphSet, calls: list[_Callable], queued: dict[int, list[nn.Module]],
                    recipe: Recipe | None) -> None:
    """One graph per queued item, FIFO per module; every item's inputs stay alive until all are captured."""
    held = [s.wgrad_store.queued() for mods in queued.values() for s in mods]  # type: ignore[operator]  # nn.Module attributes
    for i, mods in queued.items():
        for m in mods:
            item = _DwItem(m, calls[i])
            sink: dict = {}
            item.ledger = gs.captured.ledger()
            with _explain(f"the deferred wgrad capture of {m.wgrad_store.owner} (module {i})", recipe), \
                    torch.cuda.graph(item.graph, pool=gs.pool, stream=gs.stream), graph_owned_gradients(sink):
                m.wgrad_store.pop()  # type: ignore[operator]  # nn.Module attributes
            item.ledger.close()
            item.owned = list(sink.values())
            item.main_grads = MainGrads([(type(m).__name__ + "." + n, p)
                                         for n, p in m.named_parameters(recurse=False)])
            calls[i].dw_items.append(item)
    del held


# --- replay ------------------------------------------------------------------------------------------
def _graphed_function(gs: _GraphSet, c: _Callable, index: int) -> Callable[..., Any]:
    param_start = c.n_user

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            what = f"graphed forward of module {index} ({type(c.module).__name__})"
            gs.check_forward(what, c)
            assert c.tensors is not None
            c.tensors.check(what)
            for j in range(c.n_user):
                if c.surface[j].data_ptr() != inputs[j].data_ptr():
                    c.surface[j].copy_(inputs[j])
            assert c.fwd_ledger is not None
            c.fwd_ledger.apply(what)
            if c.kept is not None:
                c.kept.before_replay(reuse=c.first is False)
            c.fwd_graph.replay()
            return tuple(o.detach() for o in c.static_outputs)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, *grads):
            what = f"graphed backward of module {index} ({type(c.module).__name__})"
            gs.check_alive(what)
            assert c.main_grads is not None and c.bwd_ledger is not None
            c.main_grads.check(what)
            for static, g in zip(c.static_grad_outputs, grads):
                if static is not None and g is not None and static.data_ptr() != g.data_ptr():
                    static.copy_(g)
            if c.kept is not None:
                c.kept.before_replay(reuse=True)
            c.bwd_graph.replay()
            c.bwd_ledger.apply(what)
            c.main_grads.mark_added()
            for item in c.dw_items:
                item.module.wgrad_store.put(_Replay(gs, item))
            # parameter slots as clones unless told otherwise: [Note: graphed deferred wgrads]
            out = tuple(None if g is None else (g.detach() if j < param_start or not gs.clone_param_grads
                                                else g.clone())
                        for j, g in enumerate(c.static_grad_inputs))
            if not gs.clone_param_grads:
                # held until the next replay, so autograd copies (never keeps) a static buffer as a new
                # .grad: one kept would be rewritten by the replay, and a zero_grad(set_to_none=False) .grad
                # then added to itself
                c.uncloned = out[param_start:]
            return out

    def functionalized(*args, **kwargs):
        if "is_first_microbatch" not in c.kw_keys:  # TE's replay keyword, not a graph input
            c.first = replay_first(kwargs.pop("is_first_microbatch", None), c.kept is not None, index)
        if tuple(sorted(kwargs)) != c.kw_keys:
            raise TypeError(f"graphed module {index} was captured with keyword arguments {list(c.kw_keys)}, "
                            f"called with {sorted(kwargs)}")
        flat = tuple(pytree.arg_tree_leaves(*args)) + tuple(pytree.tree_leaves([kwargs[k] for k in c.kw_keys]))
        if len(flat) != c.n_user:
            raise TypeError(f"graphed module {index} was captured with {c.n_user} input tensors, called with "
                            f"{len(flat)}")
        out = Graphed.apply(*(flat + c.params))
        return pytree.tree_unflatten(list(out), c.spec)

    return functionalized


def _forward(gs: _GraphSet, c: _Callable, index: int) -> Callable[..., Any]:
    """The replay while the module is in its captured ``training`` state, its own forward otherwise."""
    graphed, orig_forward, module = _graphed_function(gs, c, index), c.module.forward, c.module

    def forward(*args, **kwargs):
        if module.training == c.training:
            return graphed(*args, **kwargs)
        return orig_forward(*args, **kwargs)

    forward.reset = gs.reset  # type: ignore[attr-defined]
    return forward


def _install(gs: _GraphSet, c: _Callable, index: int) -> nn.Module:
    forward, module = _forward(gs, c, index), c.module

    def backward_dw() -> None:
        """Replays this callable's queued graphed deferred wgrads (each module's ``backward_dw()``)."""
        for item in c.dw_items:
            item.module.backward_dw()  # type: ignore[operator]  # nn.Module attributes

    module.forward = forward
    module.reset = gs.reset  # type: ignore[assignment]  # nn.Module attributes
    if not hasattr(module, "backward_dw"):
        module.backward_dw = backward_dw  # type: ignore[assignment]  # nn.Module attributes
    return module


def make_graphed_callables(modules: nn.Module | tuple[nn.Module, ...], sample_args: tuple,
                           num_warmup_iters: int = 3, allow_unused_input: bool = False,
                           sample_kwargs: dict | tuple[dict, ...] | None = None, fp8_enabled: bool | None = None,
                           fp8_calibrating: bool | None = None, fp8_recipe: Recipe | None = None, fp8_group: Any = None,
                           fp8_weight_caching: bool | None = None, enabled: bool | None = None,
                           calibrating: bool | None = None, recipe: Recipe | None = None,
                           amax_reduction_group: Any = None, cache_quantized_params: bool | None = None,
                           _order: Any = None, _num_layers_per_chunk: Any = None, pool: Any = None,
                           retain_graph_in_backward: bool = False, _reuse_graph_input_output_buffers: bool = False,
                           clone_param_grads_on_return: bool = True, pre_warmup_hook: Callable | None = None,
                           post_warmup_hook: Callable | None = None,
                           capture_time_hooks: Any = None) -> nn.Module | tuple[nn.Module, ...]:
    """CUDA-graphs the forward, backward and deferred wgrads of ``modules`` (docs/cuda_graphs.md).

    Args:
        modules: one module or a tuple in run order (returns the same form). Their ``forward`` becomes the
            replay; a module in another ``training`` state than at capture runs eagerly.
        sample_args: a tuple of tensors, or one per module; ``requires_grad`` must match the real inputs'.
        enabled (``fp8_enabled``), recipe (``fp8_recipe``): capture under ``fp8_autocast(recipe)``.
        _order, _num_layers_per_chunk: capture in a pipeline schedule's order, one ``sample_args`` entry per
            forward pass ([Note: capture in schedule order] in ``distwgrad/graph_order.py``).
        The other keywords are torch's and TransformerEngine's (``distwgrad/graph_options.py``).

    Returns the modules with ``reset()`` (frees the whole set) and, if absent, ``backward_dw()``; with
    ``_order``, one function per forward pass. Raises ``TypeError``/``ValueError`` on bad arguments,
    ``RuntimeError`` without CUDA, on a non-NCCL distributed weight or a host sync in the graphed region,
    ``DeferredWgradError`` while wgrads are queued.
    """
    just_one, mods = as_tuple_of_modules(modules)
    plan = None
    if _order is not None:  # one sample per forward pass: [Note: capture in schedule order]
        samples = tuple(sample_args) if isinstance(sample_args, list | tuple) else sample_args
        plan = plan_order(_order, _num_layers_per_chunk, len(mods), len(samples) if isinstance(samples, tuple) else 0)
        sample_args = samples
        sample_kwargs = tuple(sample_kwargs) if isinstance(sample_kwargs, list) else sample_kwargs
    elif _num_layers_per_chunk is not None or _reuse_graph_input_output_buffers:
        what = (f"_num_layers_per_chunk={_num_layers_per_chunk!r}" if _num_layers_per_chunk is not None
                else "_reuse_graph_input_output_buffers=True")
        raise ValueError(f"make_graphed_callables: {what} without _order")
    passes = [mods[plan.module_of(i)] for i in range(plan.forward_passes)] if plan else list(mods)
    args = per_callable("sample_args", sample_args, len(passes), just_one, tuple)
    kwargs = per_callable("sample_kwargs", sample_kwargs, len(passes), just_one, dict)
    flat = [check_inputs(a, k, i) for i, (a, k) in enumerate(zip(args, kwargs))]
    options = resolve_options(
        num_warmup_iters=num_warmup_iters, enabled=enabled, fp8_enabled=fp8_enabled, recipe=recipe,
        fp8_recipe=fp8_recipe, calibrating=calibrating, fp8_calibrating=fp8_calibrating,
        amax_reduction_group=amax_reduction_group, fp8_group=fp8_group, cache_quantized_params=cache_quantized_params,
        fp8_weight_caching=fp8_weight_caching, _reuse_graph_input_output_buffers=_reuse_graph_input_output_buffers,
        clone_param_grads_on_return=clone_param_grads_on_return, pre_warmup_hook=pre_warmup_hook,
        post_warmup_hook=post_warmup_hook)
    hooks = _Hooks(check_capture_time_hooks(capture_time_hooks, len(mods)), mods,
                   plan.module_of if plan else (lambda i: i))
    for i, m in enumerate(mods):
        check_module(m, i)
    captured = CapturedWeights(distributed_weights(mods))  # refuses what a replay cannot do
    if not torch.cuda.is_available():
        raise RuntimeError("make_graphed_callables needs a CUDA device (torch.cuda.is_available() is False); run the "
                           "modules eagerly on this machine")
    check_devices(tuple(passes), flat)
    if torch.is_autocast_enabled() and torch.is_autocast_cache_enabled():
        raise RuntimeError("make_graphed_callables: autocast caching is on; use "
                           "torch.autocast(..., cache_enabled=False)")

    def fp8():
        return fp8_autocast(options.recipe, enabled=True) if options.fp8 else contextlib.nullcontext()

    recipe = options.recipe
    gs = _GraphSet(torch.cuda.graph_pool_handle() if pool is None else pool)
    gs.captured = captured
    _prepare_main_grads(mods)
    captured.prepare()
    touched = {id(p): p for m in mods for p in m.parameters() if getattr(p, "main_grad", None) is not None}
    saved = {k: (p.main_grad.clone(), getattr(p, "grad_added_to_main_grad", None)) for k, p in touched.items()}
    calls = [_Callable(m, a, k, f) for m, a, k, f in zip(passes, args, kwargs, flat)]
    if options.cache_weights:  # one a module: its forward passes' graphs (an _order's microbatches) share the copies
        kept = {id(m): GraphKept() for m in passes}
        for c in calls:
            c.kept = kept[id(c.module)]
    gs.callables, gs.per_forward = calls, plan is not None
    gs.clone_param_grads = options.clone_param_grads
    n = len(calls)
    captures = plan.captures if plan else tuple([("fwd", i) for i in range(n)] + [("bwd", i) for i in range(n)][::-1])
    try:
        # One side stream for the warm-up and every capture: the per-stream library workspaces (cuBLAS)
        # are allocated in the warm-up, outside the graphs' pool, so reset() can release the whole pool.
        gs.stream = torch.cuda.Stream()
        if options.pre_warmup_hook is not None:
            options.pre_warmup_hook()
        _warmup(calls, captures, options.num_warmup_iters, allow_unused_input, fp8, recipe, gs.stream, hooks)
        if options.post_warmup_hook is not None:
            options.post_warmup_hook()
        with _explain("the capture of the kept FP8 weights' refresh", recipe):
            graph_kept.capture_refreshes([c.kept for c in calls], gs.stream)
        captured.open_for_capture()
        _capture(gs, calls, captures, fp8, retain_graph_in_backward, recipe, hooks)
    except BaseException:
        captured.close_capture()
        captured.release(failed=True)
        raise
    finally:
        captured.close_capture()
        for k, p in touched.items():  # type: ignore[assignment]  # nn.Module attributes
            p.main_grad.copy_(saved[k][0])
            if saved[k][1] is None:
                p.__dict__.pop("grad_added_to_main_grad", None)
            else:
                p.grad_added_to_main_grad = saved[k][1]  # type: ignore[assignment]  # nn.Module attributes
    for c in calls:
        c.main_grads = MainGrads([(c.name(p), p) for p in c.params])
        c.tensors = CapturedTensors(c.module)
    if plan is not None:
        return tuple(_forward(gs, c, i) for i, c in enumerate(calls))  # type: ignore[misc]  # TE's form: functions
    ret = tuple(_install(gs, c, i) for i, c in enumerate(calls))
    return ret[0] if just_one else ret
