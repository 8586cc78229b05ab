"""``DistributedParameter``: the gradient accounting every distwgrad weight shares.

A weight counts the contributions a step owes it and reduces exactly when all have arrived; subclasses
provide ``_gather`` and ``_reduce``. Its states: [Note: weight lifecycle] in ``weights/lifecycle.py``.

[Note: contribution accounting]
* A forward's ``record_use()`` counts a use on the weight (tied uses and microbatches add up); its ``Use``
  rides on the autograd context and, freed undelivered, withdraws the use (a dropped graph owes nothing)
  without a collective, as it may run in the GC. A graph kept alive still owes its contribution.
* Each wgrad adds into ``grad_buffer()`` (fp32, full size; never assign) or arrives as a fresh first
  contribution ([Note: a fresh first contribution] in ``wgrad/accumulate.py``); ``finalize_group_grads``
  counts it, and one no use accounts for raises. A retained graph's second backward records a use first.
* ``PER_MICROBATCH`` (default) reduces when deliveries catch up with uses, holding 1/N between microbatches;
  ``PER_STEP`` reduces once, in ``finish_step``. Collectives fire in completion order, the same on every
  rank; the result is the fp32 average over ``dp_size`` ranks ([Note: device meshes] in ``weights/sharded.py``).
* ``async_reduce``: at most ``MAX_INFLIGHT_REDUCTIONS`` in flight per process, the oldest landing first, and
  never a weight's accumulating and in-flight buffers together; bit-identical to the synchronous path.
* ``finish_step`` refuses a step with a contribution missing and leaves it open: finish again once fixed,
  or ``finalize_model_grads(model, discard=True)``.

[Note: a group of one]
With ``dp_size == 1`` an fp32 ``main_grad`` is ``grad_buffer()`` itself: wgrads accumulate in place, with no
full-size buffer and no reduction (a shard group of one with replicas still all-reduces). Microbatches add
into one running sum, the buffered result up to fp32 rounding order; a CUDA graph captures the same adds.

[Note: .grad is main_grad]
Where the dtypes agree, ``finish_step`` makes ``.grad`` ``main_grad`` itself (no copy per step). A step that
opens and zeroes a kept ``main_grad`` that ``.grad`` still is gives ``.grad`` a copy first: it keeps its values.

[Note: main_grad lifetime]
One the weight created lives until the next step opens and releases it, so no fp32 gradient is held between
``zero_grad()`` and backward. One a caller attached (Megatron, a TE user) or a CUDA graph baked in is kept,
and zeroed in place at the opening or flagged ([Note: an unwritten accumulator] in ``weights/first_write.py``).
So read ``main_grad`` between ``finalize_model_grads`` and the next forward, or read ``.grad``.

[Note: mixed precision]
FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` (``docs/protocol.md``). The tensor's dtype (fp32) is the
master's, and that of ``grad_buffer()``, the reduction, ``main_grad`` and ``.grad``. ``param_dtype`` (never
wider; read through ``compute_dtype``) is every full weight's: ``_gather`` casts BEFORE the all-gather, so
it moves ``param_dtype`` bytes, and alone returns the cast copy, never the master. FP8 quantizes from the
fp32 master ([Note: fp8 distributed weights] in ``fp8/weights.py``).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from distwgrad.weights import _accounting, _comm
from distwgrad.weights.lifecycle import (
    Lifecycle,
    MissingContributionError,
    ReducePolicy,
    WeightState,
    install_optimizer_hooks,
    main_grad_of,
)

__all__ = ["ReducePolicy", "DistributedParameter", "MissingContributionError", "WeightState", "main_grad_of",
           "compute_dtype"]

T = TypeVar("T")
# The dtypes a weight may compute in ([Note: mixed precision]); FP8 goes through a recipe instead.
_PARAM_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
# Attributes a deep copy shares rather than copies: process groups and meshes are handles, not data.
_SHARED_HANDLES = frozenset({"_group_ref", "_replicate_ref", "_stage_tie_ref", "mesh", "expert_mesh"})


def compute_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype modules compute in with ``param``: its ``param_dtype``, else its dtype ([Note: mixed precision])."""
    param_dtype = getattr(param, "param_dtype", None)
    return param.dtype if param_dtype is None else param_dtype


