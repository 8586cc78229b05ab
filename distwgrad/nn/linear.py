"""``Linear``: y = x W^T + b, with deferred wgrads, fused fp32 accumulation and distributed weights.

TransformerEngine's ``te.Linear`` signature, for the parts implemented; the weight may be any DistributedWeight
([Note: what backward may hold], [Note: accumulate, never assign]). Under ``fp8_autocast`` the three GEMMs
run in FP8 ([Note: fp8 gemm dispatch], [Note: fp8 distributed weights]), the recipe fixed at forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distwgrad.fp8.emulate import dequantize_weights
from distwgrad.fp8.quantize import Quantized, QuantizedExperts, dequantize
from distwgrad.fp8.recipe import Recipe, current_first_microbatch, current_recipe, split_accumulator
from distwgrad.fp8.weights import in_backward, materialize_quantized, materialize_quantized_group
from distwgrad.nn._base import (
    WgradModule,
    check_compute_dtype,
    check_first_microbatch,
    check_no_tensor_parallelism,
    parameter_device,
)
from distwgrad.nn._compiled import compiled_forward
from distwgrad.ops import grouped_gemm_fp8 as gg8
from distwgrad.ops import scaled_mm
from distwgrad.ops.gemm import wgrad_mm
from distwgrad.protocol import (
    is_distributed_weight,
    materialize_weight_for_backward,
    materialize_weight_for_forward,
)
from distwgrad.weights._accounting import Uses
from distwgrad.weights.base import compute_dtype
from distwgrad.weights.first_write import zero_where_flagged
from distwgrad.wgrad.accumulate import deferred_main_grads, run_wgrad
from distwgrad.wgrad.plain import tag_beside
from distwgrad.wgrad.store import WeightGradStore

__all__ = ["Linear"]


@dataclass(frozen=True)
class _Call:
    """Per-call facts the autograd function needs, fixed at forward time."""

    weight_grad: bool
    bias_grad: bool
    delay: bool
    fuse: bool
    store: WeightGradStore
    recipe: Recipe | None = None
    weight_shape: tuple[int, int] | None = None  # full [N, K], for a foreign weight's grad_buffer check
    uses: Uses | None = None  # this forward's recorded uses ([Note: contribution accounting])
    first_microbatch: bool | None = None  # keeps FP8 weights: [Note: fp8 weights kept across microbatches]


def _materialize_bias(bias: torch.Tensor | None, backward: bool = False) -> torch.Tensor | None:
    if bias is None or not is_distributed_weight(bias):
        return bias
    fn = materialize_weight_for_backward if backward else materialize_weight_for_forward
    return fn([bias])[0]


def _one_group(t_TX: torch.Tensor) -> torch.Tensor:
    """Offsets of one group holding every token: Linear on the grouped FP8 kernels (no host sync).

    [Note: one-group offsets]
    A new tensor costs an allocation and a fill kernel, three per FP8 call, so they are a kept device table
    ([Note: device tables]), except under torch.compile, CUDA graph capture (cannot copy) or a subclass."""
    T, device = t_TX.shape[0], t_TX.device
    if (type(t_TX) is not torch.Tensor or torch.compiler.is_compiling()
            or (t_TX.is_cuda and torch.cuda.is_current_stream_capturing())):
        return torch.full((1,), T, dtype=torch.int32, device=device)
    from distwgrad.kernels._host import device_table  # (torch only)
    return device_table((T,), device, "Linear's one-group offsets", dtype=torch.int32)


def _fprop_fp8(x_q: Quantized, weight, bias, recipe: Recipe, keep: bool | None = None) -> torch.Tensor:
    """[Note: fp8 gemm dispatch]: the FP8 kernels where they apply, else fp32 of the dequantized operands. ``keep``:
    the call's ``is_first_microbatch`` ([Note: fp8 weights kept across microbatches])."""
    w_qs = materialize_quantized(weight, recipe, backward=False, keep=keep)
    b = _materialize_bias(bias)
    split = split_accumulator(recipe, "fprop")
    y = scaled_mm.linear_fprop(x_q, w_qs, x_q.orig_dtype, split) if b is None else None
    if y is not None:  # [Note: a Linear's fp8 GEMMs on cuBLASLt]
        return y
    if gg8.fp8_kernels_accept([x_q], w_qs):
        return gg8.grouped_fprop_fp8(x_q, w_qs, _one_group(x_q.data), None if b is None else b[None],
                                     x_q.orig_dtype, split_accumulator=split)
    w_NK = dequantize_weights(w_qs, packed=False)
    return F.linear(dequantize(x_q, dtype=torch.float32), w_NK, None if b is None else b.float()).to(x_q.orig_dtype)


