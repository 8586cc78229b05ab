"""What Linear and GroupedLinear share: deferred-wgrad plumbing, hooks and contribution accounting.

The TransformerEngine-compatible surface lives here once: ``delay_wgrad_compute``,
``fuse_wgrad_accumulation``, ``backward_dw()``, ``need_backward_dw()``,
``register_wgrad_accumulation_and_reduce_hooks(hook)`` and ``skip_backward_post_hook`` on the
parameters of deferred modules (Megatron's DDP then leaves them to the hooks above).

[Note: torch.compile]
Under ``torch.compile`` (``torch.compiler.is_compiling()``) Linear, GroupedLinear, LayerNormMLP (and
LayerNormLinear, through Linear) trace as ONE opaque custom op per module call, ``distwgrad::module_forward``,
whose registered autograd formula is a second opaque op, ``distwgrad::module_backward``
(``distwgrad/nn/_compiled.py``). The bookkeeping stays outside the graph by design: the forward op's
implementation runs, at run time, exactly the eager path (the checks, ``_begin_forward``'s use records,
the autograd function's ``forward`` on a stand-in ctx), and the backward op runs that function's
``backward`` (dgrad, and the wgrad now or queued for ``backward_dw()``). So compiled gradients are the
eager ones bit for bit, and every contribution is counted by the same code. Making the bookkeeping
traceable instead is not possible in dynamo today: it cannot trace ``_current_graph_task_id()`` (the
activation-checkpoint check above, which never runs in the traced region), the ``Use`` finalizers that
withdraw a dropped graph's uses, or closures queued in backward.
* What dynamo traces: ``torch.is_grad_enabled()``, ``requires_grad`` and ``delay_wgrad_compute``
  (guarded), which decide statically which gradients the main backward hands autograd (a plain
  parameter not deferred; fused ``main_grad`` hands zeros, as in eager); LayerNormMLP's checks and
  normalization (torch autograd, as in eager). Parameters are op inputs, for the autograd edges; the op
  uses the module's own parameter objects, reached through an integer handle (a CPU int64 tensor, so
  identical layers share one graph).
* Per-call state: the forward op returns a token (a one-element int64 tensor) that is saved for
  backward; it keys the call's saved tensors, ``_Call`` and ``Use``s, and owns them: a graph freed
  without a backward frees the token and withdraws the uses, as in eager ([Note: contribution
  accounting] in ``weights/base.py``).
* A foreign distributed weight whose ``finalize_group_grads`` returns a gradient in the main backward
  has it added to ``.grad`` (the deferred rule of [Note: the finalize contract]); which gradients go to
  autograd must be known when tracing.
* FP8: the recipe is read inside the op at run time, as in eager, so ``fp8_autocast`` around a compiled
  module works (emulated on CPU, bit-equal).
* Eager speed: outside compilation the modules call the autograd function directly (one
  ``is_compiling()`` check), as ``kernels/_dispatch.py`` does ([Note: custom op bypass]).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from distwgrad.nn._compiled import register_module
from distwgrad.weights._accounting import Uses
from distwgrad.weights.base import compute_dtype
from distwgrad.wgrad.store import WeightGradStore

__all__ = ["WgradModule", "check_no_tensor_parallelism", "check_compute_dtype", "parameter_device"]


def parameter_device(device: torch.device | str | None, like: torch.Tensor | None = None) -> torch.device:
    """Where a module creates a parameter: ``device`` if given; else beside ``like`` (a weight the caller
    passed); else TransformerEngine's default, the current CUDA device where CUDA is available, otherwise
    torch's default device. Pass ``device="cpu"`` for CPU weights on a machine with a GPU."""
    if device is not None:
        return torch.device(device)
    if like is not None:
        return like.device
    default = torch.get_default_device()
    if default.type == "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return default


