"""A module's forward and backward as two opaque ops, the path taken under ``torch.compile``.

[Note: torch.compile] in ``distwgrad/nn/_base.py`` says why. Dynamo traces only
:func:`compiled_forward` (the parameter list, static flags and one ``distwgrad::module_forward`` call);
the op's implementation runs the module's eager path at run time (checks, ``_begin_forward``, the
autograd function's ``forward`` on an :class:`OpContext`), and ``distwgrad::module_backward`` runs the
same function's ``backward``. Two registries join the graph to the Python state it cannot carry:

* ``_MODULES``: handle -> the module, by weak reference. The handle reaches the op as a one-element
  int64 tensor held as a plain module attribute on the parameters' device (``WgradModule`` moves it with
  them): a tensor is a graph input, so layers of one configuration share one compiled graph, where an int
  attribute would be a constant and recompile per instance. Its address is the key, never its value;
* ``_CALLS``: per-call key -> that call's ``OpContext`` (saved tensors, the call record and its
  ``Use``s). The key travels as the *token*, a one-element int64 tensor on the input's device returned by
  the forward op and saved for backward, so the backward finds the state of its own call at run time
  (AOTAutograd traces ``setup_context`` and ``backward`` once, with fake tensors). The key is the token's
  address, never its value: the token is allocated, never written or read, so it costs no kernel and no
  sync. The token owns the entry: when the graph that saved it is freed, with or without a backward, the
  entry goes (before its memory can be reused), and with it the ``Use``s (a dropped graph withdraws its
  uses, as in eager: [Note: contribution accounting] in weights/base.py).

[Note: aligned op outputs]
Inductor marks the outputs of an op that takes any CPU tensor as not 16-byte aligned, and every buffer
computed from them by another extern op likewise; a Triton kernel that reads such a buffer gets no
divisibility hint, so its loads are not vectorized. So neither op takes a CPU tensor where the module runs
on a GPU: the module handle lives on the parameters' device and the token on the input's, and what
consumes the ops' outputs (the kernels inductor fuses after a ``Linear``; attention's backward, then the
rotary and qkv kernels after it) reads them with vector loads. On one H200 the large preset's fused
rotary/qkv backward kernel took 0.62 ms with a CPU token and 0.30 ms in plain torch's graph
(docs/benchmarks/LOG.md).

[Note: the ops' run-time path]
A compiled graph calls both ops through the dispatcher on every module call, and there their host time
is the device's idle time wherever a stretch of small modules outruns the kernels ([Note: per-call host
work] in nn/_base.py). ``torch.library.custom_op`` puts three Python layers around an implementation: an
autograd kernel that redispatches below autograd, a backend wrapper under dynamo's ``disable`` and an
output aliasing check. On the CPU those cost as much host time as a ``Linear``'s whole eager forward. So
the ops are defined with ``torch.library.Library``, and each one's Autograd kernel runs the
implementation itself where a redispatch would reach nothing else: real tensors (``torch.Tensor``
itself, no dispatch mode on the stack) and, for the forward, grad off, which is how a compiled graph runs
it. With grad on (tracing, or a direct call), the forward goes through :class:`_ModuleForward`, an
autograd function that redispatches below autograd: AOTAutograd records the forward op and, for its
backward, one ``module_backward``. Under a dispatch mode or with tensor subclasses (fake tensors,
functionalization, a user's mode) both ops redispatch, as a custom op does. The implementations run
outside dynamo, as a custom op's do, and ``_unaliased`` is the aliasing rule.

[Note: op inputs that outlive the op]
Both ops keep tensors they were given past their own call, as the eager autograd function does: the
forward op's context saves its input (the activation a wgrad reads) and a deferred wgrad queued by the
backward op holds ``dy`` and that input until ``backward_dw()``. Inductor cannot see those references. Its
memory planning hands a buffer whose last use in the graph has passed to a later buffer of the same size
(``buf9 = buf4; del buf4  # reuse``), or lets a pointwise kernel write in place over its dead input, and a
kernel then overwrites the saved activation: on the CPU, the MoE GPT's attention weights got gradients
off by 1-25x their size, its loss unchanged. So every tensor input of either op is marked never to be
reused (``_lower``: inductor's own fallback for the op, plus ``V.graph.never_reuse_buffers``, the set that
inductor's own ops with hidden aliasing use). The graph still frees its reference when the buffer's last
use has passed; the op's reference keeps the memory, as eager autograd's does. The lowering is registered
when dynamo first traces a module (:func:`_lowering_registered`), so importing distwgrad does not import
inductor.
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
    """Registers ``value`` under ``t``'s key for as long as ``t`` lives (the entry goes before ``t``'s memory
    can be reused, so a later tensor at the same address never finds it)."""
    key = _key(t)
    registry[key] = value
    weakref.finalize(t, registry.pop, key, None)


def register_module(module: torch.nn.Module, device: torch.device | str | None = None) -> torch.Tensor:
    """A fresh handle for ``module`` on ``device`` (default CPU; a meta device keeps it on the CPU): an
    allocated, never written one-element tensor whose address names the module ([Note: aligned op
    outputs]). A copy or an unpickled module gets its own."""
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
    """The part of an autograd function's ``ctx`` that distwgrad's functions use, for running their
    ``forward`` and ``backward`` by hand inside the ops: ``save_for_backward``, ``saved_tensors``,
    ``needs_input_grad`` and plain attributes."""

    def __init__(self) -> None:
        self._saved: tuple[torch.Tensor, ...] = ()
        self.needs_input_grad: tuple[bool, ...] = ()

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self._saved = tensors

    @property
    def saved_tensors(self) -> tuple[torch.Tensor, ...]:
        return self._saved


def _autograd_dispatch() -> torch._C._ForceDispatchKeyGuard:
    """Autograd dispatch as in eager, inside an op's implementation (the op's autograd kernel excludes
    it): LayerNormMLP's backward differentiates its activation with ``torch.autograd.grad`` under
    ``enable_grad``. Grad mode itself is left as the caller set it (off, as in an autograd function).
    The guard itself, used with ``with`` (no generator around it: [Note: per-call host work] in nn/_base.py)."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
                  torch._C.DispatchKey.AutogradNestedTensor)


