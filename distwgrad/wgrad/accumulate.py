"""Where a weight gradient lands, identical for every module, every path, weight and bias alike.

[Note: accumulate, never assign]
A parameter can receive several contributions in one step: tied uses, microbatches, deferred wgrads
drained in any order. Every contribution is therefore added, never assigned:

* plain parameter, no fusion: the main backward hands the gradient to autograd (which accumulates into
  ``.grad``); a deferred contribution initialises ``.grad`` when it is None and adds to it otherwise.
  ``zero_grad(set_to_none=False)`` leaves zeros and ``True`` leaves None: both take a branch that lands
  on the same value. The main backward never hands autograd an unfilled buffer: a deferred gradient is
  ``None`` there.
* plain parameter with ``fuse_wgrad_accumulation``: the GEMM accumulates into ``param.main_grad`` (fp32;
  a caller-attached ``main_grad`` is used in place, never replaced; one is created at the first
  contribution otherwise). What autograd gets is TransformerEngine's contract ([Note: the fused .grad
  contract]).

[Note: the fused .grad contract]
A weight whose wgrad is fused into ``main_grad`` hands autograd ``None``, so ``.grad`` stays None and a
plain optimizer skips it, unless the weight carries the attribute ``grad_added_to_main_grad`` (Megatron's
DDP sets it, to False, on every parameter it owns). Then the main backward sets it to True and hands
autograd a dummy of the weight's shape, so the DDP hook on the weight's gradient fires and, reading the
flag, discards the dummy instead of adding it to ``main_grad``. Deferred or not: the flag and the dummy
come from the main backward, as in TE; ``backward_dw()`` then only accumulates into ``main_grad``. The
dummy is zeros (TE hands uninitialised memory unless ``zero_out_wgrad`` is set; distwgrad never hands
autograd memory nobody wrote). The attribute is never created by distwgrad.
* distributed weight: the GEMM accumulates into ``grad_buffer()`` and ``finalize_weight_grads`` counts
  the contribution; its return value is used once (see [Note: the finalize contract] in protocol.py).
  The step's first contribution may be written instead of added ([Note: a fresh first contribution]).

[Note: a fresh first contribution]
A weight's buffer starts each accumulation as fp32 zeros that the first wgrad is added into: a memset
and a read of 4 bytes per element that change nothing (0 + x is x). A module's wgrad that can also
produce its product as a new fp32 tensor passes ``run_wgrad(..., fresh=)``; where every weight of the
call is a ``DistributedParameter`` that has nothing accumulated yet (``ready_for_fresh_grad``: the
step's or the microbatch's first contribution, no CUDA graph capturing, and in place only while it has
no ``main_grad``), the GEMM writes that tensor and it becomes the buffer (``adopt_grad_buffer``; in
place, the weight's own ``main_grad``), so ``finalize_weight_grads`` counts it without an add. Opt-in per
call site, so no path ever adds into memory nobody wrote: ``fresh`` must return tensors it just made,
each written in full (an expert with no tokens as zeros), one per weight, each weight once. The bits are
those of the add into zeros (the GEMM's fp32 accumulator, or on CPU the product in the compute dtype,
cast), except that a -0.0 stays -0.0. Everything else is unchanged: a caller's ``main_grad`` (Megatron's
buffer, TE's convention) is added into, and later contributions, the embedding's row scatter and the
bias are adds.

[Note: no capture into caller-owned gradients]
A CUDA graph that captures ``param.grad.add_(g)`` bakes in the address of ``.grad``;
``zero_grad(set_to_none=True)`` then frees that tensor and every replay writes into freed memory (the
caching allocator may have handed the block to anything by then). So:

* refused: adding into ``.grad`` while a stream is capturing, outside ``graph_owned_gradients``
  (a hand-made ``torch.cuda.graph`` around ``backward_dw()``); the error says what to do instead.
* what ``distwgrad.make_graphed_callables`` does instead ([Note: graphed deferred wgrads] in
  ``distwgrad/graphs.py``): it captures each deferred wgrad inside ``graph_owned_gradients(sink)``, so the
  contribution lands in a fresh graph-pool tensor the graphed callables own, and on replay, outside the
  captured region and before the module's hooks fire, clones it into ``.grad`` (None) or adds it.
* fused ``main_grad`` needs none of this: the GEMM accumulates in place into the caller's buffer, which
  the graphed callables check at every replay (a replaced ``main_grad`` is refused, never written).
* a distributed weight's ``grad_buffer()`` under capture is its graph-owned persistent buffer
  ([Note: captured distributed weights] in ``distwgrad/graphs.py``) and is refused without one.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from distwgrad.protocol import (
    finalize_weight_grads,
    is_distributed_weight,
    weight_grad_buffers,
    weight_grad_dtype,
)
from distwgrad.weights._accounting import Uses, arriving
from distwgrad.weights.base import DistributedParameter, main_grad_of

__all__ = ["add_to_grad", "main_grad_of", "wgrad_targets", "deliver_wgrads", "run_wgrad", "graph_owned_gradients",
           "fused_grads", "deferred_main_grads",
           "hands_fused_dummy"]


_sinks = threading.local()  # the innermost graph_owned_gradients sink of this thread, if any


@contextlib.contextmanager
def graph_owned_gradients(sink: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Iterator[dict]:
    """While active on this thread, :func:`add_to_grad` accumulates into ``sink`` (``id(param)`` ->
    ``(param, gradient)``, a fresh tensor at the first contribution, then added to) instead of ``.grad``:
    [Note: no capture into caller-owned gradients]."""
    previous = getattr(_sinks, "sink", None)
    _sinks.sink = sink
    try:
        yield sink
    finally:
        _sinks.sink = previous


def _refuse_capture(what: str) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{what} while a CUDA graph is capturing: the graph would bake in the address of a gradient "
            f"that zero_grad(set_to_none=True) frees, and replays would write into freed memory. Graph the "
            f"modules with distwgrad.make_graphed_callables (it captures deferred wgrads into graph-owned "
            f"gradients), use fuse_wgrad_accumulation=True (accumulates into main_grad, which you own), or run "
            f"backward_dw() outside the graph. [Note: no capture into caller-owned gradients]")


def add_to_grad(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    """``.grad``: None -> initialise with ``grad``, otherwise add. Never assigns over a gradient."""
    if grad is None:
        return
    if tuple(grad.shape) != tuple(param.shape):
        raise ValueError(f"a gradient of shape {tuple(grad.shape)} for a parameter of shape "
                         f"{tuple(param.shape)}")
    sink = getattr(_sinks, "sink", None)
    if sink is not None:
        held = sink.get(id(param))
        if held is None:
            sink[id(param)] = (param, grad.detach().to(param.dtype).clone(memory_format=torch.contiguous_format))
        else:
            held[1].add_(grad.to(held[1].dtype))
        return
    _refuse_capture("adding a deferred wgrad into .grad")
    if param.grad is None:
        param.grad = grad.detach().to(param.dtype).clone(memory_format=torch.contiguous_format)
    else:
        param.grad.add_(grad.to(param.grad.dtype))


def wgrad_targets(params: Sequence[torch.Tensor], fuse: bool, *, shape: Sequence[int] | None = None,
                  dtype: torch.dtype | None = None) -> list[torch.Tensor | None]:
    """The buffer each parameter's wgrad GEMM accumulates into; None means 'return a fresh tensor'.

    A group is all distributed or all plain (the dispatchers reject a plain leader with distributed
    followers), so one GEMM call serves the group. ``shape`` is each member's FULL shape (a foreign
    weight's own shape is its shard's; default: ``full_shape``, else the tensor's shape) and ``dtype``
    the GEMM's compute dtype (default: the leader's dtype).

    A distributed group's targets are ``weight_grad_buffers``: each member's own ``grad_buffer()``,
    checked against ``shape``; the buffer must hold at least ``weight_grad_dtype`` (``main_grad``'s
    dtype, fp32), so the wgrad and its reduction are never rounded to the compute dtype. A plain group
    returns None: the GEMM's fresh product is the scratch, in the compute dtype (``weight_grad_dtype``
    of a plain weight), or the fp32 ``main_grad`` with ``fuse``.
    """
    if params and is_distributed_weight(params[0]):
        lead = params[0]
        full = tuple(shape) if shape is not None else tuple(getattr(lead, "full_shape", lead.shape))
        want = weight_grad_dtype(list(params), dtype or lead.dtype)
        buffers = weight_grad_buffers(list(params), full, want, lead.device)
        for p, b in zip(params, buffers):
            if b.dtype != want and b.dtype.itemsize < want.itemsize:
                raise RuntimeError(f"{type(p).__name__}.grad_buffer() is {b.dtype} but the wgrad must be "
                                   f"{want} (its main_grad's dtype): a narrower buffer would round every "
                                   f"contribution and the reduction")
        return list(buffers)
    if fuse:
        return [main_grad_of(p) for p in params]
    return [None] * len(params)


def deliver_wgrads(params: Sequence[torch.Tensor], wgrads: Sequence[torch.Tensor], *, fuse: bool,
                   deferred: bool) -> list[torch.Tensor | None]:
    """Completes one contribution per parameter; returns what the main backward hands autograd.

    ``wgrads`` are what the GEMM produced: the targets of :func:`wgrad_targets` (already accumulated)
    or fresh tensors. With ``deferred`` nothing goes to autograd (the main backward already returned
    None) and every gradient is added to ``.grad`` here; see [Note: accumulate, never assign]. For
    distributed weights, call it inside ``arriving`` (``run_wgrad`` does).
    """
    if params and is_distributed_weight(params[0]):
        results = finalize_weight_grads(list(params), list(wgrads))
    elif fuse:
        return [None] * len(params) if deferred else fused_grads(params)
    else:
        results = list(wgrads)
    if deferred:
        for p, g in zip(params, results):
            add_to_grad(p, g)
        return [None] * len(params)
    return results


def fused_grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """What the main backward hands autograd for weights whose wgrad is fused into ``main_grad``, deferred
    or not: [Note: the fused .grad contract]. Sets ``grad_added_to_main_grad`` where the weight has it."""
    out: list[torch.Tensor | None] = []
    for p in params:
        if hands_fused_dummy(p):
            p.grad_added_to_main_grad = True
            out.append(torch.zeros_like(p))
        else:
            out.append(None)
    return out


def deferred_main_grads(params: Sequence[torch.Tensor], *, fuse: bool, on: bool) -> list[torch.Tensor | None]:
    """What the main backward hands autograd for weights whose wgrad it deferred (``on``: they take one):
    None, or for plain weights fused into ``main_grad`` :func:`fused_grads`."""
    if on and fuse and params and not is_distributed_weight(params[0]):
        return fused_grads(params)
    return [None] * len(params)


def hands_fused_dummy(p: torch.Tensor) -> bool:
    """Whether a fused weight's main backward hands autograd a dummy: [Note: the fused .grad contract]."""
    return hasattr(p, "grad_added_to_main_grad")