def check_compute_dtype(owner: str, params: Mapping[str, torch.Tensor],
                        params_dtype: torch.dtype | None) -> torch.dtype:
    """The one dtype a module computes in: every parameter's ``compute_dtype`` ([Note: mixed precision] in
    ``weights/base.py``), which must agree, and agree with an explicit ``params_dtype``.

    A plain bias next to a weight with ``param_dtype`` must be in that dtype (or be a distributed weight
    with the same ``param_dtype``); a tied weight computes in its own ``param_dtype``, so a module built
    with another ``params_dtype`` is refused rather than cast silently.
    """
    dtypes = {name: compute_dtype(p) for name, p in params.items()}
    if len(set(dtypes.values())) > 1:
        shown = {name: str(d) for name, d in dtypes.items()}
        raise TypeError(f"{owner}: parameters compute in different dtypes {shown}; a plain bias next to a weight "
                        f"with param_dtype must be in that dtype, or a distributed weight with the same param_dtype")
    dtype = next(iter(dtypes.values()))
    if params_dtype is not None and params_dtype != dtype:
        raise TypeError(f"{owner}: built with params_dtype={params_dtype}, but its weight computes in {dtype} "
                        f"(a distributed weight computes in its param_dtype; a tied weight in the same dtype for "
                        f"all its users)")
    return dtype


def check_no_tensor_parallelism(owner: str, *, sequence_parallel: bool, tp_group, tp_size: int,
                                parallel_mode) -> None:
    """TransformerEngine's tensor-parallel arguments are accepted at their defaults only.

    distwgrad distributes weights with ``ShardedWeight`` (data-parallel sharding); tensor parallelism is
    not implemented, and a non-default value is refused rather than silently ignored.
    """
    given = {k: v for k, v, default in (("sequence_parallel", sequence_parallel, False), ("tp_group", tp_group, None),
                                        ("tp_size", tp_size, 1), ("parallel_mode", parallel_mode, None))
             if not (v is default or (type(v) is type(default) and v == default))}
    if given:
        raise NotImplementedError(f"{owner}: tensor parallelism is not implemented ({given}); distribute the "
                                  f"weight with distwgrad.ShardedWeight instead")