def _dgrad(dy_TN, weight, recipe: Recipe | None, dy_q=None, keep: bool | None = None) -> torch.Tensor:
    if recipe is None:
        (w_NK,) = materialize_weight_for_backward([weight])
        return dy_TN.mm(w_NK)
    # FP8: the weight is re-gathered in FP8 (or re-quantized), never used at the shard's precision; held
    # whole here, it is quantized straight into dgrad's layout (materialize_quantized_group).
    w_qs = materialize_quantized_group([weight], recipe, backward=True, stacked=True, keep=keep)
    split = split_accumulator(recipe, "dgrad")
    dx = scaled_mm.linear_dgrad(dy_q, w_qs, dy_TN.dtype, split)
    if dx is not None:
        return dx
    if gg8.fp8_kernels_accept([dy_q], w_qs):
        return gg8.grouped_dgrad_fp8(dy_q, w_qs, _one_group(dy_TN), dy_TN.dtype, split_accumulator=split)
    w_NK = dequantize_weights(w_qs.unbind() if isinstance(w_qs, QuantizedExperts) else w_qs, packed=False)
    return dequantize(dy_q, dtype=torch.float32).mm(w_NK).to(dy_TN.dtype)


def _wgrad(dy_TN, x_TK, out, recipe: Recipe | None, dy_qt=None, x_qt=None, out_dtype=None,
           first=None) -> torch.Tensor:
    """dW = dy^T x into ``out`` (FP8 ``first``: [Note: an unwritten accumulator]), else fresh in ``out_dtype``
    (default dy's). Reads the saved ``x_qt`` under a recipe, else ``x_TK``."""
    assert first is None or (recipe is not None and out is not None), "first= is for an FP8 product added into out"
    if recipe is None:
        return wgrad_mm(dy_TN, x_TK, out, out_dtype=None if out is not None else out_dtype)
    assert x_qt is not None
    dy_qt = gg8.quantize_operand(dy_TN, recipe, grad=True)[1] if dy_qt is None else dy_qt
    fresh_dtype = out_dtype or dy_TN.dtype
    dW = scaled_mm.linear_wgrad(dy_qt, x_qt, out, fresh_dtype, split_accumulator(recipe, "wgrad"), first)
    if dW is not None:  # [Note: a Linear's fp8 GEMMs on cuBLASLt]
        return dW
    if gg8.fp8_kernels_accept([dy_qt, x_qt]):
        if out is None:  # straight from the kernel's epilogue
            return gg8.grouped_wgrad_fp8(dy_qt, x_qt, _one_group(dy_TN), out_dtype=fresh_dtype,
                                         split_accumulator=split_accumulator(recipe, "wgrad"))[0]
        # One fp32 contiguous target: the stacked form (a [1, N, K] view), which needs no table of output
        # pointers, so a CUDA graph can capture it into a buffer the warm-up never saw (graph-owned).
        target = out.unsqueeze(0) if out.dtype == torch.float32 and out.is_contiguous() else [out]
        gg8.grouped_wgrad_fp8(dy_qt, x_qt, _one_group(dy_TN), out=target,
                              split_accumulator=split_accumulator(recipe, "wgrad"), first=first)
        return out
    if first is not None:
        zero_where_flagged(out, first)
    dW_NK = dequantize(dy_qt, dtype=torch.float32).mm(dequantize(x_qt, dtype=torch.float32).t())
    return dW_NK.to(fresh_dtype) if out is None else out.add_(dW_NK)


