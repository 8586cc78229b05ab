"""Grad-ready hooks and no-sync bookkeeping for the Megatron integration (``megatron.py`` is the API).

[Note: grad-ready, once per parameter per step]
A hook fires *once* per distinct parameter per step, after its last contribution, so a consumer never sees a
partial gradient and never counts uses (Megatron's DDP counts k reports for k uses, easy to get wrong).
* A distwgrad weight: ``pending_contributions == 0`` ([Note: contribution accounting] in ``weights/base.py``),
  checked by a contribution listener after every contribution, on every path.
* A plain parameter: at an autograd post-accumulate-grad event or a deferring module's
  ``register_wgrad_accumulation_and_reduce_hooks`` event, once no deferring module holding it has a wgrad
  queued (both events: it may be tied between a deferring and a non-deferring module).
* Never under ``no_sync``. ``grad_sync_func`` checks again; the integration's ``finalize_model_grads`` fires
  whatever got a contribution and has not fired, then resets the step (the core's finalize alone does not).
  A hook fires at most once a step, even if contributions arrive after it fired.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from distwgrad.weights.base import DistributedParameter, ReducePolicy
from distwgrad.wgrad.scheduler import deferred_modules

__all__ = ["chunks_of", "named_distinct_params", "in_no_sync", "enter_no_sync", "exit_no_sync",
           "GradReadyHandle", "register_grad_ready_hook", "grad_ready_check", "grad_ready_end_step"]

_DEPTH = "_distwgrad_no_sync_depth"  # on every parameter of the chunks while no_sync is active
_SAVED_POLICY = "_distwgrad_policy_outside_no_sync"  # on distwgrad weights while no_sync is active
_STATE = "_distwgrad_grad_ready"  # the parameter's _ReadyState once a grad-ready hook is registered


# --- walking model chunks ------------------------------------------------------------------------------

def chunks_of(model_chunks: nn.Module | Sequence[nn.Module], what: str) -> list[nn.Module]:
    """Megatron passes a list of chunks; a single module is accepted too."""
    if isinstance(model_chunks, nn.Module):
        return [model_chunks]
    if isinstance(model_chunks, (str, bytes)) or not isinstance(model_chunks, Sequence):
        raise TypeError(f"{what}: model_chunks must be an nn.Module or a list of them, got "
                        f"{type(model_chunks).__name__}")
    chunks = list(model_chunks)
    bad = [type(m).__name__ for m in chunks if not isinstance(m, nn.Module)]
    if bad or not chunks:
        raise TypeError(f"{what}: model_chunks must be a non-empty list of nn.Modules, got "
                        f"{[type(m).__name__ for m in chunks]}")
    return chunks


def named_distinct_params(chunks: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """``(name, param)`` for each distinct parameter (tied ones once), named as the core names them."""
    seen: set[int] = set()
    out = []
    for i, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters(remove_duplicate=False):
            if id(p) not in seen:
                seen.add(id(p))
                out.append((f"{i}.{name}" if len(chunks) > 1 else name, p))
    return out


# --- no_sync bookkeeping -------------------------------------------------------------------------------

def in_no_sync(p: torch.Tensor) -> bool:
    return getattr(p, _DEPTH, 0) > 0


def enter_no_sync(p: nn.Parameter) -> None:
    """First entry switches a distwgrad weight to PER_STEP; nested entries only count. Safe at any
    point of a step: the policy decides only *when* the buffer reduces ([Note: weight lifecycle])."""
    depth = getattr(p, _DEPTH, 0)
    if depth == 0 and isinstance(p, DistributedParameter):
        setattr(p, _SAVED_POLICY, p.reduce_policy)
        p.reduce_policy = ReducePolicy.PER_STEP
    setattr(p, _DEPTH, depth + 1)


def exit_no_sync(p: nn.Parameter) -> None:
    """Last exit restores the policy the weight had outside no_sync (it does not reduce by itself)."""
    depth = getattr(p, _DEPTH, 0)
    assert depth > 0, "exit_no_sync without a matching enter_no_sync"
    setattr(p, _DEPTH, depth - 1)
    if depth == 1 and isinstance(p, DistributedParameter):
        p.reduce_policy = getattr(p, _SAVED_POLICY)
        delattr(p, _SAVED_POLICY)


# --- grad-ready hooks ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Entry:
    token: int
    name: str
    hook: Callable[[str, nn.Parameter], Any]


class _ReadyState:
    """Per-parameter grad-ready bookkeeping; see [Note: grad-ready, once per parameter per step]."""

    def __init__(self, param: nn.Parameter) -> None:
        self.param = param
        self.entries: list[_Entry] = []
        self.owners: list[nn.Module] = []  # deferring modules holding this plain parameter
        self.fired = False
        self.touched = False
        self._undo: list[Callable[[], None]] = []

    def ready(self) -> bool:
        p = self.param
        if in_no_sync(p):
            return False
        if isinstance(p, DistributedParameter):
            return p.pending_contributions == 0
        return all(getattr(m, "pending_backward_dw", 0) == 0 for m in self.owners)

    def on_contribution(self) -> None:
        self.touched = True
        self.check()

    def check(self) -> None:
        if self.touched and not self.fired and self.entries and self.ready():
            self.fire()

    def fire(self) -> None:
        self.fired = True
        for e in list(self.entries):
            e.hook(e.name, self.param)

    def end_step(self) -> None:
        if self.touched and not self.fired and self.entries:
            self.fire()
        self.fired = self.touched = False

    def add_owner(self, module: nn.Module) -> None:
        if any(m is module for m in self.owners):
            return
        self.owners.append(module)
        register = getattr(module, "register_wgrad_accumulation_and_reduce_hooks", None)
        if register is None:
            return
        callback = self.on_contribution
        register(callback)
        hooks = getattr(module, "wgrad_accumulation_and_reduce_hooks", None)
        if isinstance(hooks, list):
            self._undo.append(lambda: hooks.remove(callback) if callback in hooks else None)

    def uninstall(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self.owners.clear()
        if getattr(self.param, _STATE, None) is self:
            delattr(self.param, _STATE)


def _install(p: nn.Parameter) -> _ReadyState:
    state = _ReadyState(p)
    if isinstance(p, DistributedParameter):
        state._undo.append(p.add_contribution_listener(state.on_contribution))
    else:
        handle = p.register_post_accumulate_grad_hook(lambda _p: state.on_contribution())
        state._undo.append(handle.remove)
    setattr(p, _STATE, state)
    return state


_tokens = itertools.count()


class GradReadyHandle:
    """Returned by :func:`register_grad_ready_hook`; ``remove()`` unregisters the hook."""

    def __init__(self, token: int, states: list[_ReadyState]) -> None:
        self._token = token
        self._states = states

    def remove(self) -> None:
        for state in self._states:
            state.entries = [e for e in state.entries if e.token != self._token]
            if not state.entries:
                state.uninstall()
        self._states = []


def register_grad_ready_hook(model_chunks: nn.Module | Sequence[nn.Module],
                             hook: Callable[[str, nn.Parameter], Any]) -> GradReadyHandle:
    """Calls ``hook(name, param)`` once per distinct parameter per step, when its gradient is complete.

    "Complete": [Note: grad-ready, once per parameter per step]; a distwgrad weight's hook runs after its own
    reduction. Register after the model is built (deferring modules are looked up now). Returns a handle whose
    ``remove()`` unregisters ``hook``; ``name`` is prefixed by the chunk index when there are several chunks.
    """
    if not callable(hook):
        raise TypeError(f"register_grad_ready_hook: hook must be callable, got {hook!r}")
    chunks = chunks_of(model_chunks, "register_grad_ready_hook")
    owners: dict[int, list[nn.Module]] = {}
    for m in deferred_modules(chunks):
        for p in m.parameters():
            owners.setdefault(id(p), []).append(m)
    token = next(_tokens)
    states = []
    for name, p in named_distinct_params(chunks):
        if not p.requires_grad:
            continue
        state = getattr(p, _STATE, None) or _install(p)
        if not isinstance(p, DistributedParameter):
            for m in owners.get(id(p), []):
                state.add_owner(m)
        state.entries.append(_Entry(token, name, hook))
        states.append(state)
    return GradReadyHandle(token, states)


def grad_ready_check(params: list[torch.Tensor]) -> None:
    """Fires the hooks of ``params`` that are complete now (``grad_sync_func``'s explicit signal)."""
    for p in params:
        state = getattr(p, _STATE, None)
        if state is not None:
            state.check()


def grad_ready_end_step(params: list[torch.Tensor]) -> None:
    """At the step's end: fire what received a contribution and has not fired, then reset."""
    for p in params:
        state = getattr(p, _STATE, None)
        if state is not None:
            state.end_step()
