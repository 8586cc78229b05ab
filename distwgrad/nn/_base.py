"""What distwgrad's modules share: deferred-wgrad plumbing, hooks and contribution accounting.

TransformerEngine's deferred-wgrad surface lives here once; deferred parameters carry ``skip_backward_post_hook``,
so Megatron's DDP leaves them to ``register_wgrad_accumulation_and_reduce_hooks``.

[Note: torch.compile]
Under ``torch.compile`` each module call is one opaque op, ``distwgrad::module_forward``, whose autograd
formula is another, ``distwgrad::module_backward`` (nn/_compiled.py). Both run the eager path at run time,
as dynamo cannot trace the bookkeeping (``_current_graph_task_id()``, ``Use`` finalizers, queued closures):
gradients are eager's bit for bit and ``fp8_autocast`` works. Which gradients go to autograd is fixed at
trace time; a foreign weight's finalize result goes to ``.grad`` ([Note: the finalize contract]). More:
docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from distwgrad.nn._compiled import register_module
from distwgrad.weights._accounting import Uses
from distwgrad.weights.base import compute_dtype
from distwgrad.wgrad.store import WeightGradStore

__all__ = ["WgradModule", "check_no_tensor_parallelism", "check_compute_dtype", "check_first_microbatch",
           "parameter_device"]


def parameter_device(device: torch.device | str | None, like: torch.Tensor | None = None) -> torch.device:
    """Where a module creates a parameter: ``device``, else beside ``like``, else TransformerEngine's default
    (the current CUDA device where available, else torch's default); so CPU weights on a GPU host need ``"cpu"``."""
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
    ``weights/base.py``). Raises ``TypeError`` unless they and ``params_dtype`` agree (nothing is cast)."""
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
    """Raises ``NotImplementedError`` for a non-default TE tensor-parallel argument, never ignoring it."""
    given = {k: v for k, v, default in (("sequence_parallel", sequence_parallel, False), ("tp_group", tp_group, None),
                                        ("tp_size", tp_size, 1), ("parallel_mode", parallel_mode, None))
             if not (v is default or (type(v) is type(default) and v == default))}
    if given:
        raise NotImplementedError(f"{owner}: tensor parallelism is not implemented ({given}); distribute the "
                                  f"weight with distwgrad.ShardedWeight instead")


def check_first_microbatch(module: WgradModule, is_first_microbatch: object) -> bool | None:
    """``is_first_microbatch`` checked ([Note: fp8 weights kept across microbatches] in ``fp8/weights.py``); the
    module's name read only to raise: compiled, a read would guard each graph on it, one graph per layer."""
    if is_first_microbatch is not None and type(is_first_microbatch) is not bool:
        raise TypeError(f"{module.wgrad_store.owner}: is_first_microbatch must be True, False or None, got "
                        f"{is_first_microbatch!r}")
    return is_first_microbatch


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
        """Runs this module's oldest deferred wgrad, then the hooks; a no-op if it does not defer (as TE).
        Raises ``DeferredWgradError`` when a deferring module has nothing queued."""
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
        """``check()`` (parameter checks returning the compute dtype), rerun only when what it reads changed.

        [Note: per-call host work]
        A forward's host time is device idle time wherever small modules outrun the kernels, so the parameter
        checks are keyed by exactly what they read (shapes, dtypes, ``param_dtype``s); input checks run always.
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
        """Checks the calling order and records one use per ``tracked`` parameter; returns the uses (or None)
        for the autograd context to hand ``run_wgrad`` ([Note: contribution accounting] in ``weights/base.py``).

        [Note: activation checkpointing]
        A forward run during a backward is non-reentrant checkpointing's recomputation: the original forward
        recorded the use, so it records nothing. Reentrant checkpointing's forward runs without grad, so its
        contribution arrives unrecorded and the weight raises, naming ``use_reentrant=False``.
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
