"""megatron-core's schedule hooks, backed by distwgrad's contribution accounting.

megatron-core's schedules (``forward_backward_no_pipelining`` and the pipelined ones) reduce no
gradient themselves: they call functions stored on the model's ``ModelParallelConfig``. This module
provides them, so a model of distwgrad modules and weights trains under Megatron's real schedules
without Megatron's DDP wrapper (which would reduce distwgrad weights a second time; do not combine
them)::

    from distwgrad.integrations import megatron as dw_megatron
    dw_megatron.install(config, [model])   # sets the four functions below on config
    # forward_backward_no_pipelining(...) then calls them; see docs/megatron.md

* ``finalize_model_grads_func`` = :func:`finalize_model_grads`: drain deferred wgrads, wait for in-flight
  reductions, finish every distwgrad weight (the core's ``distwgrad.finalize_model_grads``: refuses a
  missing contribution, reduces what is left, scales by ``num_tokens``), all-reduce the plain
  parameters ([Note: plain parameters at finalize]), fire the grad-ready hooks still owed.
* ``no_sync_func`` = ``functools.partial(no_sync, model_chunks)``: while active, distwgrad weights do not
  reduce (their ``reduce_policy`` is ``PER_STEP``; the previous policy is restored on exit).
  Megatron runs microbatches 0..n-2 under it and the last one outside it, so a ``PER_MICROBATCH`` weight
  accumulates microbatches 0..n-2 in its fp32 buffer and reduces *once*, after the last microbatch's last
  contribution: one collective per weight per step, as Megatron's DDP does.
* ``grad_sync_func`` = :func:`grad_sync_func`: reduce now the distwgrad weights whose contributions
  have all arrived; everything else waits for finalize.
* ``param_sync_func`` = :func:`param_sync_func`: distwgrad weights gather on use; validates, does nothing.

Plain parameters (every trainable parameter that is not a distributed weight) are averaged by the core
finalize over ``pg_collection``'s data-parallel group: [Note: plain parameters at finalize] in
``distwgrad/wgrad/plain.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from distwgrad.integrations._megatron_hooks import (
    GradReadyHandle,
    chunks_of,
    enter_no_sync,
    exit_no_sync,
    grad_ready_check,
    grad_ready_end_step,
    in_no_sync,
    named_distinct_params,
    register_grad_ready_hook,
)
from distwgrad.protocol import is_distributed_weight
from distwgrad.weights.base import DistributedParameter, MissingContributionError
from distwgrad.wgrad.finalize import finalize_model_grads as _core_finalize
from distwgrad.wgrad.plain import reduce_plain_params
from distwgrad.wgrad.scheduler import drain_deferred_wgrads

__all__ = ["finalize_model_grads", "FinalizeResult", "no_sync", "grad_sync_func", "param_sync_func",
           "install", "register_grad_ready_hook", "GradReadyHandle", "wait_for_reductions",
           "attach_main_grads", "zero_grad_buffer", "MissingContributionError"]



@dataclasses.dataclass(frozen=True)
class FinalizeResult:
    """What one :func:`finalize_model_grads` call did (Megatron ignores the return value)."""

    drained: int  # deferred wgrads this call ran
    waited: int  # weights whose in-flight reductions were waited on
    weights: int  # distwgrad weights whose step was finished
    plain: int  # plain parameters all-reduced


# --- the four config functions -------------------------------------------------------------------------

# Positional-or-keyword on purpose (STYLE rule 3 would make the tail keyword-only): this is the signature
# of megatron.core.distributed.finalize_model_grads, which callers may invoke positionally.
def finalize_model_grads(model_chunks: nn.Module | Sequence[nn.Module], num_tokens: Any = None,
                         pg_collection: Any = None, force_all_reduce: bool = False) -> FinalizeResult:
    """``ModelParallelConfig.finalize_model_grads_func``: ends the step for every parameter.

    In order: runs every queued deferred wgrad (``distwgrad.drain_deferred_wgrads``); waits for in-flight
    reductions (:func:`wait_for_reductions`); finishes the distwgrad weights (``distwgrad.finalize_model_grads``:
    reduce what is left, scale, write ``main_grad`` and ``.grad``); all-reduces the plain parameters
    ([Note: plain parameters at finalize]); fires the grad-ready hooks still owed and resets them.

    Args:
        model_chunks: Megatron's list of model chunks (a single module is accepted).
        num_tokens: this rank's token count (Megatron passes it with ``calculate_per_token_loss``);
            gradients become the sum over ranks divided by the group's total token count.
        pg_collection: its ``dp_cp`` (else ``dp``) group reduces the plain parameters; None: the distributed
            weights' group, else the default group ([Note: plain parameters at finalize]).
        force_all_reduce: accepted for Megatron; plain parameters are always all-reduced and distwgrad
            weights use their own collective.

    Raises:
        MissingContributionError: a use recorded in forward never delivered its gradient (its backward
            never ran). Raised before anything is reduced or scaled.
        ValueError: a plain parameter marked ``allreduce=False`` in a data-parallel group of several ranks.
    """
    del force_all_reduce
    chunks = chunks_of(model_chunks, "finalize_model_grads")
    named = named_distinct_params(chunks)
    drained = drain_deferred_wgrads(chunks)  # deferred wgrads run under no_grad (WeightGradStore.pop)
    waited = wait_for_reductions(chunks)
    finished = _core_finalize(chunks, num_tokens, reduce_plain_params=False)
    reduced = reduce_plain_params(chunks, num_tokens, pg_collection=pg_collection, megatron=True)
    grad_ready_end_step([p for _, p in named])
    return FinalizeResult(drained=drained, waited=waited, weights=finished, plain=reduced)


@contextlib.contextmanager
def no_sync(model_chunks: nn.Module | Sequence[nn.Module]) -> Iterator[None]:
    """While active, no distwgrad weight of ``model_chunks`` reduces; contributions keep accumulating.

    Every distwgrad weight's ``reduce_policy`` is ``PER_STEP`` for the duration and its previous policy is
    restored when the outermost ``no_sync`` covering it exits (nested and overlapping entries are counted
    per weight, so Megatron's per-chunk ``no_sync_func`` lists and a weight tied across chunks work).
    Exiting does not reduce: the next contribution that completes the weight's recorded uses does (under
    ``PER_MICROBATCH``), or ``grad_sync_func``, or finalize. Changing a weight's policy by hand inside
    the context is overwritten on exit. Grad-ready hooks do not fire inside it.
    """
    params = [p for _, p in named_distinct_params(chunks_of(model_chunks, "no_sync"))]
    entered: list[nn.Parameter] = []
    try:
        for p in params:
            enter_no_sync(p)
            entered.append(p)
        yield
    finally:
        for p in reversed(entered):
            exit_no_sync(p)


def grad_sync_func(params: Iterable[torch.Tensor]) -> None:
    """``ModelParallelConfig.grad_sync_func``: start the reduction of ``params`` whose gradient is complete.

    A distwgrad weight reduces its buffered contributions now when every use recorded this step has
    delivered (``pending_contributions == 0``) and it is not inside :func:`no_sync`; otherwise nothing
    happens to it (it reduces when its contributions complete, or at finalize). Later contributions in the
    same step are buffered and reduced again later; ``main_grad`` sums both, nothing is lost or doubled.
    The reduction is synchronous today (distwgrad's collectives are blocking), so "start" means "do".
    Plain parameters are reduced by finalize only (a plain parameter has no count of the uses it is
    owed, so an early all-reduce could miss a later microbatch). Then the grad-ready hooks of ``params``
    that are complete fire. Every rank must call it with the same parameters in the same order (Megatron's
    schedules do: ``model_chunk.parameters()``).

    Args:
        params: an iterable of parameters (Megatron passes ``model_chunk.parameters()``, a generator).
    """
    params = _distinct(_check_params(params, "grad_sync_func"))
    for p in params:
        if isinstance(p, DistributedParameter) and not in_no_sync(p):
            p.reduce_now()  # a no-op while a contribution is missing or nothing is buffered
    grad_ready_check(params)


def param_sync_func(params: Iterable[torch.Tensor]) -> None:
    """``ModelParallelConfig.param_sync_func``: a no-op, because distwgrad weights gather on use.

    Every forward and backward materializes a distwgrad weight from its shard (``materialize_weight_for_*``),
    so there is no parameter copy to refresh after the optimizer step. It still checks ``params`` (an
    iterable of tensors, not a single tensor) so a wiring mistake fails here.
    """
    _check_params(params, "param_sync_func")


def install(config: Any, model_chunks: nn.Module | Sequence[nn.Module]) -> Any:
    """Sets the four schedule functions on ``config`` (any object that takes those attributes) and returns it.

    ``config.finalize_model_grads_func``, ``config.no_sync_func`` (bound to ``model_chunks``),
    ``config.grad_sync_func`` and ``config.param_sync_func``. Works on megatron-core's
    ``ModelParallelConfig``/``TransformerConfig`` and on a ``types.SimpleNamespace``.
    """
    chunks = chunks_of(model_chunks, "install")
    values = {"finalize_model_grads_func": finalize_model_grads,
              "no_sync_func": functools.partial(no_sync, chunks),
              "grad_sync_func": grad_sync_func,
              "param_sync_func": param_sync_func}
    for attr, value in values.items():
        try:
            setattr(config, attr, value)
        except (AttributeError, TypeError, dataclasses.FrozenInstanceError) as exc:
            raise TypeError(f"install: cannot set {attr} on {type(config).__name__}: {exc}") from exc
    return config


# --- helpers around the step ---------------------------------------------------------------------------

def wait_for_reductions(model_chunks: nn.Module | Sequence[nn.Module]) -> int:
    """Waits for every distributed weight's in-flight reductions; returns how many weights it waited on.

    Every distwgrad weight exposes ``wait_for_reductions()``; one built with ``async_reduce=True`` has
    its launched reductions in flight until here (``False``, the default: nothing to wait on). The plain
    parameters' asynchronous all-reduces are waited in finalize.
    """
    waited = 0
    for _, p in named_distinct_params(chunks_of(model_chunks, "wait_for_reductions")):
        wait = getattr(p, "wait_for_reductions", None)
        if is_distributed_weight(p) and callable(wait):
            wait()
            waited += 1
    return waited


def attach_main_grads(model_chunks: nn.Module | Sequence[nn.Module], *,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Gives every distinct trainable parameter a ``main_grad`` view into one zeroed contiguous buffer.

    Megatron's DDP does this with its grad buffer; without it, distwgrad creates ``main_grad`` per parameter
    when needed. Call it once, before the first step (a parameter that already has a ``main_grad`` raises:
    it would be silently replaced). Distwgrad weights get their local shape. Returns the buffer.
    """
    params = [p for _, p in named_distinct_params(chunks_of(model_chunks, "attach_main_grads"))
              if p.requires_grad]
    has = [tuple(p.shape) for p in params if getattr(p, "main_grad", None) is not None]
    if has:
        raise ValueError(f"attach_main_grads: parameters of shapes {has} already have a main_grad")
    if not params:
        raise ValueError("attach_main_grads: the model has no trainable parameter")
    buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
    offset = 0
    for p in params:
        p.main_grad = buffer[offset: offset + p.numel()].view(p.shape)
        offset += p.numel()
    return buffer


def zero_grad_buffer(model_chunks: nn.Module | Sequence[nn.Module]) -> None:
    """Between steps: zero the plain parameters' ``main_grad`` and reset their ``grad_added_to_main_grad``.

    As Megatron's ``model.zero_grad_buffer()``. distwgrad weights are left alone: they zero an attached
    ``main_grad`` when their next step opens ([Note: main_grad lifetime] in ``weights/base.py``), and
    zeroing it mid-step would drop reduced microbatches. ``.grad`` is the optimizer's
    (``optimizer.zero_grad()``).
    """
    for _, p in named_distinct_params(chunks_of(model_chunks, "zero_grad_buffer")):
        if is_distributed_weight(p):
            continue
        main_grad = getattr(p, "main_grad", None)
        if main_grad is not None:
            main_grad.zero_()
        if hasattr(p, "grad_added_to_main_grad"):
            p.grad_added_to_main_grad = False


def _check_params(params: Iterable[torch.Tensor], what: str) -> list[torch.Tensor]:
    if isinstance(params, torch.Tensor):
        raise TypeError(f"{what} takes an iterable of parameters (Megatron passes model_chunk.parameters()), "
                        f"got a single tensor of shape {tuple(params.shape)}")
    try:
        out = list(params)
    except TypeError:
        raise TypeError(f"{what} takes an iterable of parameters, got {type(params).__name__}") from None
    bad = [(i, type(p).__name__) for i, p in enumerate(out) if not isinstance(p, torch.Tensor)]
    if bad:
        raise TypeError(f"{what}: entries (index, type) {bad[:5]} are not tensors")
    return out


def _distinct(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return list({id(p): p for p in params}.values())