def _check_param_dtype(param_dtype: torch.dtype | None, tensor_dtype: torch.dtype) -> None:
    """``param_dtype`` must be None or a floating dtype no wider than the tensor's."""
    if param_dtype is None:
        return
    if not isinstance(param_dtype, torch.dtype) or param_dtype not in _PARAM_DTYPES:
        raise TypeError(f"param_dtype must be None or one of {[str(d) for d in _PARAM_DTYPES]}, got "
                        f"{param_dtype!r}")
    if tensor_dtype not in _PARAM_DTYPES or param_dtype.itemsize > tensor_dtype.itemsize:
        raise ValueError(f"param_dtype={param_dtype} is wider than the weight's dtype {tensor_dtype}: the "
                         f"master copy keeps the tensor's dtype and computes in a narrower (or equal) one")


class DistributedParameter(nn.Parameter):
    """Base of distwgrad's weights: an ``nn.Parameter`` of the local tensor; others never touch its ``_life``."""

    is_distributed_weight = True
    acts_for_itself = True  # each weight is a group of its own: [Note: one-member groups exchange bare tensors]
    mesh: Any = None  # set by _init_state; [Note: device meshes] in weights/sharded.py
    _group_ref: Any = None  # weak references to the process groups: [Note: groups held weakly]
    _replicate_ref: Any = None
    _unit: Any = None  # the distwgrad.coalesce unit owning this weight, and its bucket if it coalesces
    _bucket: Any = None  # [Note: coalesced units] in weights/units.py
    _life: Lifecycle

    def __new__(cls, data: torch.Tensor, requires_grad: bool = True):
        return super().__new__(cls, data, requires_grad)

    def _init_state(self, group: Any, reduce_policy: ReducePolicy, full_shape: torch.Size,
                    async_reduce: bool = False, param_dtype: torch.dtype | None = None,
                    replicate_group: Any = None, mesh: Any = None) -> None:
        _check_param_dtype(param_dtype, self.dtype)
        self.param_dtype = param_dtype  # [Note: mixed precision]
        if not isinstance(reduce_policy, ReducePolicy):
            raise TypeError(f"reduce_policy must be a ReducePolicy, got {reduce_policy!r}")
        if not isinstance(async_reduce, bool):
            raise TypeError(f"async_reduce must be a bool, got {async_reduce!r}")
        self.group = group
        self.replicate_group = replicate_group  # [Note: device meshes] in weights/sharded.py
        self.mesh = mesh
        self._solo = self.dp_size == 1  # [Note: a group of one]: no shard peers and no replicas
        self.async_reduce = async_reduce
        self.reduce_policy = reduce_policy
        self.full_shape = torch.Size(full_shape)
        self.ep_size, self.expert_mesh = 1, None  # an expert-parallel weight's: spread_over_experts
        self._life = Lifecycle()
        self.bytes_gathered = 0
        self.bytes_reduced = 0
        install_optimizer_hooks()

    # [Note: groups held weakly]
    # A weight holds its process groups weakly: a strong reference from a model kept to the end of a script
    # would delay a group's destruction to interpreter teardown, where gloo may abort the process ([Note:
    # process groups at exit] in ``weights/_comm.py``). A weight whose group was destroyed raises, never falls
    # back to a group of one. A ``DeviceMesh`` holds its groups: drop it before ``destroy_process_group()``.
    @property
    def group(self) -> Any:
        """The shard group (None: a group of one, no process group initialised)."""
        return self._deref(self._group_ref, "process group")

    @group.setter
    def group(self, group: Any) -> None:
        self._group_ref = None if group is None else weakref.ref(group)

    @property
    def replicate_group(self) -> Any:
        """The replicas' group of a 2-D mesh, else None ([Note: device meshes] in weights/sharded.py)."""
        return self._deref(self._replicate_ref, "replicate group")

    @replicate_group.setter
    def replicate_group(self, group: Any) -> None:
        self._replicate_ref = None if group is None else weakref.ref(group)

    def _deref(self, ref: Any, what: str) -> Any:
        if ref is None:
            return None
        group = ref()
        if group is None:
            raise RuntimeError(f"{self._describe()}: its {what} was destroyed (destroy_process_group()); the weight "
                               f"cannot gather or reduce any more")
        return group

    @property
    def dp_size(self) -> int:
        """The data-parallel ranks the gradient averages over: the group's size times the replicas'."""
        return _comm.group_size(self.group) * _comm.group_size(self.replicate_group)

    def reduction_groups(self) -> tuple[Any, ...]:
        """The groups a gradient is summed over, in order: the group, then the replicas' (if any)."""
        return (self.group,) if self.replicate_group is None else (self.group, self.replicate_group)

    # [Note: a weight tied across pipeline stages]
    # A weight used on stages of different ranks (embedding and lm_head) is one copy per stage, sharded over
    # its stage's data-parallel group (a cross-stage gather would couple the schedules). At finalize each copy
    # reduces over its group, then the copies SUM over ``stage_tie_group`` (one rank per copy), as tied uses on
    # one rank add, so every copy steps to the same values. A one-element all-reduce first checks that all
    # copies or none had a gradient: a mismatch raises on every rank, never hangs. Each tie needs its own group.
    _stage_ties: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # group id -> its weight

    def tie_across_stages(self, group: Any) -> None:
        """Ties this rank's copy to the others over ``group``, one rank per copy (None or one rank: no tie). Call
        on every copy's rank before the first step ([Note: a weight tied across pipeline stages])."""
        if group is None or _comm.group_size(group) == 1:
            self._stage_tie_ref = None
            return
        if self._life.open:
            raise RuntimeError(f"{self._name()}: tie_across_stages during an open step; tie before the first forward")
        other = DistributedParameter._stage_ties.get(id(group))
        if other is not None and other is not self:
            raise ValueError(f"{self._name()}: the stage-tie group is already the group of {other._name()}; give "
                             f"each tied weight a group of its own (dist.new_group with the same ranks)")
        DistributedParameter._stage_ties[id(group)] = self
        self._stage_tie_ref = weakref.ref(group)

    @property
    def stage_tie_group(self) -> Any:
        """The group the copies of a weight tied across pipeline stages sum over, else None."""
        return self._deref(getattr(self, "_stage_tie_ref", None), "stage-tie group")

    @property
    def solo(self) -> bool:
        """No shard peers and no replicas: nothing to reduce ([Note: a group of one])."""
        return self._solo

    @property
    def coalesced(self) -> bool:
        """Whether a ``distwgrad.coalesce`` unit gathers and reduces this weight with others."""
        return self._bucket is not None

    # --- what subclasses provide -------------------------------------------------------------------
    def _gather(self) -> torch.Tensor:
        raise NotImplementedError

    def _local_for_gather(self) -> torch.Tensor:
        """The local data in the compute dtype: a cast copy under ``param_dtype`` ([Note: mixed precision])."""
        local = self.detach()
        if self.param_dtype is None or self.param_dtype == self.dtype:
            return local
        return local.to(self.param_dtype)

    def _reduce(self, buffer: torch.Tensor, async_op: bool = False) -> Callable[[], torch.Tensor]:
        """Launches the reduction of ``buffer``; the returned callable waits and gives the local result."""
        raise NotImplementedError

    # --- the protocol --------------------------------------------------------------------------------
    def materialize_group_for_forward(self) -> list[torch.Tensor]:
        if self._bucket is not None:  # [Note: coalesced units] in weights/units.py
            return [self._unit.forward_copy(self)]
        return [self._gather()]

    def materialize_group_for_backward(self) -> list[torch.Tensor]:
        if self._bucket is not None:
            return [self._unit.backward_copy(self)]
        return [self._gather()]

    def grad_buffer(self) -> torch.Tensor:
        return self._life.grad_buffer(self)

    def ready_for_fresh_grad(self) -> bool:
        """Whether the next contribution may become the buffer as a fresh fp32 tensor (not under capture, nor
        over an in-place ``main_grad``: [Note: a fresh first contribution]); lands reductions in flight first."""
        return self._life.ready_for_fresh(self)

    def adopt_grad_buffer(self, wgrad: torch.Tensor) -> None:
        """Takes ``wgrad`` (fresh, fp32, this weight's alone) as the buffer, after ``ready_for_fresh_grad()``."""
        self._life.adopt(self, wgrad)

    def take_unwritten(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(main_grad, flag)`` for a flag-reading kernel whose caller then clears the flag, else None (use
        ``grad_buffer()``): [Note: an unwritten accumulator] in ``weights/first_write.py``."""
        return self._life.take_unwritten(self)

    @property
    def accumulates_in_place(self) -> bool:
        """Whether an open step's wgrads would accumulate straight into ``main_grad`` ([Note: a group of one])."""
        main_grad = getattr(self, "main_grad", None)
        return self._solo and (main_grad is None or main_grad.dtype == torch.float32)

    def finalize_group_grads(self, wgrads: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Counts one contribution: a bare wgrad or a one-element list ([Note: one-member groups exchange bare
        tensors])."""
        if isinstance(wgrads, torch.Tensor):
            wgrad = wgrads
        elif len(wgrads) != 1:
            raise ValueError(f"{self._name()} acts for itself: expected 1 wgrad, got {len(wgrads)}")
        else:
            (wgrad,) = wgrads
        buf = self.grad_buffer()
        if wgrad is not buf:
            if tuple(wgrad.shape) != tuple(self.full_shape):
                raise ValueError(f"{self._name()}: wgrad of shape {tuple(wgrad.shape)} for a weight of full "
                                 f"shape {tuple(self.full_shape)}")
            buf.add_(wgrad)
        self._life.counted(self)
        return None

    # --- accounting ----------------------------------------------------------------------------------
    @property
    def state(self) -> WeightState:
        """Where the weight is in its step: [Note: weight lifecycle] in ``weights/lifecycle.py``."""
        return self._life.state

    def expect_contribution(self, count: int = 1) -> None:
        """Records ``count`` uses in forward that will deliver a gradient; opens a step if needed."""
        self._life.expect(self, count)

    def record_use(self) -> _accounting.Use:
        """Records one use; hold the ``Use`` on the autograd context ([Note: contribution accounting])."""
        self._life.expect(self, 1)
        return _accounting.Use(self, self._life.step_id)

    @property
    def pending_contributions(self) -> int:
        """Uses recorded this step whose gradient has not been delivered yet."""
        return self._life.pending

    @property
    def expected_contributions(self) -> int:
        """Uses recorded this step (delivered or not)."""
        return self._life.expected

    main_grad: torch.Tensor | None  # annotation only: an attribute that does not exist until set (hasattr)

    def _main_grad(self, keep: bool = False) -> torch.Tensor:
        return self._life.main_grad(self, keep)

    def keep_main_grad(self) -> torch.Tensor:
        """``main_grad``, made if absent and never released (for a CUDA graph: [Note: main_grad lifetime])."""
        return self._main_grad(keep=True)

    def reduce_now(self) -> bool:
        """Reduces the buffer now if no contribution is missing; True if it did (Megatron's ``grad_sync_func``)."""
        life = self._life
        if life.pending or life.delivered == life.reduced:
            return False
        life.reduce_pending(self)
        return True

    def wait_for_reductions(self) -> int:
        """Lands the reductions in flight into ``main_grad`` in launch order; returns how many there were."""
        return self._life.wait_inflight(self)

    def discard_step(self) -> None:
        """Abandons the open step: in-flight reductions waited for and dropped, counts reset; ``.grad`` untouched."""
        self._life.discard(self)

    def spread_over_experts(self, mesh: Any) -> None:
        """Makes this one ep rank's experts on ``mesh`` (2-D ``(ep, dp)``, ``dp`` the weight's group), before the
        first step: the gradient is also divided by ``ep`` and checkpoints name the whole ``[E, ...]`` tensor
        ([Note: expert-parallel dispatch] in ``distwgrad/parallel/experts.py``)."""
        if (getattr(mesh, "ndim", None) != 2 or getattr(mesh, "mesh_dim_names", None) != ("ep", "dp")
                or mesh.get_group("dp") is not self.group or self.replicate_group is not None):
            raise ValueError(f"{self._name()}: spread_over_experts needs the 2-D ('ep', 'dp') DeviceMesh whose 'dp' "
                             f"group is the weight's group (not an HSDP weight), got {mesh!r}")
        if self._life.open:
            raise RuntimeError(f"{self._name()}: spread_over_experts during an open step; call it before the first "
                               f"forward")
        self.ep_size, self.expert_mesh = mesh.size(0), mesh

    @property
    def global_shape(self) -> torch.Size:
        """The shape checkpoints name: ``full_shape``, or for an expert weight every ep rank's rows."""
        ep = self.ep_size
        return self.full_shape if ep == 1 else torch.Size((ep * self.full_shape[0], *self.full_shape[1:]))

    def finish_step(self, scale: float | None = None) -> bool:
        """Ends the step: reduce what is left, scale, add to ``.grad``. Returns False if nothing to do."""
        if self.ep_size > 1:
            scale = (1.0 if scale is None else scale) / self.ep_size
        return self._life.finish(self, scale)

    def master_written(self, by: str = "a write to the weight") -> None:
        """Says the data changed unseen (a hand-made update): drops every derived cache. ``torch.optim`` steps and
        ``distwgrad.checkpoint`` loads call it. Raises ``UnfinalizedStepError`` over unfinalized contributions."""
        self._life.written(self, by)

    def cached(self, key: Hashable, make: Callable[[], T], refresh: bool = False) -> T:
        """``make()`` (an amax, a scale grid, an FP8 copy), reused for ``key`` within the open step ([Note: weight
        lifecycle]); ``refresh``: made afresh, and stored in place of the one kept."""
        return self._life.cached(self, key, make, refresh)

    def pin_cache(self, key: Hashable, value: Any) -> None:
        """Stores ``value`` for ``key`` until the next step boundary, whatever the state (``sync_weight_amax``)."""
        self._life.pin(self, key, value)

    def copy_token(self) -> tuple[int, int]:
        """What a copy records: use it only while this is unchanged, within its step ([Note: weight lifecycle])."""
        return self._life.epoch, self._version

    def add_contribution_listener(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Calls ``fn()`` after each counted contribution (Megatron's grad-ready hooks); returns its remover."""
        self._life.listeners.append(fn)

        def remove() -> None:
            if fn in self._life.listeners:
                self._life.listeners.remove(fn)
        return remove

    @property
    def names(self) -> tuple[str, ...]:
        """The weight's paths in its model(s), once ``finalize_model_grads`` (or ``name_weights``) saw them."""
        return self._life.names

    @names.setter
    def names(self, value: Sequence[str]) -> None:
        self._life.names = tuple(value)

    def __deepcopy__(self, memo: dict) -> DistributedParameter:
        """A copy with its own data and gradient state in the same groups; tied uses stay tied (``memo``)."""
        if id(self) in memo:
            return memo[id(self)]
        new = type(self)(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = value if key in _SHARED_HANDLES else copy.deepcopy(value, memo)
        return new

    @property
    def label(self) -> str:
        """The weight for messages: its paths if known (``names``), and its type and shapes."""
        return self._name()

    def _describe(self) -> str:
        return f"{type(self).__name__}(local {tuple(self.shape)}, full {tuple(self.full_shape)})"

    def _name(self) -> str:
        names = self._life.names
        return f"{' = '.join(names)} ({self._describe()})" if names else self._describe()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(local={tuple(self.shape)}, full={tuple(self.full_shape)}, "
                f"rank={_comm.group_rank(self.group)}/{_comm.group_size(self.group)}, dtype={self.dtype}, "
                f"policy={self.reduce_policy.value}, state={self._life.state.value})")