class WgradModule(nn.Module):
    """Base of distwgrad's modules; subclasses call ``_init_wgrad`` first thing in ``__init__``."""

    def _init_wgrad(self, *, delay_wgrad_compute: bool, fuse_wgrad_accumulation: bool) -> None:
        if not isinstance(delay_wgrad_compute, bool) or not isinstance(fuse_wgrad_accumulation, bool):
            raise TypeError(f"delay_wgrad_compute and fuse_wgrad_accumulation must be bools, got "
                            f"{delay_wgrad_compute!r} and {fuse_wgrad_accumulation!r}")
        self.delay_wgrad_compute = delay_wgrad_compute
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.wgrad_store = WeightGradStore(type(self).__name__)
        self.wgrad_accumulation_and_reduce_hooks: list[Callable[[], None]] = []
        self._op_handle = register_module(self)  # [Note: torch.compile]

    def __setstate__(self, state) -> None:  # a deep copy or an unpickled module is a module of its own
        super().__setstate__(state)
        if "_op_handle" in state:
            self._op_handle = register_module(self, state["_op_handle"].device)

    def _place_op_handle(self, device: torch.device) -> None:
        """The compiled path's module handle lives where the parameters do: [Note: aligned op outputs]."""
        if device.type != "meta" and self._op_handle.device != device:
            self._op_handle = register_module(self, device)

    def _apply(self, fn, recurse: bool = True):
        module = super()._apply(fn, recurse)  # module.to(...), .cuda(), .to_empty(...): the handle follows
        for p in self.parameters(recurse=False):
            self._place_op_handle(p.device)
            break
        return module

    def _weights(self) -> list[torch.Tensor]:
        """The weights ``fuse_wgrad_accumulation`` fuses into ``main_grad`` (never a bias or a norm's)."""
        return []

    # The parameters whose gradients ``backward_dw()`` delivers; None: all of them. A LayerNorm's
    # parameters get their gradients from the main backward, so they keep DDP's post-backward hook.
    deferred_param_names: tuple[str, ...] | None = None

    def _deferred(self, p: torch.Tensor) -> bool:
        """Whether ``backward_dw()``, not the main backward, delivers the gradient of parameter ``p``."""
        return self.delay_wgrad_compute

    def _defers(self, name: str) -> bool:
        """Whether ``backward_dw()`` delivers the gradient of the parameter called ``name``."""
        return self.deferred_param_names is None or name in self.deferred_param_names

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, nn.Parameter) and getattr(self, "delay_wgrad_compute", False) and self._defers(name):
            value.skip_backward_post_hook = True
        super().__setattr__(name, value)
        if isinstance(value, nn.Parameter) and "_op_handle" in self.__dict__:
            self._place_op_handle(value.device)

    # --- TransformerEngine-compatible API ------------------------------------------------------------
    def need_backward_dw(self) -> bool:
        """True when this module defers its wgrads to ``backward_dw()``."""
        return self.delay_wgrad_compute

    def backward_dw(self) -> None:
        """Runs the oldest deferred wgrad of this module, then the registered hooks.

        A no-op for a module that does not defer (as in TransformerEngine). For a deferring module with
        nothing queued it raises ``DeferredWgradError`` naming the module.
        """
        if not self.need_backward_dw():
            return
        self.wgrad_store.pop()
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> None:
        """Registers ``hook()``, fired after each deferred wgrad GEMM of this module."""
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {hook!r}")
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    @property
    def pending_backward_dw(self) -> int:
        """Deferred wgrads queued and not yet drained."""
        return len(self.wgrad_store)

    # --- helpers for subclasses ----------------------------------------------------------------------
    def _checked_params(self, params: Iterable[torch.Tensor | None], check: Callable[[], torch.dtype]) -> torch.dtype:
        """``check()`` (the parameters' shape and dtype checks; it returns the compute dtype), run only when
        what it reads changed since its last run here.

        [Note: per-call host work]
        A module's forward runs on the host before its first kernel can start, so on a GPU its host time
        is device idle time wherever a stretch of small modules (the router, the experts' routing) outruns
        the kernels. The parameter checks read only the parameters' full shapes, dtypes and
        ``param_dtype``s and the module's ``params_dtype`` (and its sizes, fixed at construction), so they
        are keyed by exactly that: any change of a parameter (replaced by one of another shape or dtype,
        cast, another ``param_dtype``) runs them again, and an unchanged module skips them. Input checks
        run on every call.
        """
        key = (getattr(self, "params_dtype", None), *(None if p is None else (
            tuple(getattr(p, "full_shape", p.shape)), p.dtype, getattr(p, "param_dtype", None)) for p in params))
        cached = self.__dict__.get("_params_checked")
        if cached is not None and cached[0] == key:
            return cached[1]
        dtype = check()
        self.__dict__["_params_checked"] = (key, dtype)  # a plain attribute: no nn.Module bookkeeping
        return dtype

    def _begin_forward(self, tracked: Iterable[torch.Tensor]) -> Uses | None:
        """Checks the calling order and records one use per tracked distributed weight.

        ``tracked`` are the parameters whose gradient this forward will produce (grad mode on and
        ``requires_grad`` read from the parameter itself, never from a materialized copy). Returns the
        recorded uses (None if none): the caller keeps them on the autograd context and hands them to
        ``run_wgrad``, so a graph freed without a backward withdraws its uses and a retained graph's second
        backward counts once more ([Note: contribution accounting] in ``weights/base.py``).

        [Note: activation checkpointing]
        A forward that runs while autograd is executing a backward pass is the recomputation of
        non-reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=False)``):
        the original forward already recorded this use, and its backward delivers exactly one
        contribution, so the recomputation records nothing. Reentrant checkpointing runs the original
        forward without grad, so its use is never recorded; its contribution then arrives unexpected
        and the weight raises, naming ``use_reentrant=False`` as the fix (never a silent miscount).
        """
        if torch._C._current_graph_task_id() != -1:
            return None
        tracked = list(tracked)
        if self.delay_wgrad_compute and tracked:
            self.wgrad_store.check_can_queue()
        uses = []
        for p in tracked:
            if self.delay_wgrad_compute:
                p.skip_backward_post_hook = True
            record = getattr(p, "record_use", None)
            if record is not None:
                uses.append((p, record()))
            elif getattr(p, "expect_contribution", None) is not None:
                p.expect_contribution()
        return Uses(uses) if uses else None
