"""``GroupedLinear``: E expert GEMMs over ragged token groups (MoE), one grouped-GEMM call per product.

Legend: E experts (``num_gemms``), T tokens, K in-features, N out-features. Parameters have TransformerEngine's
names; any may be a distributed weight (a packed ``ShardedWeight`` is gathered in one collective). Gradients
and FP8 as Linear's ([Note: accumulate, never assign], [Note: fp8 gemm dispatch]).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from distwgrad.fp8.quantize import Quantized, QuantizedExperts
from distwgrad.fp8.recipe import Recipe, current_first_microbatch, current_recipe, split_accumulator
from distwgrad.fp8.weights import in_backward, materialize_quantized_group
from distwgrad.nn._base import (
    WgradModule,
    check_compute_dtype,
    check_first_microbatch,
    check_no_tensor_parallelism,
    parameter_device,
)
from distwgrad.nn._compiled import compiled_forward
from distwgrad.ops import grouped_gemm as gg
from distwgrad.ops import grouped_gemm_fp8 as gg8
from distwgrad.protocol import materialize_weight_for_backward, materialize_weight_for_forward
from distwgrad.weights._accounting import Uses
from distwgrad.weights.lifecycle import write_token
from distwgrad.wgrad.accumulate import deferred_main_grads, run_wgrad
from distwgrad.wgrad.store import WeightGradStore

__all__ = ["GroupedLinear"]


@dataclass(frozen=True)
class _Call:
    num_weights: int
    packed: bool
    weight_grad: bool
    bias_grad: bool
    delay: bool
    fuse: bool
    store: WeightGradStore
    recipe: Recipe | None = None
    weight_shape: tuple[int, ...] | None = None  # each weight's full shape, for a foreign grad_buffer check
    uses: Uses | None = None  # this forward's recorded uses ([Note: contribution accounting])
    bias_now: bool = False  # deferring, the biases' gradients still come from the main backward (te.ops)
    first_microbatch: bool | None = None  # keeps FP8 weights: [Note: fp8 weights kept across microbatches]


def _stack(tensors: Sequence[torch.Tensor], packed: bool) -> torch.Tensor:
    """Packed weights are already ``[E, ...]``; discrete ones are stacked (one transient copy)."""
    return tensors[0] if packed else torch.stack(list(tensors))


def _weights_ENK(weights, call: _Call, *, backward: bool) -> torch.Tensor:
    """The experts' full weights for a GEMM, as stored (no recipe)."""
    fn = materialize_weight_for_backward if backward else materialize_weight_for_forward
    return _stack(fn(weights), call.packed)


def _weights_fp8(weights, call: _Call, *, backward: bool, amax=None) -> list[Quantized] | QuantizedExperts:
    """The experts quantized for one GEMM (a sharded one before its gather). ``amax``: forward's ``(amaxes,
    write tokens)``, reused while no weight was written ([Note: weight lifecycle] in ``weights/lifecycle.py``)."""
    assert call.recipe is not None
    if amax is not None and amax[1] != [write_token(w) for w in weights]:
        amax = None
    return materialize_quantized_group(weights, call.recipe, backward=backward, stacked=True,
                                       amax=None if amax is None else amax[0],
                                       keep=in_backward(call.first_microbatch) if backward else call.first_microbatch)


