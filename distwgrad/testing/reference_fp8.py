"""Reference FP8 grouped GEMMs: the oracle of ``distwgrad.kernels.grouped_gemm_fp8``, and its error bound.

The kernels' arguments and semantics (legend as there; L the scale block; ``offs_E`` read on the host here):
each operand dequantized to fp32 as by ``dequantize``, each group one fp32 matmul. Keep TF32 off on CUDA.

[Note: fp8 grouped gemm error bound]
Kernel and oracle both compute y = sum_k a_k b_k (times scales) in fp32, in different orders. Each is within
gamma_n * S of the exact value, S = sum_k |a_k||b_k| (dequantized), gamma_n = n u / (1 - n u), u = 2^-24,
n = K + 4 (K - 1 sums, the dequantize/scale roundings, the product, a bias add; Higham, Thm 3.5), so

    |ours - oracle| <= 2 gamma_n S + mma_rel S + u_out |y| + tiny            (elementwise)

with u_out the output rounding (fp32 2^-24, fp16 2^-11, bf16 2^-7: the interpreter truncates bf16 stores),
``tiny`` the output's smallest subnormal plus fp32 underflow, and ``mma_rel`` the MMA unit's extra error: 0 in
the interpreter, ``hopper_mma_rel`` on Hopper (fp8 tensor cores add into a ~22-bit accumulator between fp32
promotions: DeepSeek-V3 report, Sec. 3.3.2). A wrong tile scale errs by O(|partial sum|) >> gamma_n S, and a
NaN the oracle lacks fails: a loose ``atol`` would hide both. Accumulating wgrad adds one fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distwgrad.fp8.quantize import Quantized, dequantize
from distwgrad.testing.reference import group_ranges

__all__ = ["dequantize_weights", "grouped_fprop_fp8", "grouped_dgrad_fp8", "grouped_wgrad_fp8",
           "HOPPER_MMA_REL", "hopper_mma_rel", "error_bound", "check"]

U32 = 2.0**-24
HOPPER_MMA_REL = 2.0**-9


def hopper_mma_rel(imprecise_depth: int) -> float:
    """``mma_rel`` for ``imprecise_depth`` products between fp32 promotions (128 with the split accumulator, else
    the contraction): <= 4 truncating steps of 2^-13 per 128 products, times a 4x margin, scaled by depth / 128."""
    if imprecise_depth < 1:
        raise ValueError(f"hopper_mma_rel: imprecise_depth must be >= 1, got {imprecise_depth}")
    return HOPPER_MMA_REL * max(1.0, imprecise_depth / 128)
_U_OUT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-7}
_TINY = {torch.float32: 2.0**-149, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}


def _deq(q: Quantized, dtype: torch.dtype, absolute: bool) -> torch.Tensor:
    v = dequantize(q, dtype=torch.float32)
    return (v.abs() if absolute else v).to(dtype)


def dequantize_weights(w_qs, *, block: int = 0) -> torch.Tensor:
    """fp32 ``[E, N, K]`` values of per-expert ``Quantized`` weights or of a ``(w_ENK, scale_inv)`` tuple
    (``scale_inv`` ``[E]``, or ``[E, cdiv(N, block), cdiv(K, block)]`` with ``block`` the block side)."""
    if isinstance(w_qs, tuple) and len(w_qs) == 2 and all(isinstance(t, torch.Tensor) for t in w_qs):
        data, s = w_qs
        E, N, K = data.shape
        if s.dim() == 1:
            return data.float() * s[:, None, None]
        s = s.repeat_interleave(block, 1)[:, :N].repeat_interleave(block, 2)[:, :, :K]
        return data.float() * s
    return torch.stack([dequantize(q, dtype=torch.float32) for q in w_qs])


def _block(q: Quantized) -> int:
    return 0 if q.block is None else q.block[1]


def _ragged(a_q: Quantized, w_qs, offs_E, bias_EN, out_dtype, *, transpose_w: bool, absolute: bool,
            compute_dtype: torch.dtype) -> torch.Tensor:
    a = _deq(a_q, compute_dtype, absolute)
    w = dequantize_weights(w_qs, block=_block(a_q))
    w = (w.abs() if absolute else w).to(compute_dtype)
    rows = w.shape[1] if transpose_w else w.shape[2]
    out = torch.zeros(a.shape[0], rows, dtype=compute_dtype, device=a.device)
    for e, (s, t) in enumerate(group_ranges(offs_E)):
        if t > s:
            out[s:t] = a[s:t] @ (w[e].t() if transpose_w else w[e])
            if bias_EN is not None and not absolute:
                out[s:t] += bias_EN[e].to(compute_dtype)
    return out if absolute else out.to(out_dtype)


def grouped_fprop_fp8(x_q: Quantized, w_qs, offs_E: torch.Tensor, bias_EN: torch.Tensor | None = None,
                      out_dtype: torch.dtype = torch.bfloat16, *, absolute: bool = False,
                      compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``y_TN[g] = deq(x)[g] @ deq(w_e)^T (+ bias_EN[e])``. ``absolute``: ``S = |x| @ |w|^T`` instead (no
    bias, no cast: the scale of the error bound). Rows at or past ``offs_E[-1]`` are zero."""
    return _ragged(x_q, w_qs, offs_E, bias_EN, out_dtype, transpose_w=True, absolute=absolute,
                   compute_dtype=compute_dtype)