def _linear_wgrad(x_TK: torch.Tensor, dy_TN: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None, call: _Call, deferred: bool, dy_qt=None, x_qt=None, db_N=None):
    """One contribution to the weight (and bias) gradient; returns what autograd gets. ``db_N``: a bias
    gradient the main backward computed from its high-precision ``dy``, delivered as is, never recomputed."""
    gw = gb = None
    shape = call.weight_shape
    if call.weight_grad:
        (gw,) = run_wgrad([weight], lambda t: [_wgrad(dy_TN, x_TK, t[0], call.recipe, dy_qt, x_qt)],
                          fuse=call.fuse, deferred=deferred, shape=shape, dtype=dy_TN.dtype, uses=call.uses,
                          fresh=lambda: [_wgrad(dy_TN, x_TK, None, call.recipe, dy_qt, x_qt, torch.float32)],
                          unwritten=None if call.recipe is None else
                          lambda t, flag: _wgrad(dy_TN, x_TK, t, call.recipe, dy_qt, x_qt, first=flag))
    if call.bias_grad:
        assert bias is not None
        db = dy_TN.sum(0) if db_N is None else db_N
        (gb,) = run_wgrad([bias], lambda t: [db if t[0] is None else t[0].add_(db)], fuse=False,
                          deferred=deferred, shape=None if shape is None else shape[:1], dtype=dy_TN.dtype,
                          uses=call.uses)
    return gw, gb


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TK, weight, bias, call: _Call):
        if call.recipe is None:  # the materialized weight is transient
            (w_NK,) = materialize_weight_for_forward([weight])
            y_TN = F.linear(x_TK, w_NK, _materialize_bias(bias))
            del w_NK
            ctx.save_for_backward(x_TK)
        else:
            x_q, x_qt = gg8.quantize_operand(x_TK, call.recipe, grad=False)
            y_TN = _fprop_fp8(x_q, weight, bias, call.recipe, call.first_microbatch)
            ctx.save_for_backward(*gg8.saved_tensors(x_qt))  # wgrad reads only x^T, in fp8
            ctx.x_meta = gg8.saved_meta(x_qt)
        # Parameters ride on ctx, not save_for_backward: [Note: what backward may hold].
        ctx.weight, ctx.bias, ctx.call = weight, bias, call
        return y_TN

    @staticmethod
    def backward(ctx, dy_TN):
        weight, bias, call = ctx.weight, ctx.bias, ctx.call
        x_TK = x_qt = None
        if call.recipe is None:
            (x_TK,) = ctx.saved_tensors
        else:
            x_qt = gg8.from_saved(ctx.saved_tensors, ctx.x_meta)
        dx_TK = dy_qt = None
        if ctx.needs_input_grad[0]:
            dy_q = None
            if call.recipe is not None:  # one quantization of dy serves dgrad (rows) and wgrad (columns)
                dy_q, dy_qt = gg8.quantize_operand(dy_TN, call.recipe, grad=True)
            dx_TK = _dgrad(dy_TN, weight, call.recipe, dy_q, in_backward(call.first_microbatch))
        if not (call.weight_grad or call.bias_grad):
            return dx_TK, None, None, None
        if call.delay:
            call.store.put(lambda: _linear_wgrad(x_TK, dy_TN, weight, bias, call, deferred=True, dy_qt=dy_qt,
                                                 x_qt=x_qt))
            (gw,) = deferred_main_grads([weight], fuse=call.fuse, on=call.weight_grad)
            return dx_TK, gw, None, None
        gw, gb = _linear_wgrad(x_TK, dy_TN, weight, bias, call, deferred=False, dy_qt=dy_qt, x_qt=x_qt)
        return dx_TK, gw, gb, None


def _op_backward(ctx, dy, need_dx: bool):
    """``_LinearFunction.backward`` inside ``distwgrad::module_backward``: ``(dx, [gw, gb])``."""
    ctx.needs_input_grad = (need_dx, False, False, False)
    dx_TK, gw, gb, _ = _LinearFunction.backward(ctx, dy.reshape(-1, dy.shape[-1]))
    return None if dx_TK is None else dx_TK.reshape(ctx.inp_shape), [gw, gb][: len(ctx.op_params)]


