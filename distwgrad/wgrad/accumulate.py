"""Where a weight gradient lands: one rule for every module and path, weight and bias alike.

[Note: accumulate, never assign]
A parameter can receive several contributions in one step (tied uses, microbatches, deferred wgrads in
any order), so each one is added, never assigned:

* plain: the main backward hands autograd the gradient; a deferred one initialises ``.grad`` if None, else
  adds. The main backward never hands autograd an unfilled buffer.
* fused (``fuse_wgrad_accumulation``): the GEMM adds into fp32 ``param.main_grad`` (a caller's is used in
  place, never replaced); autograd gets what [Note: the fused .grad contract] says.
* distributed: the GEMM adds into ``grad_buffer()``; ``finalize_weight_grads`` counts the contribution
  and its return value is used once ([Note: the finalize contract] in protocol.py).

[Note: the fused .grad contract]
TransformerEngine's: a fused weight hands autograd None (a plain optimizer skips it) unless it carries
``grad_added_to_main_grad`` (Megatron's DDP sets it); then the main backward, deferred or not, sets it True
and hands a dummy of zeros (never unwritten memory), which DDP's hook discards. distwgrad never creates it.

[Note: a fresh first contribution]
Adding the first wgrad into fp32 zeros costs a memset and a read that change nothing. So where every weight
of the call is a ``DistributedParameter`` with nothing accumulated (``ready_for_fresh_grad``), what
``run_wgrad``'s ``fresh()`` returns becomes the buffer: new fp32 tensors, one per weight, each written in full
(an expert with no tokens as zeros); the bits are the add's, but -0.0 stays. A caller's ``main_grad`` is added into.

[Note: no capture into caller-owned gradients]
A CUDA graph that captures ``param.grad.add_(g)`` bakes in an address ``zero_grad(set_to_none=True)`` frees,
so that add is refused under capture outside ``graph_owned_gradients`` ([Note: graphed deferred wgrads] in
``distwgrad/graphs.py``). Fused ``main_grad`` is the caller's; a distributed weight needs its graph-owned
buffer ([Note: captured distributed weights] in ``distwgrad/graphs.py``).
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
    """On this thread, :func:`add_to_grad` accumulates into ``sink`` (``id(param)`` -> ``(param, grad)``)
    instead of ``.grad``: [Note: no capture into caller-owned gradients]."""
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
    ``shape``: each member's FULL shape (a foreign weight's own is its shard's); ``dtype``: the GEMM's. Raises
    ``RuntimeError`` for a ``grad_buffer()`` narrower than fp32, which would round the wgrad and its reduction."""
    if params and is_distributed_weight(params[0]):
        lead = params[0]
        full = tuple(shape) if shape is not None else tuple(getattr(lead, "full_shape", lead.shape))
        want = weight_grad_dtype(list(params), dtype or lead.dtype)
        if not fuse and not isinstance(lead, DistributedParameter):
            # TE's contract: a foreign group's grad_buffer() is the fused path's scratch; unfused, the wgrad
            # GEMM writes a fresh allocation (here in main_grad's dtype, so the reduction stays fp32)
            return [torch.zeros(full, dtype=want, device=lead.device) for _ in params]
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
    """Completes one contribution per parameter; returns what autograd gets (with ``deferred`` nothing: all is
    added to ``.grad``, [Note: accumulate, never assign]). Distributed weights: call it inside ``arriving``."""
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
    """What the main backward hands autograd for fused weights: [Note: the fused .grad contract]."""
    out: list[torch.Tensor | None] = []
    for p in params:
        if hands_fused_dummy(p):
            p.grad_added_to_main_grad = True
            out.append(torch.zeros_like(p))
        else:
            out.append(None)
    return out


def deferred_main_grads(params: Sequence[torch.Tensor], *, fuse: bool, on: bool) -> list[torch.Tensor | None]:
    """What the main backward hands autograd for deferred weights (``on``: they take a gradient)."""
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
    """Runs ``gemm(targets)`` (as :func:`wgrad_targets`) and delivers the wgrads. ``fresh()``: [Note: a fresh
    first contribution]; ``unwritten(target, flag)``: [Note: an unwritten accumulator] in ``weights/first_write.py``;
    ``uses``: the forward's, renewed before the target is chosen ([Note: contribution accounting])."""
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