def grouped_dgrad_fp8(dy_q: Quantized, w_qs, offs_E: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, *,
                      absolute: bool = False, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``dx_TK[g] = deq(dy)[g] @ deq(w_e)``; ``absolute`` as in :func:`grouped_fprop_fp8`."""
    return _ragged(dy_q, w_qs, offs_E, None, out_dtype, transpose_w=False, absolute=absolute,
                   compute_dtype=compute_dtype)


def grouped_wgrad_fp8(dy_qt: Quantized, x_qt: Quantized, offs_E: torch.Tensor,
                      out: torch.Tensor | Sequence[torch.Tensor] | None = None, *, absolute: bool = False,
                      compute_dtype: torch.dtype = torch.float32):
    """``dW_e = deq(dy^T)[:, g] @ deq(x^T)[:, g]^T``: a fresh ``[E, N, K]`` in ``compute_dtype`` (zeros for an
    empty group), or added into ``out`` (stacked or a list). ``absolute``: ``|dy^T| @ |x^T|^T``."""
    dy_t = _deq(dy_qt, compute_dtype, absolute)
    x_t = _deq(x_qt, compute_dtype, absolute)
    ranges = group_ranges(offs_E)
    if out is None:
        dW = torch.zeros(len(ranges), dy_t.shape[0], x_t.shape[0], dtype=compute_dtype, device=dy_t.device)
        for e, (s, t) in enumerate(ranges):
            if t > s:
                dW[e] = dy_t[:, s:t] @ x_t[:, s:t].t()
        return dW
    for e, (s, t) in enumerate(ranges):
        if t > s:
            out[e].add_(dy_t[:, s:t] @ x_t[:, s:t].t())
    return out


def error_bound(S: torch.Tensor, expected: torch.Tensor, *, depth: int, out_dtype: torch.dtype,
                mma_rel: float = 0.0, addend: torch.Tensor | None = None) -> torch.Tensor:
    """Elementwise float64 bound on ``|ours - expected|`` ([Note: fp8 grouped gemm error bound]). ``S``: ``sum |a||b|``
    per output (``absolute=True``); ``expected``: the oracle (plus ``addend``), unrounded; ``depth``: the contraction
    length (or more); ``out_dtype``: ours'; ``addend``: the fp32 buffer ours was added into."""
    n = depth + 4
    gamma = n * U32 / (1 - n * U32)
    S = S.double()
    err = (2 * gamma + mma_rel) * S
    y = expected.double().abs()
    bound = err + _U_OUT[out_dtype] * (y + err) + _TINY[out_dtype] + n * 2.0**-126
    if addend is not None:
        bound = bound + U32 * (addend.double().abs() + y + err)
    return bound * (1 + 2.0**-20)


def check(ours: torch.Tensor, expected: torch.Tensor, S: torch.Tensor, *, chunk: int = 1 << 25,
          **bound_kw) -> dict:
    """``ok`` iff every element of ``ours`` is within :func:`error_bound` (NaN matches NaN only); ``worst``: the largest
    error/bound ratio. Works in ``chunk``-element pieces (float64 temporaries of a large wgrad would not fit)."""
    addend = bound_kw.pop("addend", None)
    flat = [t.reshape(-1) for t in (ours, expected, S)]
    flat_add = None if addend is None else addend.reshape(-1)
    worst, bad_count, nan_mismatch, first_bad = 0.0, 0, 0, None
    for lo in range(0, ours.numel(), chunk):
        hi = min(lo + chunk, ours.numel())
        o, x = flat[0][lo:hi].double(), flat[1][lo:hi].double()
        add = None if flat_add is None else flat_add[lo:hi]
        bound = error_bound(flat[2][lo:hi], flat[1][lo:hi], addend=add, **bound_kw)
        nan_o, nan_x = torch.isnan(o), torch.isnan(x)
        both = nan_o & nan_x
        ratio = torch.where(both, 0.0, (o - x).abs() / bound)
        bad = ~(ratio <= 1)  # NaN in only one of them compares False
        finite = ratio[torch.isfinite(ratio)]
        if finite.numel():
            worst = max(worst, float(finite.max()))
        n_bad = int(bad.sum())
        bad_count += n_bad
        nan_mismatch += int((nan_o ^ nan_x).sum())
        if n_bad and first_bad is None:
            i = int(bad.nonzero()[0])
            first_bad = {"index": lo + i, "ours": float(o[i]), "expected": float(x[i]), "bound": float(bound[i])}
    res: dict[str, object] = {"ok": bad_count == 0, "worst": worst, "bad": bad_count, "numel": ours.numel(),
                              "nan_mismatch": nan_mismatch}
    if first_bad is not None:
        res["first_bad"] = first_bad
    return res