def _fresh_first(params: Sequence[torch.Tensor]) -> bool:
    """Whether every weight of the call takes its next contribution fresh: [Note: a fresh first contribution]."""
    if not params or not all(isinstance(p, DistributedParameter) for p in params):
        return False
    if len({id(p) for p in params}) != len(params):  # a weight twice in one call: its second wgrad is an add
        return False
    return all([p.ready_for_fresh_grad() for p in params])  # each one's reductions land (a list: no short cut)


def run_wgrad(params: Sequence[torch.Tensor], gemm: Callable[[list[torch.Tensor | None]], Sequence[torch.Tensor]],
              *, fuse: bool, deferred: bool, shape: Sequence[int] | None = None,
              dtype: torch.dtype | None = None, uses: Uses | None = None,
              fresh: Callable[[], Sequence[torch.Tensor]] | None = None,
              unwritten: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
              ) -> list[torch.Tensor | None]:
    """Picks targets (``shape``, ``dtype``: as :func:`wgrad_targets`), runs ``gemm(targets)`` (which returns
    per-param wgrads), delivers them. ``fresh()``: the same product as new fp32 tensors, one per param,
    each written in full; given, distributed weights with nothing accumulated take it as their buffer
    instead of zeros added into ([Note: a fresh first contribution]). ``unwritten(target, flag)``: for one
    param, the product added into ``target`` by a kernel that writes it instead while the int32 ``flag`` is
    set, returning ``target``; given, a weight whose ``main_grad`` a step flagged as holding nothing takes
    that path and the flag is cleared after it ([Note: an unwritten accumulator] in
    ``weights/first_write.py``). ``uses`` are what the forward's ``_begin_forward`` recorded ([Note:
    contribution accounting] in ``weights/base.py``): a use renewed for this contribution (a retained graph's
    second backward) is recorded before the target is chosen (``arriving``)."""
    if params and is_distributed_weight(params[0]):
        with arriving(uses, params):
            return _run(params, gemm, fuse, deferred, shape, dtype, fresh, unwritten)
    return _run(params, gemm, fuse, deferred, shape, dtype, fresh, unwritten)


def _run(params, gemm, fuse, deferred, shape, dtype, fresh, unwritten) -> list[torch.Tensor | None]:
    if unwritten is not None and len(params) == 1 and isinstance(params[0], DistributedParameter):
        taken = params[0].take_unwritten()
        if taken is not None:
            target, flag = taken
            wgrad = unwritten(target, flag)
            flag.zero_()  # after the kernel, on its stream: the next contribution adds
            return deliver_wgrads(params, [wgrad], fuse=fuse, deferred=deferred)
    if fresh is not None and _fresh_first(params):
        wgrads = list(fresh())
        if len(wgrads) != len(params):
            raise RuntimeError(f"run_wgrad: fresh() gave {len(wgrads)} wgrads for {len(params)} weights")
        for p, g in zip(params, wgrads):
            p.adopt_grad_buffer(g)
        return deliver_wgrads(params, wgrads, fuse=fuse, deferred=deferred)
    targets = wgrad_targets(params, fuse, shape=shape, dtype=dtype)
    return deliver_wgrads(params, gemm(targets), fuse=fuse, deferred=deferred)
