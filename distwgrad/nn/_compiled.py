"""A module's forward and backward as two opaque ops, the path taken under ``torch.compile``.

Why: [Note: torch.compile] in nn/_base.py. Dynamo traces only :func:`compiled_forward`; the ops run the
module's eager forward and backward at run time, finding what the graph cannot carry by a tensor's address,
never its value (a read would sync): ``_MODULES`` maps a handle to its module (a tensor, so same-shaped
layers share one graph), ``_CALLS`` a call's token, saved for backward, to its ``OpContext``. The token owns
that entry: a graph freed without a backward drops the call's uses, as in eager.

[Note: aligned op outputs]
Inductor marks the outputs of an op that takes any CPU tensor, and what other extern ops compute from them,
as not 16-byte aligned, so Triton kernels reading them lose vectorized loads (docs/benchmarks/LOG.md).
So on a GPU neither op takes a CPU tensor: the handle lives on the parameters' device, the token on the input's.

[Note: the ops' run-time path]
Both ops run on every module call, where host time can be device idle time ([Note: per-call host work] in
nn/_base.py), and ``custom_op``'s Python layers cost about a Linear's eager forward. So they use
``torch.library.Library``, each Autograd kernel running the implementation itself for plain tensors under no
dispatch mode (the forward with grad off, as compiled graphs call it); with grad on the forward goes through
:class:`_ModuleForward`, and under a mode or with tensor subclasses both redispatch, as a custom op does.

[Note: op inputs that outlive the op]
Both ops keep tensors past their call (the saved activation; a deferred wgrad's ``dy`` and input), unseen by
inductor, whose memory planning would reuse those buffers and silently corrupt gradients. So ``_lower`` marks
every tensor input never to be reused, registered on first trace (importing distwgrad must not import inductor).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence

import torch

from distwgrad.protocol import is_distributed_weight
from distwgrad.wgrad.accumulate import add_to_grad, hands_fused_dummy

__all__ = ["OpContext", "register_module", "compiled_forward"]

_MODULES: dict[tuple[str, int, int], weakref.ref] = {}
_CALLS: dict[tuple[str, int, int], OpContext] = {}


def _key(t: torch.Tensor) -> tuple[str, int, int]:
    """A live tensor's identity, its device and address; never its value (reading a CUDA tensor syncs)."""
    return t.device.type, -1 if t.device.index is None else t.device.index, t.data_ptr()


def _owned_key(t: torch.Tensor, registry: dict, value) -> None:
    """Registers ``value`` under ``t``'s key until ``t`` dies, before its address can be reused."""
    key = _key(t)
    registry[key] = value
    weakref.finalize(t, registry.pop, key, None)


def register_module(module: torch.nn.Module, device: torch.device | str | None = None) -> torch.Tensor:
    """A new handle naming ``module`` on ``device`` (default and meta: CPU): [Note: aligned op outputs]."""
    device = torch.device("cpu" if device is None else device)
    handle = torch.empty((1,), dtype=torch.int64, device="cpu" if device.type == "meta" else device)
    _owned_key(handle, _MODULES, weakref.ref(module))
    return handle


def _module(handle_t: torch.Tensor):
    ref = _MODULES.get(_key(handle_t))
    module = None if ref is None else ref()
    if module is None:
        raise RuntimeError(f"distwgrad: a compiled graph called a module handle on {handle_t.device} whose module "
                           f"no longer exists (was the graph compiled for a module that was deleted?)")
    return module


class OpContext:
    """A stand-in autograd ``ctx``, for running distwgrad's autograd functions by hand inside the ops."""

    def __init__(self) -> None:
        self._saved: tuple[torch.Tensor, ...] = ()
        self.needs_input_grad: tuple[bool, ...] = ()

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self._saved = tensors

    @property
    def saved_tensors(self) -> tuple[torch.Tensor, ...]:
        return self._saved