class Linear(WgradModule):
    """A linear layer whose weight gradient may be deferred, fused into ``main_grad`` or distributed.

    Args:
        in_features, out_features: K and N.
        bias: True for a fresh bias, False for none, or a tensor to use as the bias.
        params_dtype, device: of fresh parameters (default device: ``parameter_device``); with ``weight``,
            ``params_dtype`` must equal its ``distwgrad.compute_dtype``, which a fresh bias takes.
        delay_wgrad_compute: queue the wgrad GEMM in backward; ``backward_dw()`` runs it.
        fuse_wgrad_accumulation: accumulate the weight gradient into fp32 ``weight.main_grad``.
        weight: an existing weight (a ``ShardedWeight``, a tied parameter) of full shape ``[N, K]``.
        init_method: initialises a fresh weight in place (default: ``nn.Linear``'s).
        return_bias: return ``(output, bias)`` unadded (TE's convention).
        fp8_exempt: the GEMMs stay in the compute dtype under ``fp8_autocast`` ([Note: a module out of FP8]).
        sequence_parallel, tp_group, tp_size, parallel_mode: accepted at their defaults only.

    ``forward(inp, is_first_microbatch=None)``: TransformerEngine's flag; True or False (the step's first
    microbatch, or a later one) keeps the weight's FP8 copies for the step where it is held whole, None takes the
    active ``distwgrad.fp8.microbatch(first=...)``, else keeps none ([Note: fp8 weights kept across microbatches]
    in ``distwgrad/fp8/weights.py``).

    [Note: a module out of FP8]
    ``fp8_autocast`` covers every module; a module built with ``fp8_exempt=True`` reads no recipe, so its three
    GEMMs run as without FP8, bit for bit. It is a module attribute, not a nested ``fp8_autocast(False)``,
    because the recipe is read when the op runs: under ``torch.compile`` a context manager inside the
    compiled region breaks the graph (dynamo cannot trace the ``ContextVar`` it sets), an attribute does not.
    An MoE router is the use: its N is the expert count, so FP8 saves nothing there, and which experts a token
    goes to moves with every rounding; Megatron computes its router outside FP8, and the benchmarks' torchao
    peer keeps it in bf16.
    """

    _compute_dtype: torch.dtype  # set by the parameter checks (a plain attribute)

    def __init__(self, in_features: int, out_features: int, bias: bool | torch.Tensor = True, *,
                 params_dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 delay_wgrad_compute: bool = False, fuse_wgrad_accumulation: bool = False,
                 weight: torch.Tensor | None = None, init_method: Callable[[torch.Tensor], object] | None = None,
                 return_bias: bool = False, fp8_exempt: bool = False, sequence_parallel: bool = False,
                 tp_group=None, tp_size: int = 1, parallel_mode: str | None = None) -> None:
        super().__init__()
        self._init_wgrad(delay_wgrad_compute=delay_wgrad_compute,
                         fuse_wgrad_accumulation=fuse_wgrad_accumulation)
        check_no_tensor_parallelism(f"Linear({in_features}, {out_features})", sequence_parallel=sequence_parallel,
                                    tp_group=tp_group, tp_size=tp_size, parallel_mode=parallel_mode)
        self.return_bias = bool(return_bias)
        if not isinstance(fp8_exempt, bool):
            raise TypeError(f"Linear({in_features}, {out_features}): fp8_exempt must be a bool, got {fp8_exempt!r}")
        self.fp8_exempt = fp8_exempt
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.in_features, self.out_features = in_features, out_features
        self.wgrad_store.owner = f"Linear({in_features}, {out_features})"
        self.params_dtype = params_dtype
        # A fresh bias next to a given weight takes the weight's compute dtype ([Note: mixed precision]).
        dtype = params_dtype or (torch.get_default_dtype() if weight is None else compute_dtype(weight))
        device = parameter_device(device, like=weight)
        if weight is None:
            weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
            if init_method is None:
                nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
            else:
                with torch.no_grad():
                    init_method(weight)
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        if isinstance(bias, torch.Tensor):
            self.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias)
        elif bias:
            bound = 1 / math.sqrt(in_features)
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device).uniform_(-bound, bound))
            tag_beside(self.bias, self.weight)  # averaged with the weight's group: [Note: plain parameters at finalize]
        else:
            self.register_parameter("bias", None)
        self._check_param_shapes()

    def _check_param_shapes(self) -> torch.dtype:
        full = tuple(getattr(self.weight, "full_shape", self.weight.shape))
        if full != (self.out_features, self.in_features):
            raise ValueError(f"Linear({self.in_features}, {self.out_features}): weight has full shape {full}, "
                             f"expected {(self.out_features, self.in_features)}")
        if self.bias is not None:
            bfull = tuple(getattr(self.bias, "full_shape", self.bias.shape))
            if bfull != (self.out_features,):
                raise ValueError(f"Linear({self.in_features}, {self.out_features}): bias has shape {bfull}, "
                                 f"expected {(self.out_features,)}")
        params = {"weight": self.weight} if self.bias is None else {"weight": self.weight, "bias": self.bias}
        self.__dict__["_compute_dtype"] = dtype = check_compute_dtype(self.wgrad_store.owner, params, self.params_dtype)
        return dtype

    def _check_input(self, inp: torch.Tensor) -> None:
        if not isinstance(inp, torch.Tensor):
            raise TypeError(f"{self.wgrad_store.owner}: input must be a tensor, got {type(inp).__name__}")
        if inp.dim() == 0 or inp.shape[-1] != self.in_features:
            raise ValueError(f"{self.wgrad_store.owner}: input of shape {tuple(inp.shape)} has last dim "
                             f"{inp.shape[-1] if inp.dim() else None}, expected in_features={self.in_features}")
        if inp.dtype != self._compute_dtype:
            raise TypeError(f"{self.wgrad_store.owner}: input dtype {inp.dtype} does not match the weight dtype "
                            f"{self._compute_dtype} (the weight's compute dtype: its param_dtype, else its "
                            f"dtype); cast the input")
        if inp.device != self.weight.device:
            raise ValueError(f"{self.wgrad_store.owner}: input on {inp.device}, weight on {self.weight.device}")

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None):
        first = check_first_microbatch(self, is_first_microbatch)
        bias = None if self.return_bias else self.bias
        if torch.compiler.is_compiling():  # one opaque op: [Note: torch.compile] in nn/_base.py
            out = compiled_forward(self, inp, [self.weight, bias], self.out_features, first_microbatch=first)
        else:
            x_TK, call = self._prepare(inp, bias, torch.is_grad_enabled(), first)
            y_TN = _LinearFunction.apply(x_TK, self.weight, bias, call)
            out = y_TN.reshape(*inp.shape[:-1], self.out_features)
        return (out, self.bias) if self.return_bias else out

    def _prepare(self, inp: torch.Tensor, bias: torch.Tensor | None, grad_on: bool,
                 first: bool | None = None) -> tuple[torch.Tensor, _Call]:
        """Checks, records this forward's uses and fixes its ``_Call``; ``(x_TK, call)``."""
        self._checked_params((self.weight, self.bias), self._check_param_shapes)  # sets _compute_dtype
        self._check_input(inp)
        weight_grad = grad_on and self.weight.requires_grad
        bias_grad = grad_on and bias is not None and bias.requires_grad
        tracked = [p for p, t in ((self.weight, weight_grad), (bias, bias_grad)) if t and p is not None]
        uses = self._begin_forward(tracked)
        call = _Call(weight_grad, bias_grad, self.delay_wgrad_compute, self.fuse_wgrad_accumulation,
                     self.wgrad_store, None if self.fp8_exempt else current_recipe(),
                     (self.out_features, self.in_features), uses,
                     current_first_microbatch() if first is None else first)
        return inp.reshape(-1, self.in_features), call

    def _op_forward(self, ctx, inp: torch.Tensor, aux, ints, grad_on: bool, first: bool | None) -> torch.Tensor:
        """The eager forward inside ``distwgrad::module_forward`` ([Note: torch.compile])."""
        bias = None if self.return_bias else self.bias
        x_TK, call = self._prepare(inp, bias, grad_on, first)
        ctx.op_params = [p for p in (self.weight, bias) if p is not None]
        ctx.inp_shape, ctx.run_backward = inp.shape, _op_backward
        y_TN = _LinearFunction.forward(ctx, x_TK, self.weight, bias, call)
        return y_TN.reshape(*inp.shape[:-1], self.out_features)

    def _weights(self) -> list[torch.Tensor]:
        return [self.weight]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, delay_wgrad_compute={self.delay_wgrad_compute}, "
                f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}"
                + (", fp8_exempt=True" if self.fp8_exempt else ""))
