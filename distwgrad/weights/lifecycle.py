"""The life of a distributed weight across a step: one state machine, and every cache tied to it.

[Note: weight lifecycle]
A :class:`Lifecycle` (``w._life``) owns a weight's step (counts, buffers, caches); ``w.state`` reads it::

    IDLE --use--> PENDING --last contribution--> COMPLETE --reduction--> REDUCED --finalize--> FINALIZED
                    ^                                  |                    |                      |
                    +--- another use (a microbatch, a tied use, a retained graph's backward) ------+
    FINALIZED --optimizer step, load--> IDLE;   any state --discard--> IDLE;
    PENDING --every use withdrawn, nothing delivered (a forward whose output was dropped)--> IDLE

COMPLETE: every use delivered, some not reduced yet (``PER_STEP``, or a coalesced bucket waiting).
Errors, naming the weight's paths: a contribution no use accounts for; finalizing with one missing
(``MissingContributionError``); an optimizer step (any ``torch.optim``: a global hook) or a load over a step
with unfinalized contributions (``UnfinalizedStepError``: the step would train nothing).

Caches (FP8 amaxes and scales, a unit's gathered copies) record ``epoch``, which moves at every finalize,
discard, optimizer step and load, and ``_version``, and are used only while both hold. ``.data`` writes bump
neither, so a cache is also kept only while a step is open and dies with it: ``_version`` only ever drops a
cache, never keeps one. Writing ``.data`` while a step is open is not supported.
"""

from __future__ import annotations

import enum
import gc
from collections.abc import Callable, Hashable, Iterable
from typing import Any, TypeVar

import torch
from torch import nn

from distwgrad.weights import _accounting, _comm, first_write

__all__ = ["WeightState", "ReducePolicy", "Lifecycle", "UnfinalizedStepError", "MissingContributionError",
           "write_token", "weight_paths", "main_grad_of"]

T = TypeVar("T")


class WeightState(enum.Enum):
    """Where a distributed weight is in its step: [Note: weight lifecycle]."""

    IDLE = "idle"
    PENDING = "pending"
    COMPLETE = "complete"
    REDUCED = "reduced"
    FINALIZED = "finalized"


class ReducePolicy(enum.Enum):
    """When a weight reduces its gradient; see [Note: contribution accounting] in ``weights/base.py``."""

    PER_MICROBATCH = "per_microbatch"
    PER_STEP = "per_step"


class _Phase(enum.Enum):
    IDLE = 0
    OPEN = 1
    FINALIZED = 2


class MissingContributionError(RuntimeError):
    """A step was finished while some weight still expected gradient contributions."""


class UnfinalizedStepError(RuntimeError):
    """An optimizer step (or a load) over weights whose step has contributions that were never finalized."""


# Why a contribution goes missing, and what to do; every accounting error ends with it.
MISSING_CAUSES = (
    "likely causes: a deferred wgrad never drained (drain_deferred_wgrads(model)); a forward output or a "
    "tensor computed from it still holding its graph without a backward (keep out.detach() or out.item(), "
    "or run that forward under torch.no_grad()); a backward interrupted by an error. Fix the cause and "
    "finish again, or abandon the step: finalize_model_grads(model, discard=True)")

# Bumped after every optimizer step over any parameter (torch's global step hook): the part of
# write_token a plain parameter has instead of an epoch.
_optimizer_steps = 0


def _agree_across_stages(w: Any, tie: Any, has_grad: bool) -> None:
    """Raises on every rank unless all copies of a stage-tied weight, or none, have a gradient this step."""
    flag = torch.tensor([int(has_grad)], dtype=torch.int64, device=w.device)
    _comm.all_reduce_sum(flag, tie)
    n, size = int(flag.item()), _comm.group_size(tie)
    if n not in (0, size):
        raise MissingContributionError(
            f"{w._name()}: tied across {size} pipeline stages, but {n} of its copies had a gradient this step; "
            f"every stage holding a copy must use it in every step ([Note: a weight tied across pipeline stages])")


def write_token(p: torch.Tensor) -> tuple[int, int]:
    """What a value derived from ``p`` records; equal tokens never prove ``p`` unchanged (``.data``): keep such
    a value within one step ([Note: weight lifecycle])."""
    life = getattr(p, "_life", None)
    return (life.epoch if isinstance(life, Lifecycle) else _optimizer_steps), p._version