def _wgrad_gemm(dy_TN, x_TK, offs_E, packed: bool, recipe: Recipe | None, dy_qt: Quantized | None = None,
                x_qt: Quantized | None = None, wgrad_offs: torch.Tensor | None = None):
    """``(gemm, fresh, unwritten)`` for ``run_wgrad``, reading saved ``x_qt`` under a recipe, else ``x_TK``. FP8
    tiles may span two experts (valid; per-expert tiles would need the offsets on the host). ``wgrad_offs``:
    x^T's aligned layout's end offsets ([Note: aligned token groups] in kernels/token_layout.py)."""
    if recipe is None:
        def product(out, out_dtype=None, first=None):
            return gg.grouped_wgrad(dy_TN, x_TK, offs_E, out=out, out_dtype=out_dtype, first=first)
    else:
        assert x_qt is not None
        if dy_qt is None:
            dy_qt = gg8.quantize_operand(dy_TN, recipe, grad=True,
                                         aligned_offs=None if wgrad_offs is None else offs_E)[1]
        offs_w = offs_E if wgrad_offs is None else wgrad_offs

        def product(out, out_dtype=None, first=None):  # a fresh product straight from the kernel's epilogue
            return gg8.grouped_wgrad_fp8(dy_qt, x_qt, offs_w, out=out, out_dtype=torch.float32 if out is not None
                                         else out_dtype or dy_TN.dtype,
                                         split_accumulator=split_accumulator(recipe, "wgrad"), first=first)

    def fresh(out_dtype=None) -> list[torch.Tensor]:  # every expert written, one with no tokens as zeros
        dW_ENK = product(None, out_dtype)
        return [dW_ENK] if packed else list(dW_ENK.unbind(0))

    def gemm(targets: list[torch.Tensor | None]) -> list[torch.Tensor]:
        if targets[0] is None:
            return fresh()
        if packed:
            return [product(targets[0])]
        return list(product([t for t in targets if t is not None]))
    def unwritten(target: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:  # one stacked weight's main_grad
        return product(target, first=flag)
    return gemm, lambda: fresh(torch.float32), unwritten if packed else None


def _bias_gemm(dy_TN, offs_E, packed: bool):
    def gemm(targets: list[torch.Tensor | None]) -> list[torch.Tensor]:
        db_EN = gg.grouped_bias_grad(dy_TN, offs_E)
        grads = [db_EN] if packed else list(db_EN.unbind(0))
        if targets[0] is None:
            return grads
        return [t.add_(g) for t, g in zip(targets, grads)]
    return gemm


def _grouped_wgrad(x_TK, dy_TN, offs_E, weights, biases, call: _Call, deferred: bool, dy_qt=None, x_qt=None,
                   wgrad_offs=None):
    gws: list[torch.Tensor | None] = [None] * len(weights)
    gbs: list[torch.Tensor | None] = [None] * len(biases)
    if call.weight_grad:
        gemm, fresh, unwritten = _wgrad_gemm(dy_TN, x_TK, offs_E, call.packed, call.recipe, dy_qt, x_qt, wgrad_offs)
        gws = run_wgrad(weights, gemm, fuse=call.fuse, deferred=deferred, shape=call.weight_shape,
                        dtype=dy_TN.dtype, uses=call.uses, fresh=fresh, unwritten=unwritten)
    if call.bias_grad:
        gbs = _grouped_bias_grad(dy_TN, offs_E, biases, call, deferred)
    return gws, gbs


def _grouped_bias_grad(dy_TN, offs_E, biases, call: _Call, deferred: bool) -> list[torch.Tensor | None]:
    shape = None if call.weight_shape is None else call.weight_shape[:-1]
    return run_wgrad(biases, _bias_gemm(dy_TN, offs_E, call.packed), fuse=False, deferred=deferred, shape=shape,
                     dtype=dy_TN.dtype, uses=call.uses)


class _GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TK, offs_E, call: _Call, *params):
        weights, biases = list(params[: call.num_weights]), list(params[call.num_weights:])
        b_EN = _stack(materialize_weight_for_forward(biases), call.packed) if biases else None
        if call.recipe is None:
            w_ENK = _weights_ENK(weights, call, backward=False)
            y_TN = gg.grouped_fprop(x_TK, w_ENK, offs_E, b_EN)
            del w_ENK  # transient: never saved, never cached
            ctx.save_for_backward(x_TK, offs_E)
        else:  # [Note: fp8 gemm dispatch]
            w_qs = _weights_fp8(weights, call, backward=False)
            # the weights' amaxes for backward's re-quantization, valid while no weight changes
            ctx.w_amax = ((w_qs.amax, [write_token(w) for w in weights])
                          if isinstance(w_qs, QuantizedExperts) and w_qs.amax is not None else None)
            # x^T, which wgrad reads, with each expert's tokens on the chunk grid where that pays
            # ([Note: aligned token groups] in kernels/token_layout.py)
            align = call.weight_grad and gg8.align_wgrad(x_TK, call.recipe, offs_E.shape[0])
            x_q, x_qt = gg8.quantize_operand(x_TK, call.recipe, grad=False, aligned_offs=offs_E if align else None)
            y_TN = gg8.grouped_fprop_fp8(x_q, w_qs, offs_E, b_EN, x_TK.dtype,
                                         split_accumulator=split_accumulator(call.recipe, "fprop"))
            del w_qs, x_q
            wgrad_offs = gg8.wgrad_offsets(offs_E, x_TK.shape[0]) if align else offs_E
            ctx.save_for_backward(*gg8.saved_tensors(x_qt), offs_E, wgrad_offs)  # wgrad reads only x^T, in fp8
            ctx.x_meta, ctx.align = gg8.saved_meta(x_qt), align
        del b_EN
        # Parameters ride on ctx, not save_for_backward: [Note: what backward may hold].
        ctx.weights, ctx.biases, ctx.call = weights, biases, call
        return y_TN

    @staticmethod
    def backward(ctx, dy_TN):
        weights, biases, call = ctx.weights, ctx.biases, ctx.call
        x_TK = x_qt = wgrad_offs = None
        if call.recipe is None:
            x_TK, offs_E = ctx.saved_tensors
        else:
            *x_saved, offs_E, wgrad_offs = ctx.saved_tensors
            x_qt = gg8.from_saved(x_saved, ctx.x_meta)
            wgrad_offs = wgrad_offs if ctx.align else None
        dy_TN = dy_TN.contiguous()
        dx_TK = dy_qt = None
        if ctx.needs_input_grad[0]:
            if call.recipe is None:
                w_ENK = _weights_ENK(weights, call, backward=True)
                dx_TK = gg.grouped_dgrad(dy_TN, w_ENK, offs_E)
                del w_ENK
            else:  # one quantization of dy serves dgrad (rows) and wgrad (columns)
                w_qs = _weights_fp8(weights, call, backward=True, amax=ctx.w_amax)
                dy_q, dy_qt = gg8.quantize_operand(dy_TN, call.recipe, grad=True,
                                                   aligned_offs=offs_E if wgrad_offs is not None else None)
                dx_TK = gg8.grouped_dgrad_fp8(dy_q, w_qs, offs_E, dy_TN.dtype,
                                              split_accumulator=split_accumulator(call.recipe, "dgrad"))
                del dy_q, w_qs
        nones = (None,) * (len(weights) + len(biases))
        if not (call.weight_grad or call.bias_grad):
            return (dx_TK, None, None, *nones)
        if call.delay:
            gbs: list[torch.Tensor | None] = [None] * len(biases)
            queued = call
            if call.bias_now and call.bias_grad:
                gbs = _grouped_bias_grad(dy_TN, offs_E, biases, call, deferred=False)
                queued = dataclasses.replace(call, bias_grad=False)
            if queued.weight_grad or queued.bias_grad:
                call.store.put(lambda: _grouped_wgrad(x_TK, dy_TN, offs_E, weights, biases, queued, deferred=True,
                                                      dy_qt=dy_qt, x_qt=x_qt, wgrad_offs=wgrad_offs))
            gws = deferred_main_grads(weights, fuse=call.fuse, on=call.weight_grad)
            return (dx_TK, None, None, *gws, *gbs)
        gws, gbs = _grouped_wgrad(x_TK, dy_TN, offs_E, weights, biases, call, deferred=False, dy_qt=dy_qt,
                                  x_qt=x_qt, wgrad_offs=wgrad_offs)
        return (dx_TK, None, None, *gws, *gbs)


