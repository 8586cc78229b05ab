"""``LayerNormMLP``: y = fc2(act(fc1(norm(x)))), TransformerEngine's ``te.LayerNormMLP``.

Legend: T tokens, H ``hidden_size``, G ``ffn_hidden_size``, F fc1's width (G, doubled when gated). The norm
is torch autograd; fc1, act and fc2 are one autograd function built from Linear's helpers, so each FC
behaves exactly as a ``Linear``.

[Note: LayerNormMLP's deferred wgrads]
With ``delay_wgrad_compute`` one backward queues ONE item with both FCs' wgrads, drained by one
``backward_dw()`` (fc2's, fc1's, then the hooks). Bias gradients come from the main backward's
high-precision ``dy``, never recomputed. ``act(h)`` is recomputed in backward, never saved;
``checkpoint=True`` also recomputes ``h``, saving only ``norm(x)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distwgrad.fp8.recipe import Recipe, current_first_microbatch, current_recipe
from distwgrad.fp8.weights import in_backward
from distwgrad.nn._base import (
    WgradModule,
    check_compute_dtype,
    check_first_microbatch,
    check_no_tensor_parallelism,
    parameter_device,
)
from distwgrad.nn._compiled import compiled_forward
from distwgrad.nn._norm import activation as _activation
from distwgrad.nn._norm import apply_norm, init_norm
from distwgrad.nn.linear import _Call, _dgrad, _fprop_fp8, _linear_wgrad, _materialize_bias
from distwgrad.ops import grouped_gemm_fp8 as gg8
from distwgrad.protocol import materialize_weight_for_forward
from distwgrad.wgrad.accumulate import deferred_main_grads
from distwgrad.wgrad.store import WeightGradStore

__all__ = ["LayerNormMLP"]

_FC_NAMES = ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")


@dataclass(frozen=True)
class _MLPCall:
    """Per-call facts, fixed at forward time: one Linear ``_Call`` per FC."""

    fc1: _Call
    fc2: _Call
    activation: str
    checkpoint: bool
    delay: bool
    store: WeightGradStore
    recipe: Recipe | None


def _fc_forward(x_TK: torch.Tensor, weight, bias, recipe: Recipe | None, keep: bool | None = None):
    """``(y, x^T quantized or None)``: one FC's forward GEMM, as Linear runs it (``keep``: its
    ``is_first_microbatch``)."""
    if recipe is None:
        (w_NK,) = materialize_weight_for_forward([weight])  # transient
        return F.linear(x_TK, w_NK, _materialize_bias(bias)), None
    x_q, x_qt = gg8.quantize_operand(x_TK, recipe, grad=False)
    return _fprop_fp8(x_q, weight, bias, recipe, keep), x_qt


def _dgrad_and_quantized(dy, weight, recipe: Recipe | None, need_dgrad: bool, keep: bool | None = None):
    """``(dx or None, dy^T quantized or None)``: one quantization of dy serves dgrad and wgrad."""
    dy_q = dy_qt = None
    if recipe is not None and need_dgrad:
        dy_q, dy_qt = gg8.quantize_operand(dy, recipe, grad=True)
    return (_dgrad(dy, weight, recipe, dy_q, keep) if need_dgrad else None), dy_qt


class _LayerNormMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ln_TH, w1, b1, w2, b2, call: _MLPCall):
        act, _ = _activation(call.activation)
        h_TF, ln_qt = _fc_forward(ln_TH, w1, b1, call.recipe, call.fc1.first_microbatch)
        y_TH, _ = _fc_forward(act(h_TF), w2, b2, call.recipe, call.fc2.first_microbatch)
        if call.checkpoint:
            ctx.save_for_backward(ln_TH)
        elif call.recipe is None:
            ctx.save_for_backward(ln_TH, h_TF)
        else:  # fc1's wgrad reads only norm(x)^T, in fp8
            ctx.save_for_backward(*gg8.saved_tensors(ln_qt), h_TF)
            ctx.x_meta = gg8.saved_meta(ln_qt)
        # Parameters ride on ctx, not save_for_backward: [Note: what backward may hold].
        ctx.params, ctx.call = (w1, b1, w2, b2), call
        return y_TH

    @staticmethod
    def backward(ctx, dy_TH):
        (w1, b1, w2, b2), call = ctx.params, ctx.call
        ln_TH = ln_qt = None
        if call.checkpoint:
            (ln_TH,) = ctx.saved_tensors
            # the forward again, for fc1's output
            h_TF, ln_qt = _fc_forward(ln_TH, w1, b1, call.recipe, in_backward(call.fc1.first_microbatch))
            ln_TH = ln_TH if call.recipe is None else None
        elif call.recipe is None:
            ln_TH, h_TF = ctx.saved_tensors
        else:
            *ln_saved, h_TF = ctx.saved_tensors
            ln_qt = gg8.from_saved(ln_saved, ctx.x_meta)
        need_fc1 = call.fc1.weight_grad or call.fc1.bias_grad or ctx.needs_input_grad[0]
        act, _ = _activation(call.activation)
        with torch.enable_grad():
            h = h_TF.detach().requires_grad_(need_fc1)
            a_TG = act(h)
        a_qt = None if call.recipe is None else gg8.quantize_operand(a_TG.detach(), call.recipe, grad=False)[1]
        da_TG, dy_qt = _dgrad_and_quantized(dy_TH, w2, call.recipe, need_fc1, in_backward(call.fc2.first_microbatch))
        dh_TF = torch.autograd.grad(a_TG, h, da_TG)[0] if need_fc1 else None
        a_TG = a_TG.detach()
        dln_TH, dh_qt = _dgrad_and_quantized(dh_TF, w1, call.recipe, ctx.needs_input_grad[0],
                                             in_backward(call.fc1.first_microbatch))
        db2 = dy_TH.sum(0) if call.fc2.bias_grad else None  # kept, never recomputed later
        db1 = dh_TF.sum(0) if call.fc1.bias_grad else None

        def wgrads(deferred: bool):  # fc2's then fc1's
            g2 = _linear_wgrad(a_TG, dy_TH, w2, b2, call.fc2, deferred, dy_qt, a_qt, db2)
            g1 = _linear_wgrad(ln_TH, dh_TF, w1, b1, call.fc1, deferred, dh_qt, ln_qt, db1)
            return g1, g2

        if not any((call.fc1.weight_grad, call.fc1.bias_grad, call.fc2.weight_grad, call.fc2.bias_grad)):
            return dln_TH, None, None, None, None, None
        if call.delay:
            call.store.put(lambda: wgrads(True))
            (gw1,) = deferred_main_grads([w1], fuse=call.fc1.fuse, on=call.fc1.weight_grad)
            (gw2,) = deferred_main_grads([w2], fuse=call.fc2.fuse, on=call.fc2.weight_grad)
            return dln_TH, gw1, None, gw2, None, None
        (gw1, gb1), (gw2, gb2) = wgrads(False)
        return dln_TH, gw1, gb1, gw2, gb2, None


def _op_backward(ctx, dy, need_dx: bool):
    """``_LayerNormMLPFunction.backward`` inside ``distwgrad::module_backward``: ``(dln, grads)``."""
    ctx.needs_input_grad = (need_dx,) + (False,) * 5
    dln_TH, *grads = _LayerNormMLPFunction.backward(ctx, dy)
    return dln_TH, [g for p, g in zip(ctx.params, grads) if p is not None]


class LayerNormMLP(WgradModule):
    """A normalization, fc1, an activation and fc2, with TransformerEngine's names and deferred wgrads.

    Args:
        hidden_size, ffn_hidden_size: H and G.
        eps, normalization (``"LayerNorm"``, ``"RMSNorm"``), zero_centered_gamma: as TE.
        activation: one of ``distwgrad.nn._norm.ACTIVATIONS`` (``"gelu"``: tanh approximation; ``"swiglu"``:
            ``silu(a) * b``, ``a`` fc1's first half).
        delay_wgrad_compute: [Note: LayerNormMLP's deferred wgrads].
        init_method, output_layer_init_method: initialise fc1's / fc2's weight in place (default: TE's).
        return_layernorm_output, return_bias: also return ``norm(x)`` (last); return fc2's bias unadded.
        checkpoint: recompute fc1's output in backward instead of saving it.
        bias (a bool, for both FCs), params_dtype, device, fuse_wgrad_accumulation and the tensor-parallel
            arguments: as :class:`distwgrad.nn.Linear`'s.

    Distributed weights are assigned after construction, as in TE: ``mlp.fc1_weight = ShardedWeight.from_full(w)``.
    """

    deferred_param_names = _FC_NAMES

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5, *, bias: bool = True,
                 normalization: str = "LayerNorm", activation: str = "gelu", params_dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, delay_wgrad_compute: bool = False,
                 fuse_wgrad_accumulation: bool = False, init_method: Callable[[torch.Tensor], object] | None = None,
                 output_layer_init_method: Callable[[torch.Tensor], object] | None = None,
                 zero_centered_gamma: bool = False, return_layernorm_output: bool = False,
                 return_bias: bool = False, checkpoint: bool = False, sequence_parallel: bool = False,
                 tp_group=None, tp_size: int = 1, set_parallel_mode: bool = False) -> None:
        super().__init__()
        self._init_wgrad(delay_wgrad_compute=delay_wgrad_compute, fuse_wgrad_accumulation=fuse_wgrad_accumulation)
        owner = f"LayerNormMLP({hidden_size}, {ffn_hidden_size})"
        check_no_tensor_parallelism(owner, sequence_parallel=sequence_parallel, tp_group=tp_group, tp_size=tp_size,
                                    parallel_mode="set_parallel_mode=True" if set_parallel_mode else None)
        for name, v in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        _, gated = _activation(activation)  # validates the name
        self.hidden_size, self.ffn_hidden_size, self.activation = hidden_size, ffn_hidden_size, activation
        self.fc1_width = ffn_hidden_size * (2 if gated else 1)
        self.use_bias, self.checkpoint = bool(bias), bool(checkpoint)
        self.return_bias, self.return_layernorm_output = bool(return_bias), bool(return_layernorm_output)
        self.wgrad_store.owner = owner
        dtype, device = params_dtype or torch.get_default_dtype(), parameter_device(device)
        init_norm(self, hidden_size, normalization=normalization, eps=eps, zero_centered_gamma=zero_centered_gamma,
                  dtype=dtype, device=device)
        default_init = lambda w: nn.init.normal_(w, mean=0.0, std=0.023)  # noqa: E731  TE's default
        for name, shape, init in (("fc1", (self.fc1_width, hidden_size), init_method),
                                  ("fc2", (hidden_size, ffn_hidden_size), output_layer_init_method)):
            weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
            with torch.no_grad():
                (init or default_init)(weight)
            setattr(self, f"{name}_weight", weight)
            if self.use_bias:
                setattr(self, f"{name}_bias", nn.Parameter(torch.zeros(shape[0], dtype=dtype, device=device)))
            else:
                self.register_parameter(f"{name}_bias", None)

    def _fc_params(self) -> dict[str, torch.Tensor]:
        # dynamo traces this ([Note: torch.compile] in nn/_base.py); it cannot trace a walrus in a comprehension
        return {n: getattr(self, n) for n in _FC_NAMES if getattr(self, n) is not None}

    def _check(self, inp: torch.Tensor) -> torch.dtype:
        owner = self.wgrad_store.owner
        want = {"fc1_weight": (self.fc1_width, self.hidden_size), "fc1_bias": (self.fc1_width,),
                "fc2_weight": (self.hidden_size, self.ffn_hidden_size), "fc2_bias": (self.hidden_size,)}
        params = self._fc_params()
        for name, p in params.items():
            full = tuple(getattr(p, "full_shape", p.shape))
            if full != want[name]:
                raise ValueError(f"{owner}: {name} has full shape {full}, expected {want[name]}")
        dtype = check_compute_dtype(owner, params, None)
        if not isinstance(inp, torch.Tensor) or inp.dim() == 0 or inp.shape[-1] != self.hidden_size:
            shape = tuple(inp.shape) if isinstance(inp, torch.Tensor) else type(inp).__name__
            raise ValueError(f"{owner}: input of shape {shape}, expected last dim hidden_size={self.hidden_size}")
        if inp.dtype != dtype:
            raise TypeError(f"{owner}: input dtype {inp.dtype} does not match the weights' compute dtype {dtype}; "
                            f"cast the input")
        return dtype

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None):
        first = check_first_microbatch(self, is_first_microbatch)
        self._check(inp)
        ln_TH = apply_norm(self, inp.reshape(-1, self.hidden_size))
        params = self._op_params()
        if torch.compiler.is_compiling():  # one opaque op: [Note: torch.compile] in nn/_base.py
            y_TH = compiled_forward(self, ln_TH, params, self.hidden_size, first_microbatch=first)
        else:
            y_TH = _LayerNormMLPFunction.apply(ln_TH, *params, self._call(torch.is_grad_enabled(), first))
        out = y_TH.reshape(inp.shape)
        ln_out = ln_TH.reshape(inp.shape)
        if self.return_bias:
            return (out, self.fc2_bias, ln_out) if self.return_layernorm_output else (out, self.fc2_bias)
        return (out, ln_out) if self.return_layernorm_output else out

    def _weights(self) -> list[torch.Tensor]:
        return [getattr(self, "fc1_weight"), getattr(self, "fc2_weight")]  # noqa: B009  Tensor, for mypy

    def _op_params(self) -> list[torch.Tensor | None]:
        """fc1's weight and bias, fc2's weight and bias (None where absent, or returned)."""
        return [self.fc1_weight, self.fc1_bias, self.fc2_weight,  # type: ignore[list-item]  # nn.Module attributes
                None if self.return_bias else self.fc2_bias]  # type: ignore[list-item]

    def _call(self, grad_on: bool, first: bool | None = None) -> _MLPCall:
        """Records this forward's uses and fixes its ``_MLPCall``."""
        params = self._op_params()
        flags = [bool(grad_on and p is not None and p.requires_grad) for p in params]
        uses = self._begin_forward([p for p, f in zip(params, flags) if f and p is not None])
        recipe, store = current_recipe(), self.wgrad_store
        first = current_first_microbatch() if first is None else first
        delay, fuse = self.delay_wgrad_compute, self.fuse_wgrad_accumulation
        fc1 = _Call(flags[0], flags[1], delay, fuse, store, recipe, (self.fc1_width, self.hidden_size), uses=uses,
                    first_microbatch=first)
        fc2 = _Call(flags[2], flags[3], delay, fuse, store, recipe, (self.hidden_size, self.ffn_hidden_size), uses=uses,
                    first_microbatch=first)
        return _MLPCall(fc1, fc2, self.activation, self.checkpoint, delay, self.wgrad_store, recipe)

    def _op_forward(self, ctx, ln_TH: torch.Tensor, aux, ints, grad_on: bool, first: bool | None) -> torch.Tensor:
        """The eager forward inside ``distwgrad::module_forward`` ([Note: torch.compile]), after the norm."""
        params = self._op_params()
        ctx.op_params, ctx.run_backward = [p for p in params if p is not None], _op_backward
        return _LayerNormMLPFunction.forward(ctx, ln_TH, *params, self._call(grad_on, first))  # type: ignore[call-arg,arg-type]

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"normalization={self.normalization}, activation={self.activation}, bias={self.use_bias}, "
                f"delay_wgrad_compute={self.delay_wgrad_compute}, "
                f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}, checkpoint={self.checkpoint}")