def main_grad_of(param: torch.Tensor) -> torch.Tensor:
    """``param.main_grad`` (local shape), created as fp32 zeros if absent ([Note: main_grad lifetime])."""
    main_grad = getattr(param, "main_grad", None)
    if main_grad is None:
        main_grad = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
        param.main_grad = main_grad
    elif tuple(main_grad.shape) != tuple(param.shape):
        raise ValueError(f"main_grad has shape {tuple(main_grad.shape)} but its parameter has shape "
                         f"{tuple(param.shape)}")
    return main_grad


class Lifecycle:
    """One weight's per-step state ([Note: weight lifecycle]); methods take the weight as ``w``, never held."""

    def __init__(self) -> None:
        self.phase = _Phase.IDLE
        self.step_id = 0  # moves when a step opens or is discarded: a Use of an older step no longer counts
        self.epoch = 0
        self.expected = self.delivered = self.reduced = 0
        self.buffer: torch.Tensor | None = None  # the full-size fp32 accumulator of the open microbatch(es)
        self.inflight: list[Callable[[], torch.Tensor]] = []  # launched reductions, oldest first
        self.has_grad = False  # something reached main_grad this step
        self.own_main_grad: torch.Tensor | None = None  # [Note: main_grad lifetime] in weights/base.py
        self.first_flag: torch.Tensor | None = None  # [Note: an unwritten accumulator] in weights/first_write.py
        self.armed = False  # the flag's host mirror
        self.flag_users = 0  # sets of graphed callables whose graphs read the flag
        self.graph_buffer: torch.Tensor | None = None  # [Note: captured distributed weights] in graphs.py
        self.caches: dict[Hashable, tuple[int, int, Any]] = {}
        self.names: tuple[str, ...] = ()
        self.listeners: list[Callable[[], None]] = []  # called after each counted contribution

    # --- state ---------------------------------------------------------------------------------------
    @property
    def state(self) -> WeightState:
        if self.phase is _Phase.IDLE:
            return WeightState.IDLE
        if self.phase is _Phase.FINALIZED:
            return WeightState.FINALIZED
        if self.delivered < self.expected:
            return WeightState.PENDING
        return WeightState.COMPLETE if self.delivered > self.reduced else WeightState.REDUCED

    @property
    def open(self) -> bool:
        return self.phase is _Phase.OPEN

    @property
    def pending(self) -> int:
        return self.expected - self.delivered

    def complete_unreduced(self) -> bool:
        """Every contribution owed so far arrived, and some is not reduced yet (a coalesced bucket's test)."""
        return self.open and self.delivered == self.expected and self.delivered > self.reduced \
            and self.buffer is not None

    def unfinalized(self) -> bool:
        """Contributions arrived this step and no finalize took them (an optimizer step now would lose them)."""
        return self.open and (self.delivered > 0 or self.has_grad)

    # --- uses ----------------------------------------------------------------------------------------
    def expect(self, w: Any, count: int) -> None:
        """Records ``count`` uses; opens the step from IDLE or FINALIZED."""
        if self.phase is not _Phase.OPEN:
            self._open(w)
        elif w._bucket is not None and w.reduce_policy is ReducePolicy.PER_MICROBATCH and self.complete_unreduced():
            w._bucket.flush()  # used again before its bucket reduced: reduce what is complete now
        self.expected += count

    def _open(self, w: Any) -> None:
        self.wait_inflight(w)  # nothing is in flight after a finalize; never leave one behind
        self.phase = _Phase.OPEN
        self.step_id += 1
        self.expected = self.delivered = self.reduced = 0
        self.has_grad = False
        main_grad, own = getattr(w, "main_grad", None), self.own_main_grad
        self.own_main_grad = None
        capturing = w.is_cuda and torch.cuda.is_current_stream_capturing()
        if main_grad is not None and main_grad is own and not capturing:
            w.main_grad = None  # released; a .grad that is it keeps it: [Note: main_grad lifetime]
        elif main_grad is not None:
            if w.grad is main_grad:  # the last step's .grad is still held: it keeps its values
                w.grad = main_grad.clone()  # [Note: .grad is main_grad]
            if self.first_flag is not None:  # [Note: an unwritten accumulator]
                self.first_flag.fill_(1)
                self.armed = True
            else:
                main_grad.zero_()

    def withdraw(self, step: int) -> None:
        """A use of ``step`` freed without a backward: lowers the count only (the GC may call it); IDLE if empty."""
        if step == self.step_id and self.open and self.expected > self.delivered:
            self.expected -= 1
            if (self.expected == 0 and self.delivered == 0 and self.buffer is None and not self.inflight
                    and self.first_flag is None):
                self.phase = _Phase.IDLE
                self._boundary()

    def is_current(self, step: int) -> bool:
        return step == self.step_id and self.open

    # --- contributions -------------------------------------------------------------------------------
    def counted(self, w: Any) -> None:
        """One contribution has been added into the buffer: count it, reduce when due."""
        self.delivered += 1
        if self.delivered > self.expected:
            raise RuntimeError(
                f"{w._name()} received contribution {self.delivered} but only {self.expected} uses needing a "
                f"gradient were recorded this step (a wgrad delivered twice, a forward that bypassed "
                f"expect_contribution, or reentrant activation checkpointing: use torch.utils.checkpoint(..., "
                f"use_reentrant=False)); this step's gradient is wrong: abandon it with "
                f"finalize_model_grads(model, discard=True)")
        if w.reduce_policy is ReducePolicy.PER_MICROBATCH and self.delivered == self.expected:
            if w._bucket is not None:
                w._bucket.maybe_reduce()  # once no member of the bucket owes one: [Note: coalesced units]
            else:
                self.reduce_pending(w)
        for listener in list(self.listeners):
            listener()

    def add_inflight(self, finish: Callable[[], torch.Tensor]) -> None:
        """A reduction launched on this weight's behalf (its share of a coalesced one): landed in order."""
        self.inflight.append(finish)

    def take_buffer(self) -> torch.Tensor:
        """Hands the buffer to a reduction (a coalesced bucket's); every delivery so far is reduced."""
        buffer, self.buffer = self.buffer, None
        assert buffer is not None, "take_buffer without a buffer"
        self.reduced, self.has_grad = self.delivered, True
        return buffer

    def reduce_pending(self, w: Any) -> None:
        """Reduces what the buffer holds (COMPLETE -> REDUCED), alone or with the weight's bucket."""
        if self.delivered == self.reduced or self.buffer is None:
            return
        if w._bucket is not None:
            w._bucket.flush()  # this weight and every complete member of its bucket, in one collective
            return
        if self.buffer is getattr(w, "main_grad", None):  # accumulated in place: nothing to reduce
            self.buffer = None
            self.reduced, self.has_grad = self.delivered, True
            return
        if w.async_reduce:
            _accounting.admit()  # the in-flight bound: [Note: contribution accounting] in weights/base.py
        buffer = self.take_buffer()
        finish = w._reduce(buffer, async_op=w.async_reduce)
        del buffer  # the launched reduction holds what the collective still needs, nothing more
        if w.async_reduce:
            self.inflight.append(finish)
            _accounting.launched(self, lambda: self.land_oldest(w), finish)
        else:
            self.main_grad(w).add_(finish())

    def land_oldest(self, w: Any) -> None:
        finish = self.inflight.pop(0)
        _accounting.forget(self)
        self.main_grad(w).add_(finish())

    def wait_inflight(self, w: Any) -> int:
        n = len(self.inflight)
        while self.inflight:
            self.land_oldest(w)
        return n

    # --- the buffer ----------------------------------------------------------------------------------
    def in_place(self, w: Any) -> bool:
        """Whether wgrads accumulate straight into ``main_grad``: [Note: a group of one] in weights/base.py."""
        if not w.solo or not self.open:  # a closed step's main_grad is released or zeroed at the next
            return False
        main_grad = getattr(w, "main_grad", None)
        return main_grad is None or main_grad.dtype == torch.float32

    def main_grad(self, w: Any, keep: bool = False) -> torch.Tensor:
        """``main_grad_of(w)``; one it creates is released at the next opening unless ``keep``."""
        created = getattr(w, "main_grad", None) is None
        main_grad = main_grad_of(w)
        if keep:
            self.own_main_grad = None
        elif created:
            self.own_main_grad = main_grad
        return main_grad

    def grad_buffer(self, w: Any) -> torch.Tensor:
        """The buffer contributions accumulate in ([Note: a group of one] in weights/base.py)."""
        if self.buffer is None:
            self.wait_inflight(w)  # one full-size buffer per weight at a time
            capturing = w.is_cuda and torch.cuda.is_current_stream_capturing()
            if self.in_place(w):
                # a CUDA graph captures the same in-place accumulation eager code runs (the same adds in the
                # same order), and keeps main_grad: [Note: main_grad lifetime]
                self.buffer = self.main_grad(w, keep=capturing)
                if self.first_flag is not None and (capturing or self.armed):
                    # added into: zeros first where it holds nothing ([Note: an unwritten accumulator])
                    first_write.settle(self.buffer, self.first_flag, capturing=capturing)
                    self.armed = False
            elif capturing:
                if self.graph_buffer is None:
                    raise RuntimeError(
                        f"{w._name()}: a distributed weight's gradient buffer is allocated and freed once per "
                        f"reduction, so a hand-made capture cannot bake it in; graph the model with "
                        f"distwgrad.make_graphed_callables (a graph-owned buffer) or run backward_dw() outside "
                        f"the graph. [Note: captured distributed weights] in distwgrad/graphs.py")
                self.buffer = self.graph_buffer.zero_()  # the capture zeroes it where eager code allocates
            else:
                self.buffer = torch.zeros(w.full_shape, dtype=torch.float32, device=w.device)
        return self.buffer

    def ready_for_fresh(self, w: Any) -> bool:
        """``DistributedParameter.ready_for_fresh_grad``: [Note: a fresh first contribution]."""
        if self.buffer is not None or not self.open:
            return False
        if w.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        self.wait_inflight(w)
        return not self.in_place(w) or getattr(w, "main_grad", None) is None

    def adopt(self, w: Any, wgrad: torch.Tensor) -> None:
        """``DistributedParameter.adopt_grad_buffer``: ``wgrad`` becomes the buffer."""
        if (tuple(wgrad.shape) != tuple(w.full_shape) or wgrad.dtype != torch.float32
                or wgrad.device != w.device or not wgrad.is_contiguous()):
            raise RuntimeError(f"{w._name()}: a fresh first contribution must be a contiguous float32 tensor of "
                               f"the full shape {tuple(w.full_shape)} on {w.device}, got "
                               f"{wgrad.dtype} {tuple(wgrad.shape)} on {wgrad.device} (contiguous: "
                               f"{wgrad.is_contiguous()})")
        if self.in_place(w):
            w.main_grad = self.own_main_grad = wgrad
        self.buffer = wgrad

    def take_unwritten(self, w: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``DistributedParameter.take_unwritten``: [Note: an unwritten accumulator]."""
        if self.first_flag is None or self.buffer is not None or not self.in_place(w):
            return None
        capturing = w.is_cuda and torch.cuda.is_current_stream_capturing()
        if not (capturing or self.armed):
            return None
        self.buffer = self.main_grad(w, keep=capturing)
        self.armed = False
        return self.buffer, self.first_flag

    # --- the end of a step ---------------------------------------------------------------------------
    def finish(self, w: Any, scale: float | None) -> bool:
        """-> FINALIZED: reduce the rest, scale, add to ``.grad``; False (and IDLE) with no gradient."""
        self._boundary()
        tie = w.stage_tie_group  # [Note: a weight tied across pipeline stages] in weights/base.py
        if not self.open:
            if tie is not None:
                _agree_across_stages(w, tie, False)
            return False
        if self.delivered != self.expected:
            raise MissingContributionError(
                f"{w._name()}: {self.delivered} of {self.expected} gradient contributions this step arrived "
                f"({MISSING_CAUSES})")
        self.reduce_pending(w)
        self.wait_inflight(w)
        self.settle_unwritten(w)  # nothing arrived: main_grad reads as zeros ([Note: an unwritten accumulator])
        self.phase = _Phase.FINALIZED if self.has_grad else _Phase.IDLE
        if w._unit is not None:
            w._unit.units.end_step()  # no gathered copy outlives the step
        if tie is not None:
            _agree_across_stages(w, tie, self.has_grad)
        if not self.has_grad:
            return False
        main_grad = self.main_grad(w)
        if tie is not None:
            _comm.all_reduce_sum(main_grad, tie)
        if scale is not None:
            main_grad.mul_(scale)
        grad = main_grad.to(w.dtype)  # main_grad itself where the dtypes agree
        if w.grad is None:
            w.grad = grad  # [Note: .grad is main_grad] in weights/base.py
        elif w.grad is not grad:
            w.grad.add_(grad)
        w.grad_added_to_main_grad = True
        return True

    def discard(self, w: Any) -> None:
        """``DistributedParameter.discard_step``: any state -> IDLE."""
        while self.inflight:
            _accounting.forget(self)
            self.inflight.pop(0)()
        self.settle_unwritten(w)
        self.buffer = None
        self.expected = self.delivered = self.reduced = 0
        self.phase, self.has_grad = _Phase.IDLE, False
        self.step_id += 1
        self._boundary()
        if w._unit is not None:
            w._unit.units.end_step()

    def written(self, w: Any, by: str) -> None:
        """The master was written (``by``: an optimizer step, a load): FINALIZED -> IDLE, caches dropped."""
        if self.unfinalized():
            raise UnfinalizedStepError(unfinalized_message([w], by))
        self._boundary()
        if self.phase is _Phase.FINALIZED:
            self.phase = _Phase.IDLE

    def _boundary(self) -> None:
        self.epoch += 1
        self.caches.clear()

    # --- caches --------------------------------------------------------------------------------------
    def cached(self, w: Any, key: Hashable, make: Callable[[], T], refresh: bool = False) -> T:
        """``make()``'s value for ``key``, stored only while the step is open ([Note: weight lifecycle]);
        ``refresh``: made afresh even where a current one is stored."""
        entry = None if refresh else self.caches.get(key)
        if entry is not None and entry[0] == self.epoch and entry[1] == w._version:
            return entry[2]
        value = make()
        if self.open:
            self.caches[key] = (self.epoch, w._version, value)
        else:
            self.caches.pop(key, None)
        return value

    def pin(self, w: Any, key: Hashable, value: Any) -> None:
        """Stores ``value`` for ``key`` whatever the state, until the next boundary (``sync_weight_amax``)."""
        self.caches[key] = (self.epoch, w._version, value)

    # --- [Note: an unwritten accumulator] ------------------------------------------------------------
    def settle_unwritten(self, w: Any) -> None:
        """Eagerly: zeros in ``main_grad`` if the open step flagged it and nothing arrived yet."""
        main_grad = getattr(w, "main_grad", None)
        if self.armed and self.first_flag is not None and main_grad is not None:
            first_write.settle(main_grad, self.first_flag, capturing=False)
        self.armed = False


    def use_first_flag(self, w: Any) -> None:
        """One more set of graphs reads the flag: an opening step flags ``main_grad`` instead of zeroing it."""
        main_grad = w.main_grad
        assert w.solo and main_grad is not None and main_grad.dtype == torch.float32, \
            f"{w._name()}: only a weight of a group of one with an fp32 main_grad accumulates in place"
        if self.first_flag is None:
            self.first_flag = first_write.new_flag(w.device)
        self.flag_users += 1
        first_write.zero_where_flagged(main_grad, self.first_flag)
        if self.open and self.delivered == 0 and self.buffer is None:
            self.first_flag.fill_(1)  # the open step's main_grad was zeroed when it opened: either is right
            self.armed = True

    def drop_first_flag(self, w: Any) -> None:
        """One set of graphs that read the flag is gone; after the last, a step that opens zeroes ``main_grad``."""
        self.flag_users = max(self.flag_users - 1, 0)
        if self.flag_users == 0:
            self.settle_unwritten(w)
            self.first_flag = None

    # --- [Note: captured distributed weights] in distwgrad/graphs.py -------------------------------------
    def snapshot(self) -> tuple:
        """What a capture's replay re-applies: the counts, whether a buffer is held, the flag's mirror."""
        return self.expected, self.delivered, self.reduced, self.buffer is not None, self.armed

    def replay(self, w: Any, before: tuple, after: tuple, what: str) -> None:
        """Applies a capture's accounting change (``before`` -> ``after``), which its replay skipped."""
        if (self.buffer is not None) != before[3]:
            raise RuntimeError(f"{what}: {w._name()} has {'a' if self.buffer is not None else 'no'} gradient "
                               f"buffer pending, unlike at capture: a captured weight must not be used eagerly "
                               f"between graphed replays. [Note: captured distributed weights]")
        if after[0] > before[0]:
            self.expect(w, after[0] - before[0])
        self.delivered += after[1] - before[1]
        reduced = after[2] != before[2]
        due = after[1] > before[1] and self.delivered == self.expected
        if self.delivered > self.expected or reduced != due:
            raise RuntimeError(f"{what}: {w._name()} has {self.delivered} of {self.expected} contributions, but "
                               f"its capture {'reduced' if reduced else 'did not reduce'} here: replay the "
                               f"graphed callables in their captured order, one microbatch at a time. "
                               f"[Note: captured distributed weights]")
        if reduced:
            self.reduced, self.has_grad = self.delivered, True
        owned = self.graph_buffer  # None: a group of one, accumulating in main_grad
        self.buffer = (owned if owned is not None else self.main_grad(w)) if after[3] else None
        if before[4] and not after[4]:  # the replay wrote (or settled) main_grad and cleared the flag
            self.armed = False


# --- names ---------------------------------------------------------------------------------------------

def weight_paths(w: torch.Tensor) -> tuple[str, ...]:
    """``w``'s paths in the live modules, for errors where no model is at hand; slow (walks the GC's objects)."""
    modules = [o for o in gc.get_objects() if issubclass(type(o), nn.Module)]  # type(): no proxy warns
    parent: dict[int, tuple[nn.Module, str]] = {}
    for m in modules:
        for name, child in m.named_children():
            parent.setdefault(id(child), (m, name))
    paths = []
    for m in modules:
        for name, p in m.named_parameters(recurse=False):
            if p is w:
                parts, node, seen = [name], m, {id(m)}
                while id(node) in parent:
                    node, child_name = parent[id(node)]
                    if id(node) in seen:
                        break
                    seen.add(id(node))
                    parts.append(child_name)
                paths.append(".".join(reversed(parts)))
    return tuple(sorted(set(paths), key=lambda s: (s.count("."), s), reverse=True))


def unfinalized_message(weights: Iterable[Any], by: str) -> str:
    names = [w._name() if w._life.names else f"{' = '.join(weight_paths(w)) or '<unnamed>'} ({w._describe()})"
             for w in weights]
    return (f"{by} over distributed weights whose step has gradient contributions that were never finalized: "
            f"{'; '.join(names)}. Call distwgrad.finalize_model_grads(model) after the step's backward(s) and "
            f"drains and before optimizer.step() (without it the optimizer sees no gradient and the step "
            f"trains nothing); to abandon the step instead: distwgrad.finalize_model_grads(model, discard=True)")


# --- the optimizer step, whichever optimizer ---------------------------------------------------------------

def _distributed_params(optimizer: torch.optim.Optimizer) -> list[Any]:
    seen: dict[int, Any] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if isinstance(getattr(p, "_life", None), Lifecycle):
                seen.setdefault(id(p), p)
    return list(seen.values())


def _before_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    unfinished = [p for p in _distributed_params(optimizer) if p._life.unfinalized()]
    if unfinished:
        raise UnfinalizedStepError(unfinalized_message(unfinished, f"{type(optimizer).__name__}.step()"))


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    global _optimizer_steps
    _optimizer_steps += 1
    for p in _distributed_params(optimizer):
        p._life.written(p, f"{type(optimizer).__name__}.step()")


_hooks_installed = False


def install_optimizer_hooks() -> None:
    """Registers, once, torch's global optimizer step hooks (any ``torch.optim`` optimizer calls them)."""
    global _hooks_installed
    if not _hooks_installed:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_before_optimizer_step)
        register_optimizer_step_post_hook(_after_optimizer_step)
        _hooks_installed = True