def _unaliased(outs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """An op's outputs may alias neither its inputs nor each other: a tensor sharing storage with one
    is copied (the experts' gradients, views of one product; never on the eager path)."""
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
            "bool[] hands, SymInt out_cols) -> (Tensor, Tensor)")
_LIB.define("module_backward(Tensor token, Tensor dy, Tensor[] params, SymInt[] inp_shape, bool need_dx, "
            "bool[] hands) -> (Tensor, Tensor[])")


def module_forward(inp: torch.Tensor, params: list[torch.Tensor], aux: list[torch.Tensor], ints: list[int],
                   handle: torch.Tensor, grad_on: bool, hands: list[bool],
                   out_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(module(inp), token)``: the module's eager forward, run at run time. ``params`` carry the autograd
    edges only (the module's own parameter objects are used); ``aux``, ``ints``: the module's extra
    arguments (GroupedLinear's ``m_splits``, a tensor or ints)."""
    del hands
    ctx = OpContext()
    with _autograd_dispatch(), torch.no_grad():  # as an autograd function's forward runs
        y = _module(handle)._op_forward(ctx, inp, aux, ints, grad_on)
    token = inp.new_empty((1,), dtype=torch.int64)  # [Note: aligned op outputs]: on the input's device
    _owned_key(token, _CALLS, ctx)
    (y,) = _unaliased([y], [inp, *params, *aux, handle])
    return y, token


def _forward_fake(inp, params, aux, ints, handle, grad_on, hands, out_cols):
    return inp.new_empty((*inp.shape[:-1], out_cols)), inp.new_empty((1,), dtype=torch.int64)


def module_backward(token: torch.Tensor, dy: torch.Tensor, params: list[torch.Tensor], inp_shape: list[int],
                    need_dx: bool, hands: list[bool]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(dx, grads)``: the eager backward of the call ``token`` names. ``grads[i]`` is what autograd gets
    for ``params[i]`` where ``hands[i]``, else an empty placeholder; a gradient the static plan did not
    hand autograd (a foreign distributed weight's ``finalize_group_grads`` result) is added to ``.grad``,
    the deferred rule of [Note: the finalize contract]."""
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
    """The forward op's autograd formula, for tracing: AOTAutograd records the forward op below autograd
    and, for its backward, one ``module_backward`` call. ``flat``: the op's arguments with ``params``
    spread out (an autograd function sees only its direct tensor arguments)."""

    @staticmethod
    def forward(ctx, keyset, n_params, inp, *flat):
        params, (aux, ints, handle, grad_on, hands, out_cols) = list(flat[:n_params]), flat[n_params:]
        y, token = _below_autograd(_FORWARD, keyset, inp, params, aux, ints, handle, grad_on, hands, out_cols)
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
        return None, None, (dx if need_dx else None), *grads, None, None, None, None, None, None


@functools.cache
def _outside_dynamo(fn):
    """``fn`` never traced by dynamo, as a custom op's implementation: the ops run eager code, and an op
    called where dynamo evaluates frames must run it, not compile it (made on first use: the ops run only
    where dynamo is already imported)."""
    return torch.compiler.disable(fn)


def _forward_autograd(keyset, inp, params, aux, ints, handle, grad_on, hands, out_cols):
    """The forward op's Autograd kernel ([Note: the ops' run-time path])."""
    if torch.is_grad_enabled() and (inp.requires_grad or any(p.requires_grad for p in params)):
        return _ModuleForward.apply(keyset, len(params), inp, *params, aux, ints, handle, grad_on, hands, out_cols)
    if torch._C._len_torch_dispatch_stack() == 0 and type(inp) is torch.Tensor:
        return _outside_dynamo(module_forward)(inp, params, aux, ints, handle, grad_on, hands, out_cols)
    return _below_autograd(_FORWARD, keyset, inp, params, aux, ints, handle, grad_on, hands, out_cols)


def _backward_autograd(keyset, token, dy, params, inp_shape, need_dx, hands):
    """The backward op's Autograd kernel ([Note: the ops' run-time path]). The op has no formula of its
    own: a compiled backward runs it without grad (AOTAutograd refuses a double backward)."""
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
    """Inductor's lowering of ``op``: its usual fallback kernel, every tensor input never reused ([Note: op
    inputs that outlive the op])."""
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
                     aux: Sequence[torch.Tensor] = (), ints: Sequence[int] = ()) -> torch.Tensor:
    """What dynamo traces of a module's forward: one ``distwgrad::module_forward`` call.

    ``hands[i]``: whether ``params[i]``'s gradient goes back to autograd from the main backward (a plain
    parameter whose wgrad is not deferred; a weight fused into ``main_grad`` where it carries
    ``grad_added_to_main_grad``: [Note: the fused .grad contract]), fixed at trace time from what dynamo
    guards on (grad mode, ``requires_grad``, ``delay_wgrad_compute``, the attribute). A distributed weight
    delivers itself, and a deferred wgrad waits for ``backward_dw()``.
    """
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
                                              hands, out_cols)
    return y
