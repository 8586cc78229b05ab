"""``DistributedParameter``: the accounting every distwgrad weight shares.

A weight knows how many gradient contributions a step owes it and how many have arrived, and it reduces
exactly when they are all there. Subclasses only say how to gather (``_gather``) and how to reduce a
full-size fp32 buffer to their local shape (``_reduce``). The step's state and its transitions are the
weight's lifecycle ([Note: weight lifecycle] in ``weights/lifecycle.py``); the Notes below say what they do.

[Note: contribution accounting]
* A module's forward records one *use* per weight that will need a gradient (grad mode on, weight
  requires grad): ``record_use()`` counts it (``expect_contribution()``) and returns a ``Use`` that the
  forward's autograd context holds (and, through it, a queued deferred wgrad). Tied weights are used
  several times; microbatches add more uses. The count lives on the weight object, so a tied weight
  counts all of its users. ``expect_contribution()`` alone records a use that nothing can withdraw.
* Every wgrad GEMM of such a use (now, or deferred to ``backward_dw``) accumulates into
  ``grad_buffer()`` (fp32, full size: None -> zeros, then add; never assign) and calls
  ``finalize_group_grads``, which counts one delivery. A module's GEMM may instead write the step's
  first contribution as a fresh fp32 tensor that becomes the buffer (None -> initialise with it: [Note: a
  fresh first contribution] in ``wgrad/accumulate.py``). A delivery that no recorded use accounts for
  raises: nothing is counted twice.
* Withdrawn uses: a ``Use`` freed before its contribution arrived withdraws its use. That is a forward
  whose graph was dropped without a backward (a metric, a logged value): torch would produce no gradient
  for it, so none is owed. A queued deferred wgrad keeps its ``Use`` alive, so an undrained one is still
  caught. A withdrawal only lowers the count; it never launches a collective (it can run inside the
  garbage collector), so the buffer is reduced at the weight's next reduction point. CPython frees a
  graph when its last reference goes, at the same point of the program on every rank; a graph kept
  alive (an output stored in a list) still owes its contribution, and ``finalize_model_grads`` says so.
* Retained graphs: a second backward through a graph kept with ``retain_graph=True`` delivers through a
  ``Use`` that already delivered; it first records one more use in the current step, so the
  contribution is added once more, as torch accumulates it, and ``PER_MICROBATCH`` reduces again when
  deliveries catch up. A graph kept across steps counts in the step its backward runs in.
* ``ReducePolicy.PER_MICROBATCH`` (default) reduces when deliveries catch up with uses, i.e. after each
  microbatch's last contribution: the buffer is reduced into the fp32 ``main_grad`` and freed, so
  between microbatches only 1/N of the weight's gradient is held. ``PER_STEP`` keeps accumulating the
  full buffer and reduces once in ``finish_step`` (fewer collectives, full-size memory).
* ``finish_step`` (called by ``distwgrad.finalize_model_grads``) refuses to finish while a contribution
  is missing, reduces what is left, applies the token scaling, then adds the step's gradient to
  ``.grad`` (None initialises, otherwise add, as autograd does) so any ``torch.optim`` optimizer works.
  A second ``finish_step`` with no new contribution is a no-op. The next ``expect_contribution`` opens a
  new step: it releases the ``main_grad`` the weight created, or zeroes in place one it was given
  ([Note: main_grad lifetime]).
* Reset after an error: an error leaves the step open, so the caller may fix it (drain the deferred
  wgrads, run the missing backward) and finish again, or abandon it with
  ``finalize_model_grads(model, discard=True)`` (``discard_step()`` per weight): queued deferred wgrads
  are dropped, reductions in flight are waited for and dropped, the buffer is freed, the counts reset and
  ``.grad`` is left as it was; uses of the abandoned step no longer count. The next step starts clean.
* Collectives fire in the order contributions complete, which is the same on every rank because every
  rank runs the same program; the reduction is an fp32 sum divided by the number of data-parallel ranks
  (``dp_size``: the group's size, times the replicas on a 2-D mesh: [Note: device meshes] in
  ``weights/sharded.py``): an average, as DDP and FSDP do.
* With ``async_reduce=True`` a reduction is launched without waiting (``async_op``), so it overlaps the
  rest of backward. In-flight bound: at most ``MAX_INFLIGHT_REDUCTIONS`` (1) reductions are in flight in
  a process; launching another first lands the oldest (waits, adds it to its ``main_grad``, frees its
  input), and any that already completed land at no cost. A weight never holds an accumulating buffer
  and an in-flight one together: ``grad_buffer()`` lands the weight's own reduction before allocating.
  ``wait_for_reductions()`` and ``finish_step`` land what is left. Each weight's adds happen in launch
  order, so the result is bit-identical to the synchronous one.
* Memory per policy, for N ranks and fp32 gradients (``main_grad`` is 1/N of the full gradient):
  synchronous ``PER_MICROBATCH``: 1/N of every weight plus the buffer of the weight whose wgrads are
  accumulating; between microbatches 1/N only. Async ``PER_MICROBATCH``: the same plus one in-flight
  buffer (a weight's full size; between microbatches 1/N plus at most one buffer). ``PER_STEP``: the full
  buffer of every weight used, from its first contribution to the end of the step. None of these grow
  with the number of microbatches (``tests/test_gradient_memory.py`` measures it).

[Note: a group of one]
A weight whose group has one rank (one GPU, or a ``ReplicatedWeight`` alone) and no replicas
(``dp_size == 1``) has nothing to reduce, and its full gradient has ``main_grad``'s shape. (A shard group of
one on a 2-D mesh with R > 1 replicas still all-reduces across them: [Note: device meshes].)
There ``grad_buffer()`` is ``main_grad`` itself (when it is fp32, as it is unless a caller attached
another): wgrads accumulate in place, with no full-size buffer to zero, no add into ``main_grad`` and no
reduction. Counting, withdrawals and ``finish_step`` are unchanged. With one microbatch per step the sums
are the buffered path's fp32 adds in the same order (a buffer started at zero, added to a zeroed
``main_grad``), bit for bit; with several, the microbatches' contributions add into one running sum where
the buffered path adds one reduced sum per microbatch (``((a1 + b1) + a2) + b2`` against
``(a1 + b1) + (a2 + b2)``): the same gradient up to fp32 rounding order. A CUDA graph captures the same
in-place adds (graphs.py), so a graphed step is bit-identical to the eager one.

[Note: .grad is main_grad]
``finish_step`` hands ``main_grad`` itself to ``.grad`` where their dtypes agree (an fp32 master, or an
fp32 weight): no full-size copy per step (Megatron's optimizers read ``main_grad`` the same way). When
the next step opens, ``.grad`` keeps its values whatever happens to ``main_grad`` ([Note: main_grad
lifetime]): a released ``main_grad`` simply stays ``.grad``'s tensor; one zeroed in place is first copied
into a new ``.grad`` if ``.grad`` still IS it (``zero_grad(set_to_none=False)``, or gradients kept
across steps on purpose). The step's gradient is then added to ``.grad`` (None initialises, otherwise
add). ``zero_grad()`` (``set_to_none=True``, torch's default) pays no copy at all.

[Note: main_grad lifetime]
Who created a weight's ``main_grad`` decides how long it lives.
* The weight (none was attached when its first contribution arrived): the weight's own. It lives from
  the step's first contribution to the next step's opening, which releases it (``main_grad`` is None
  until the next contribution creates it again). So between ``zero_grad()`` and the next backward no
  fp32 gradient is held, as with FSDP2 or plain torch, where ``zero_grad(set_to_none=True)`` frees
  ``.grad``; with an fp32 master that is 4 bytes per local parameter the step does not hold through its
  forward. Creating it is the same fp32 zeros the step's opening used to write, so nothing is added.
* A caller (Megatron attaches views into its flat buffer, ``attach_main_grads``; a TransformerEngine user
  attaches their own), or a CUDA graph, which bakes in its address (``make_graphed_callables`` and any
  capture that accumulates into it keep it): kept, and zeroed in place when the next step opens; never
  replaced. A weight that ``make_graphed_callables`` captured accumulating in place is not zeroed: the step
  that opens flags its ``main_grad`` as holding nothing and the step's first contribution writes it
  ([Note: an unwritten accumulator] in ``weights/first_write.py``).
Read ``main_grad`` between ``finalize_model_grads`` and the next forward, or use ``.grad``, which the
optimizer steps on and which keeps its values either way.

[Note: mixed precision]
FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``, for distwgrad's weights (``param_dtype`` on
``ShardedWeight.from_full`` / ``from_shard`` and ``ReplicatedWeight.from_full``; None: no cast).
* fp32 (the tensor's dtype): the parameter's own data, i.e. the local shard, which is the master copy
  the optimizer steps on and checkpoints save; ``grad_buffer()``; the reduction; ``main_grad`` and
  ``.grad`` (both of the shard's shape and dtype).
* ``param_dtype`` (bf16 or fp16, never wider than the tensor): every materialized full weight, and so
  the modules' GEMMs, their inputs and outputs. ``compute_dtype(param)`` is the one place a module reads
  it (a plain tensor's is its own dtype).
* Where the cast happens: in ``_gather``, on the local shard, BEFORE the collective: cast, pad,
  all-gather. The gather therefore moves ``param_dtype`` bytes and ``bytes_gathered`` counts them (half
  of an fp32 gather for bf16). With one rank the cast copy is returned (never the master itself). The
  copy is transient like every gathered weight: never saved for backward, never cached.
* Wgrads: ``param_dtype`` operands, accumulated into the fp32 buffer (on CUDA the GEMM writes fp32
  directly; on CPU each product is rounded once to ``param_dtype`` and added in fp32, exactly what
  ``w.to(param_dtype)`` inside plain autograd produces).
* FP8 recipes quantize from the fp32 master (one rounding, never bf16 then FP8); the FP8 GEMMs' outputs
  take the input's dtype ([Note: fp8 distributed weights] in ``fp8/weights.py``).
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
    """The dtype a module computes in with ``param``: its ``param_dtype`` if set, else its own dtype.

    The one place every module reads it ([Note: mixed precision]); plain tensors give their dtype.
    """
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
    """Base class of distwgrad's weights: an ``nn.Parameter`` holding this rank's local tensor.

    Its step is a :class:`~distwgrad.weights.lifecycle.Lifecycle` ([Note: weight lifecycle]); ``state`` says
    where it is. Other modules use the public methods below, never the lifecycle's fields."""

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
    # A weight refers to its process groups weakly: torch's registry keeps a group alive until
    # ``destroy_process_group()``, and a group a weight (and so a model kept to the end of a script) held on
    # to would be destroyed during the interpreter's teardown instead, where gloo's intermittently aborts the
    # process ([Note: process groups at exit] in ``weights/_comm.py``).
    # A weight used after its group was destroyed says so, rather than falling back to a group of one. (A
    # ``DeviceMesh`` holds its groups itself, so a weight built on a mesh keeps them alive through it, as
    # FSDP2's parameters do: drop the model or the mesh before ``destroy_process_group()`` there.)
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
    # A weight used on two pipeline stages held by different ranks (the embedding on the first stage, the
    # lm_head on the last) is one copy per stage, each sharded over its stage's data-parallel group as any
    # weight: a gather across stages would tie the stages' schedules together. Each copy counts its own
    # uses; at finalize each copy reduces over its group (the average over data parallelism, as ever), then
    # the copies SUM over ``stage_tie_group`` (one rank per copy holding the same shard): the two uses of one
    # weight add, as tied uses on one rank do. Every copy then holds the same ``main_grad`` and ``.grad``
    # and, stepped by the same optimizer, the same values. Before the sum the copies agree on whether each
    # has a gradient this step (a one-element all-reduce): a step that used one copy and not another is an
    # error on every rank, never a hang or half a gradient. Each tied weight has a group of its own, so two
    # tied weights can never sum into each other whatever order their stages finalize them in.
    _stage_ties: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # group id -> its weight

    def tie_across_stages(self, group: Any) -> None:
        """This weight is this rank's copy of a weight used on several pipeline stages; ``group`` holds one
        rank per copy, each holding the same shard ([Note: a weight tied across pipeline stages]). A group
        of one (or None) ties nothing. Call before the first step, on every rank holding a copy."""
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
        """Whether the step's next contribution may arrive as a fresh fp32 tensor that becomes the buffer
        ([Note: a fresh first contribution] in ``wgrad/accumulate.py``): none has arrived since the last
        reduction, no CUDA graph is capturing (a capture's buffers are baked in), and in place only while
        the weight has no ``main_grad`` (one that exists, attached or this step's, is added into). Lands the
        weight's reductions in flight first, as ``grad_buffer()`` does before it allocates."""
        return self._life.ready_for_fresh(self)

    def adopt_grad_buffer(self, wgrad: torch.Tensor) -> None:
        """Takes ``wgrad`` (a fresh fp32 product the caller made for this weight alone) as the buffer, after
        ``ready_for_fresh_grad()``; in place it is the weight's own ``main_grad`` ([Note: main_grad
        lifetime]). ``finalize_group_grads(wgrad)`` then counts it without an add."""
        self._life.adopt(self, wgrad)

    def take_unwritten(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(main_grad, flag)`` for a kernel that reads the flag, when this contribution is the first of its
        microbatch into a flagged ``main_grad`` (eagerly: the host knows the flag is set; under capture: it
        may be, on some replay); it becomes the buffer. None: use ``grad_buffer()``. The caller launches the
        kernel, then clears the flag ([Note: an unwritten accumulator] in ``weights/first_write.py``)."""
        return self._life.take_unwritten(self)

    @property
    def accumulates_in_place(self) -> bool:
        """Whether this weight's wgrads, were a step open, accumulate straight into its fp32 ``main_grad``
        ([Note: a group of one]): a group of one whose ``main_grad`` is fp32 or not made yet."""
        main_grad = getattr(self, "main_grad", None)
        return self._solo and (main_grad is None or main_grad.dtype == torch.float32)

    def finalize_group_grads(self, wgrads: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Counts one contribution; ``wgrads`` is the bare wgrad (a one-member group, as the dispatchers
        pass it: [Note: one-member groups exchange bare tensors] in protocol.py) or a one-element list."""
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
        """Records one use (``expect_contribution()``) tied to the returned ``Use``: hold it where the
        use's backward will find it (the autograd context). Freed undelivered, it withdraws the use."""
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
        """``main_grad``, made now if absent and kept from now on (a CUDA graph bakes in its address:
        [Note: main_grad lifetime])."""
        return self._main_grad(keep=True)

    def reduce_now(self) -> bool:
        """Reduces what the buffer holds now, if every contribution owed so far has arrived.

        Returns True if a reduction ran. Used by schedules that trigger reductions themselves
        (Megatron's ``grad_sync_func``); a weight with missing contributions is left untouched.
        """
        life = self._life
        if life.pending or life.delivered == life.reduced:
            return False
        life.reduce_pending(self)
        return True

    def wait_for_reductions(self) -> int:
        """Waits for the reductions in flight and adds them to ``main_grad``, in launch order; returns
        how many there were. Schedules call it to block on the step's reductions (Megatron's finalize)."""
        return self._life.wait_inflight(self)

    def discard_step(self) -> None:
        """Abandons the open step (any state -> IDLE): reductions in flight are waited for (their collectives
        were launched on every rank) and dropped, the buffer is freed, the counts reset; ``.grad`` and
        ``main_grad`` are left as they are (the next step releases or zeroes ``main_grad``: [Note: main_grad
        lifetime]). Uses of the abandoned step no longer count."""
        self._life.discard(self)

    def spread_over_experts(self, mesh: Any) -> None:
        """This weight holds one expert-parallel rank's experts (rows of a packed ``[E, ...]`` tensor), whose
        tokens come from every rank of the ``ep`` dim of ``mesh``, a 2-D ``(ep, dp)`` ``DeviceMesh`` whose
        ``dp`` dim is the weight's group (``distwgrad.parallel.ExpertParallel``). Its reduced gradient is
        divided by ``ep`` as well, so it averages over every rank that sent it tokens, as a weight of the
        whole model averages over every data-parallel rank; checkpoints name the whole ``[E, ...]`` tensor,
        this rank's rows placed by ``mesh`` ([Note: expert-parallel dispatch] in
        ``distwgrad/parallel/experts.py``). Call before the first step."""
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
        """Says the weight's data changed where the runtime cannot see it (a load, a hand-made update):
        every cache derived from it is dropped ([Note: weight lifecycle]). ``torch.optim`` steps and
        ``distwgrad.checkpoint`` loads call it themselves. Refused while the step has unfinalized
        contributions (``UnfinalizedStepError``)."""
        self._life.written(self, by)

    def cached(self, key: Hashable, make: Callable[[], T]) -> T:
        """``make()`` (a value derived from this weight's data: an amax, a scale grid), reused for ``key``
        while it is current: within the open step it was made in ([Note: weight lifecycle])."""
        return self._life.cached(self, key, make)

    def pin_cache(self, key: Hashable, value: Any) -> None:
        """Stores ``value`` for ``key`` until the weight's next step boundary, whatever its state (an
        explicit refresh for the step about to open: ``sync_weight_amax``)."""
        self._life.pin(self, key, value)

    def copy_token(self) -> tuple[int, int]:
        """What a copy of this weight records when made; the copy may be used only while the token is
        unchanged (and within the step or pass it was made for: [Note: weight lifecycle])."""
        return self._life.epoch, self._version

    def add_contribution_listener(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Calls ``fn()`` after each contribution is counted (and reduced, when due); returns a function
        that removes it. Megatron's grad-ready hooks listen here."""
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
        """A copy with its own data and gradient state, in the same process group (groups are shared
        handles, not data). Tied uses stay tied in a deep-copied model (``memo``)."""
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
