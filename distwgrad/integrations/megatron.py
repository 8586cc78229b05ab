"""megatron-core's schedule hooks, backed by distwgrad's contribution accounting (docs/megatron.md).

megatron-core's schedules reduce no gradient themselves: they call four functions on the model's config,
which :func:`install` sets (``dw_megatron.install(config, [model])``). Do not also wrap the model in
Megatron's DDP: it would reduce distwgrad weights a second time. Plain parameters are averaged at finalize
([Note: plain parameters at finalize] in ``distwgrad/wgrad/plain.py``).
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

    Drains deferred wgrads, waits for in-flight reductions, finishes the distwgrad weights (the core's
    ``distwgrad.finalize_model_grads``), all-reduces the plain parameters, fires the grad-ready hooks still owed.

    Args:
        model_chunks: Megatron's list of model chunks (or one module).
        num_tokens: this rank's token count (``calculate_per_token_loss``): gradients are summed, then divided
            by the total over ranks.
        pg_collection: its ``dp_cp`` (else ``dp``) group reduces the plain parameters; None: the weights'
            group, else the default. ``force_all_reduce`` is accepted and ignored.

    Raises:
        MissingContributionError: a use recorded in forward never delivered its gradient (before any reduction).
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

    Megatron runs microbatches 0..n-2 under it, so each weight reduces once per step. Entries are counted per
    weight (per-chunk lists, weights tied across chunks); the outermost exit restores the policy, overwriting
    one set by hand inside, and does not reduce. Grad-ready hooks do not fire inside.
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
    """``ModelParallelConfig.grad_sync_func``: reduces now each distwgrad weight of ``params`` that is complete.

    Complete: every use recorded this step delivered, outside :func:`no_sync`; later contributions reduce again
    into the same ``main_grad``. Plain parameters wait for finalize (no count of owed uses). Then fires the
    complete parameters' grad-ready hooks. Every rank must pass the same parameters in the same order.
    """
    params = _distinct(_check_params(params, "grad_sync_func"))
    for p in params:
        if isinstance(p, DistributedParameter) and not in_no_sync(p):
            p.reduce_now()  # a no-op while a contribution is missing or nothing is buffered
    grad_ready_check(params)


def param_sync_func(params: Iterable[torch.Tensor]) -> None:
    """``ModelParallelConfig.param_sync_func``: a no-op, as distwgrad weights gather on use; it checks
    ``params`` is an iterable of tensors so a wiring mistake fails here."""
    _check_params(params, "param_sync_func")


def install(config: Any, model_chunks: nn.Module | Sequence[nn.Module]) -> Any:
    """Sets the four schedule functions on ``config`` (a ``ModelParallelConfig``, ``TransformerConfig`` or
    any object taking attributes) and returns it; ``no_sync_func`` is bound to ``model_chunks``."""
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
    """Waits for every distributed weight's in-flight reductions (``async_reduce=True``); returns how
    many weights it waited on."""
    waited = 0
    for _, p in named_distinct_params(chunks_of(model_chunks, "wait_for_reductions")):
        wait = getattr(p, "wait_for_reductions", None)
        if is_distributed_weight(p) and callable(wait):
            wait()
            waited += 1
    return waited


def attach_main_grads(model_chunks: nn.Module | Sequence[nn.Module], *,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Gives each distinct trainable parameter a ``main_grad`` view into one zeroed buffer (Megatron's grad
    buffer) and returns it; call once, before the first step (an existing ``main_grad`` raises)."""
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
    """Between steps: zeroes plain parameters' ``main_grad`` and ``grad_added_to_main_grad``; distwgrad
    weights zero theirs when their step opens ([Note: main_grad lifetime] in ``weights/base.py``)."""
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