def _autograd_dispatch() -> torch._C._ForceDispatchKeyGuard:
    """Re-enables autograd dispatch inside an op (LayerNormMLP's backward calls ``torch.autograd.grad``);
    grad mode stays as the caller set it. A bare guard, no generator: [Note: per-call host work] in nn/_base.py."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
                  torch._C.DispatchKey.AutogradNestedTensor)


def _unaliased(outs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``outs`` with any tensor sharing storage with an input or an earlier output copied (ops may not alias)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    fresh = []
    for t in outs:
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        fresh.append(t)
    return fresh


_LIB = torch.library.Library("distwgrad", "FRAGMENT")  # the kernels' custom ops share the namespace
_LIB.define("module_forward(Tensor inp, Tensor[] params, Tensor[] aux, SymInt[] ints, Tensor handle, bool grad_on, "
            "bool[] hands, SymInt out_cols, bool? first=None) -> (Tensor, Tensor)")
_LIB.define("module_backward(Tensor token, Tensor dy, Tensor[] params, SymInt[] inp_shape, bool need_dx, "
            "bool[] hands) -> (Tensor, Tensor[])")


def module_forward(inp: torch.Tensor, params: list[torch.Tensor], aux: list[torch.Tensor], ints: list[int],
                   handle: torch.Tensor, grad_on: bool, hands: list[bool], out_cols: int,
                   first: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(module(inp), token)`` by the eager forward. ``params`` only carry autograd edges (the module's own
    are used); ``aux``, ``ints``: extra arguments (GroupedLinear's ``m_splits``); ``first``: the call's
    ``is_first_microbatch``."""
    del hands
    ctx = OpContext()
    with _autograd_dispatch(), torch.no_grad():  # as an autograd function's forward runs
        y = _module(handle)._op_forward(ctx, inp, aux, ints, grad_on, first)
    token = inp.new_empty((1,), dtype=torch.int64)  # [Note: aligned op outputs]: on the input's device
    _owned_key(token, _CALLS, ctx)
    (y,) = _unaliased([y], [inp, *params, *aux, handle])
    return y, token


def _forward_fake(inp, params, aux, ints, handle, grad_on, hands, out_cols, first=None):
    return inp.new_empty((*inp.shape[:-1], out_cols)), inp.new_empty((1,), dtype=torch.int64)