def _op_backward(ctx, dy, need_dx: bool):
    """``_GroupedLinearFunction.backward`` inside ``distwgrad::module_backward``: ``(dx, grads)``."""
    ctx.needs_input_grad = (need_dx, False, False) + (False,) * len(ctx.op_params)
    dx_TK, _, _, *grads = _GroupedLinearFunction.backward(ctx, dy.reshape(-1, dy.shape[-1]))
    return None if dx_TK is None else dx_TK.reshape(ctx.inp_shape), grads


class GroupedLinear(WgradModule):
    """``num_gemms`` linear experts applied to consecutive token groups of sizes ``m_splits``.

    Args:
        num_gemms, in_features, out_features: E, K and N.
        bias: whether each expert has a bias (``bias0..``, next to ``weight0..weight{E-1}`` ``[N, K]``).
        single_grouped_weight: one packed ``weight`` ``[E, N, K]`` (and ``bias`` ``[E, N]``) instead.
        use_grouped_tensor: accepted and ignored (distwgrad always runs one grouped GEMM).
        params_dtype (later weights must match), device, delay_wgrad_compute, fuse_wgrad_accumulation, init_method
            (per expert), return_bias (``(output, [biases])``), TP arguments: as ``distwgrad.nn.Linear``'s.

    ``forward(inp, m_splits, is_first_microbatch=None)``: ``m_splits`` are ints or a tensor;
    ``is_first_microbatch`` as ``Linear``'s ([Note: fp8 weights kept across microbatches]).
    """

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool = True, *,
                 params_dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 single_grouped_weight: bool = False, use_grouped_tensor: bool | None = None,
                 delay_wgrad_compute: bool = False, fuse_wgrad_accumulation: bool = False,
                 init_method: Callable[[torch.Tensor], object] | None = None, return_bias: bool = False,
                 sequence_parallel: bool = False, tp_group=None, tp_size: int = 1,
                 parallel_mode: str | None = None) -> None:
        super().__init__()
        del use_grouped_tensor  # an execution path; distwgrad has one
        self._init_wgrad(delay_wgrad_compute=delay_wgrad_compute,
                         fuse_wgrad_accumulation=fuse_wgrad_accumulation)
        check_no_tensor_parallelism(f"GroupedLinear({num_gemms}, {in_features}, {out_features})",
                                    sequence_parallel=sequence_parallel, tp_group=tp_group, tp_size=tp_size,
                                    parallel_mode=parallel_mode)
        self.return_bias = bool(return_bias)
        for name, v in (("num_gemms", num_gemms), ("in_features", in_features), ("out_features", out_features)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.single_grouped_weight = bool(single_grouped_weight)
        self.use_bias = bool(bias)
        self.wgrad_store.owner = f"GroupedLinear({num_gemms}, {in_features}, {out_features})"
        self.params_dtype = params_dtype
        dtype, device = params_dtype or torch.get_default_dtype(), parameter_device(device)
        bound = 1 / math.sqrt(in_features)
        new = lambda *shape: nn.Parameter(torch.empty(*shape, dtype=dtype, device=device).uniform_(-bound, bound))
        if self.single_grouped_weight:
            self.weight = new(num_gemms, out_features, in_features)
            if self.use_bias:
                self.bias = new(num_gemms, out_features)
        else:
            for e in range(num_gemms):
                setattr(self, f"weight{e}", new(out_features, in_features))
                if self.use_bias:
                    setattr(self, f"bias{e}", new(out_features))
        if init_method is not None:
            with torch.no_grad():
                for w in self._weights():
                    for matrix in (w.unbind(0) if self.single_grouped_weight else [w]):
                        init_method(matrix)

    _biases_in_main_backward = False  # deferring, backward_dw() delivers the biases' gradients too

    def _weights(self) -> list[torch.Tensor]:
        if self.single_grouped_weight:
            return [self.weight]
        return [getattr(self, f"weight{e}") for e in range(self.num_gemms)]

    def _biases(self) -> list[torch.Tensor]:
        if not self.use_bias:
            return []
        if self.single_grouped_weight:
            return [self.bias]
        return [getattr(self, f"bias{e}") for e in range(self.num_gemms)]

    def _check_params(self, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.dtype:
        owner = self.wgrad_store.owner
        E, N, K = self.num_gemms, self.out_features, self.in_features
        want_w = [(E, N, K)] if self.single_grouped_weight else [(N, K)] * E
        want_b = ([(E, N)] if self.single_grouped_weight else [(N,)] * E) if self.use_bias else []
        for kind, got, want in (("weight", weights, want_w), ("bias", biases, want_b)):
            shapes = [tuple(getattr(p, "full_shape", p.shape)) for p in got]
            if shapes != want:
                raise ValueError(f"{owner}: {kind} full shapes {shapes}, expected {want}")
        names = [f"weight{e}" for e in range(len(weights))] + [f"bias{e}" for e in range(len(biases))]
        if self.single_grouped_weight:
            names = ["weight", "bias"][: len(weights) + len(biases)]
        return check_compute_dtype(owner, dict(zip(names, weights + biases)), self.params_dtype)

    def _check(self, inp: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> None:
        owner = self.wgrad_store.owner
        dtype = self._checked_params(weights + biases, lambda: self._check_params(weights, biases))
        if not isinstance(inp, torch.Tensor) or inp.dim() == 0 or inp.shape[-1] != self.in_features:
            shape = tuple(inp.shape) if isinstance(inp, torch.Tensor) else type(inp).__name__
            raise ValueError(f"{owner}: input of shape {shape}, expected last dim in_features={self.in_features}")
        if inp.dtype != dtype:
            raise TypeError(f"{owner}: input dtype {inp.dtype} does not match the weights' compute dtype {dtype} "
                            f"(their param_dtype, else their dtype); cast the input")
        if any(p.device != inp.device for p in weights + biases):
            raise ValueError(f"{owner}: input on {inp.device}, parameters on "
                             f"{sorted({str(p.device) for p in weights + biases})}")

    def forward(self, inp: torch.Tensor, m_splits: Sequence[int] | torch.Tensor,
                is_first_microbatch: bool | None = None):
        first = check_first_microbatch(self, is_first_microbatch)
        weights, all_biases = self._weights(), self._biases()
        biases = [] if self.return_bias else all_biases
        if torch.compiler.is_compiling():  # one opaque op: [Note: torch.compile] in nn/_base.py
            if isinstance(m_splits, torch.Tensor):
                out = compiled_forward(self, inp, weights + biases, self.out_features, aux=[m_splits], ints=(),
                                       first_microbatch=first)
            else:
                out = compiled_forward(self, inp, weights + biases, self.out_features, aux=(), ints=m_splits,
                                       first_microbatch=first)
            return (out, all_biases) if self.return_bias else out
        x_TK, offs_E, call = self._prepare(inp, m_splits, weights, biases, torch.is_grad_enabled(), first)
        y_TN = _GroupedLinearFunction.apply(x_TK, offs_E, call, *weights, *biases)
        out = y_TN.reshape(*inp.shape[:-1], self.out_features)
        return (out, all_biases) if self.return_bias else out

    def _prepare(self, inp: torch.Tensor, m_splits, weights: list[torch.Tensor], biases: list[torch.Tensor],
                 grad_on: bool, first: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, _Call]:
        """Checks, records this forward's uses and fixes its ``_Call``; ``(x_TK, offs_E, call)``."""
        self._check(inp, weights, self._biases())
        x_TK = inp.reshape(-1, self.in_features)
        offs_E = gg.splits_to_offsets(m_splits, self.num_gemms, x_TK.shape[0], x_TK.device)
        weight_grad = grad_on and any(p.requires_grad for p in weights)
        bias_grad = grad_on and any(p.requires_grad for p in biases)
        for kind, group, on in (("weights", weights, weight_grad), ("biases", biases, bias_grad)):
            if on and not all(p.requires_grad for p in group):
                raise ValueError(f"{self.wgrad_store.owner}: some expert {kind} require grad and some do "
                                 f"not ({[p.requires_grad for p in group]}); freeze all or none")
        tracked = (weights if weight_grad else []) + (biases if bias_grad else [])
        uses = self._begin_forward(tracked)
        call = _Call(len(weights), self.single_grouped_weight, weight_grad, bias_grad,
                     self.delay_wgrad_compute, self.fuse_wgrad_accumulation, self.wgrad_store, current_recipe(),
                     ((self.num_gemms,) if self.single_grouped_weight else ()) + (self.out_features, self.in_features),
                     uses, bias_now=self._biases_in_main_backward,
                     first_microbatch=current_first_microbatch() if first is None else first)
        return x_TK, offs_E, call

    def _op_forward(self, ctx, inp: torch.Tensor, aux, ints, grad_on: bool, first: bool | None) -> torch.Tensor:
        """The eager forward inside ``distwgrad::module_forward`` ([Note: torch.compile])."""
        weights = self._weights()
        biases = [] if self.return_bias else self._biases()
        x_TK, offs_E, call = self._prepare(inp, aux[0] if aux else list(ints), weights, biases, grad_on, first)
        ctx.op_params, ctx.inp_shape, ctx.run_backward = weights + biases, inp.shape, _op_backward
        y_TN = _GroupedLinearFunction.forward(ctx, x_TK, offs_E, call, *weights, *biases)
        return y_TN.reshape(*inp.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.use_bias}, "
                f"single_grouped_weight={self.single_grouped_weight}, "
                f"delay_wgrad_compute={self.delay_wgrad_compute}, "
                f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}")