def module_backward(token: torch.Tensor, dy: torch.Tensor, params: list[torch.Tensor], inp_shape: list[int],
                    need_dx: bool, hands: list[bool]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(dx, grads)`` by the eager backward of ``token``'s call; ``grads[i]`` is empty unless ``hands[i]``. A
    gradient not handed to autograd is added to ``.grad`` ([Note: the finalize contract], deferred rule)."""
    ctx = _CALLS.get(_key(token))
    if ctx is None:
        raise RuntimeError("distwgrad: a compiled backward found no state for its forward call (its graph was "
                           "freed, or backward ran twice without retain_graph=True)")
    with _autograd_dispatch(), torch.no_grad():  # as an autograd function's backward runs
        dx, grads = ctx.run_backward(ctx, dy, need_dx)
    out = []
    for p, g, hand in zip(ctx.op_params, grads, hands):
        if hand:
            assert g is not None, "a gradient the compiled plan hands autograd was not produced"
            out.append(g)
        else:
            add_to_grad(p, g)
            out.append(dy.new_empty(0))
    dx, *out = _unaliased([dy.new_empty(0) if dx is None else dx, *out], [token, dy, *params])
    return dx, out


def _backward_fake(token, dy, params, inp_shape, need_dx, hands):
    dx = dy.new_empty(inp_shape) if need_dx else dy.new_empty(0)
    return dx, [torch.empty_like(p) if hand else dy.new_empty(0) for p, hand in zip(params, hands)]


def _below_autograd(op, keyset, *args):
    """``op`` redispatched past the Autograd key, as a custom op's autograd kernel does."""
    with torch._C._AutoDispatchBelowAutograd():
        return op.redispatch(keyset & torch._C._after_autograd_keyset, *args)


class _ModuleForward(torch.autograd.Function):
    """The forward op's autograd formula, for tracing; ``flat`` spreads ``params`` out so autograd sees them."""

    @staticmethod
    def forward(ctx, keyset, n_params, inp, *flat):
        params, (aux, ints, handle, grad_on, hands, out_cols, first) = list(flat[:n_params]), flat[n_params:]
        y, token = _below_autograd(_FORWARD, keyset, inp, params, aux, ints, handle, grad_on, hands, out_cols, first)
        ctx.save_for_backward(token, *params)
        ctx.inp_shape, ctx.hands = list(inp.shape), list(hands)
        ctx.mark_non_differentiable(token)
        return y, token

    @staticmethod
    def backward(ctx, dy, _dtoken):
        token, *params = ctx.saved_tensors
        need_dx = ctx.needs_input_grad[2]
        dx, grads = torch.ops.distwgrad.module_backward(token, dy.contiguous(), params, ctx.inp_shape, need_dx,
                                                        ctx.hands)
        grads = [g if hand else None for g, hand in zip(grads, ctx.hands)]
        return None, None, (dx if need_dx else None), *grads, None, None, None, None, None, None, None


@functools.cache
def _outside_dynamo(fn):
    """``fn`` under ``torch.compiler.disable``, as a custom op's implementation (made lazily: it imports dynamo)."""
    return torch.compiler.disable(fn)


def _forward_autograd(keyset, inp, params, aux, ints, handle, grad_on, hands, out_cols, first=None):
    """The forward op's Autograd kernel ([Note: the ops' run-time path])."""
    if torch.is_grad_enabled() and (inp.requires_grad or any(p.requires_grad for p in params)):
        return _ModuleForward.apply(keyset, len(params), inp, *params, aux, ints, handle, grad_on, hands, out_cols,
                                    first)
    if torch._C._len_torch_dispatch_stack() == 0 and type(inp) is torch.Tensor:
        return _outside_dynamo(module_forward)(inp, params, aux, ints, handle, grad_on, hands, out_cols, first)
    return _below_autograd(_FORWARD, keyset, inp, params, aux, ints, handle, grad_on, hands, out_cols, first)


def _backward_autograd(keyset, token, dy, params, inp_shape, need_dx, hands):
    """The backward op's Autograd kernel ([Note: the ops' run-time path]); no formula (no double backward)."""
    if torch._C._len_torch_dispatch_stack() == 0 and type(dy) is torch.Tensor:
        return _outside_dynamo(module_backward)(token, dy, params, inp_shape, need_dx, hands)
    return _below_autograd(_BACKWARD, keyset, token, dy, params, inp_shape, need_dx, hands)


_LIB.impl("module_forward", lambda *args: _outside_dynamo(module_forward)(*args), "CompositeExplicitAutograd")
_LIB.impl("module_backward", lambda *args: _outside_dynamo(module_backward)(*args), "CompositeExplicitAutograd")
_LIB.impl("module_forward", _forward_autograd, "Autograd", with_keyset=True)
_LIB.impl("module_backward", _backward_autograd, "Autograd", with_keyset=True)
torch.library.register_fake("distwgrad::module_forward", _forward_fake, lib=_LIB)
torch.library.register_fake("distwgrad::module_backward", _backward_fake, lib=_LIB)
_FORWARD = torch.ops.distwgrad.module_forward.default
_BACKWARD = torch.ops.distwgrad.module_backward.default
torch.fx.node.has_side_effect(_FORWARD)
torch.fx.node.has_side_effect(_BACKWARD)


_LOWERED = False


def _lower(op):
    """Inductor's fallback for ``op``, its tensor inputs never reused ([Note: op inputs that outlive the op])."""
    from torch._inductor import ir
    from torch._inductor.lowering import fallback_handler
    from torch._inductor.virtualized import V

    fallback = fallback_handler(op, add_to_fallback_set=False)

    def lowering(*args, **kwargs):
        out = fallback(*args, **kwargs)  # realizes the inputs into named buffers
        for a in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(a, ir.IRNode):
                V.graph.never_reuse_buffers.add(a.get_name())
        return out
    return lowering


def _lowering_registered() -> bool:
    """Registers the ops' inductor lowerings once; dynamo runs it while tracing (a constant to the graph)."""
    global _LOWERED
    if not _LOWERED:
        from torch._inductor.lowering import register_lowering

        for op in (_FORWARD, _BACKWARD):
            register_lowering(op, type_promotion_kind=None)(_lower(op))
        _LOWERED = True
    return True


# What ``torch.compiler.assume_constant_result`` sets, set without it: calling it imports dynamo (and DTensor),
# which importing distwgrad must not (tests/test_compile.py checks the attribute is still dynamo's).
_lowering_registered._dynamo_marked_constant = True  # type: ignore[attr-defined]


def compiled_forward(module, inp: torch.Tensor, params: Sequence[torch.Tensor | None], out_cols: int, *,
                     aux: Sequence[torch.Tensor] = (), ints: Sequence[int] = (),
                     first_microbatch: bool | None = None) -> torch.Tensor:
    """What dynamo traces of a module's forward: one ``distwgrad::module_forward`` call. Which gradients go
    to autograd (``hands``) is fixed from what dynamo guards on ([Note: the fused .grad contract] for fused);
    ``first_microbatch``: the call's checked ``is_first_microbatch``."""
    _lowering_registered()  # [Note: op inputs that outlive the op]
    present = [p for p in params if p is not None]
    grad_on = torch.is_grad_enabled()
    fused = module._weights() if module.fuse_wgrad_accumulation else []

    def hand(p: torch.Tensor) -> bool:
        if not (grad_on and p.requires_grad) or is_distributed_weight(p):
            return False
        if any(p is w for w in fused):
            return hands_fused_dummy(p)
        return not module._deferred(p)

    hands = [hand(p) for p in present]
    y, _ = torch.ops.distwgrad.module_forward(inp, present, list(aux), list(ints), module._op_handle, grad_on,
                                              hands, out_cols, first_microbatch)
    return y
