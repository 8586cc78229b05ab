"""Argument checks of the FP8 grouped GEMMs (``grouped_gemm_fp8.py``): eager launchers, fake
implementations and public wrappers all call these, so a bad argument fails the same way everywhere."""

from __future__ import annotations

import torch

from ._grouped_gemm_checks import _check_first, _check_tensor, _check_wgrad_out
from .grouped_gemm import _interpreting

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_fp8(op: str, named: dict, scales: dict, block: int) -> None:
    """float8 operands and fp32 scales on one device, scale shapes as the recipe says (block 0:
    per-tensor): a 2-D operand has 1xL tiles along dim 1 (its contraction), a 3-D weight LxL blocks."""
    if not isinstance(block, int) or isinstance(block, bool) or (block and (block < 32 or block & (block - 1))):
        raise ValueError(f"{op}: the scale block must be 0 (per-tensor) or a power of two >= 32, got {block!r}")
    first, device = next(iter(named)), next(iter(named.values())).device
    for name, t in named.items():
        s = scales[name]
        if t.dtype not in _FP8:
            raise TypeError(f"{op}: {name} must be float8_e4m3fn or float8_e5m2, got {t.dtype}")
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
            raise TypeError(f"{op}: {name}'s scale_inv must be a float32 tensor, got "
                            f"{getattr(s, 'dtype', type(s).__name__)}")
        for what, v in ((name, t), (f"{name}'s scale_inv", s)):
            if v.device != device:
                raise ValueError(f"{op}: {what} is on {v.device} but {first} is on {device}")
        cdiv = lambda n: -(-n // block)
        if t.dim() == 2:
            want = (t.shape[0], cdiv(t.shape[1])) if block else ()
        else:
            want = (t.shape[0], cdiv(t.shape[1]), cdiv(t.shape[2])) if block else (t.shape[0],)
        if tuple(s.shape) != want:
            raise ValueError(f"{op}: {name}'s scale_inv has shape {tuple(s.shape)}, expected {want} for {name} "
                             f"{tuple(t.shape)} and scale block {block or 'per-tensor'}")


def _check_offsets(op: str, offs_E, num_groups: int, device) -> None:
    _check_tensor(op, "offs_E", offs_E, 1)
    if offs_E.dtype != torch.int32:
        raise TypeError(f"{op}: offs_E must hold int32 end offsets, got {offs_E.dtype}")
    if offs_E.shape[0] != num_groups:
        raise ValueError(f"{op}: offs_E has {offs_E.shape[0]} entries, expected one per group ({num_groups})")
    if offs_E.device != device:
        raise ValueError(f"{op}: offs_E is on {offs_E.device} but the operands are on {device}")


def _check_ragged(op, a, a_s, w, w_s, offs_E, block, out_dtype, bias_EN=None) -> None:
    a_name, c = ("x", 2) if op == "grouped_fprop_fp8" else ("dy", 1)
    _check_tensor(op, a_name, a, 2)
    _check_tensor(op, "w", w, 3)
    if a.shape[1] != w.shape[c]:
        raise ValueError(f"{op}: {a_name} {tuple(a.shape)} and w {tuple(w.shape)} disagree on the "
                         f"contraction ({'K' if c == 2 else 'N'})")
    _check_fp8(op, {a_name: a, "w": w}, {a_name: a_s, "w": w_s}, block)
    _check_offsets(op, offs_E, w.shape[0], a.device)
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"{op}: out_dtype must be one of {list(_OUT_DTYPES)}, got {out_dtype!r}")
    if bias_EN is not None:
        _check_tensor(op, "bias_EN", bias_EN, 2)
        if tuple(bias_EN.shape) != tuple(w.shape[:2]) or bias_EN.dtype not in _OUT_DTYPES:
            raise ValueError(f"{op}: bias_EN must be a bf16/fp16/fp32 [E, N] = {tuple(w.shape[:2])} tensor, "
                             f"got {bias_EN.dtype} {tuple(bias_EN.shape)}")
        if bias_EN.device != a.device:
            raise ValueError(f"{op}: bias_EN is on {bias_EN.device} but {a_name} is on {a.device}")


def _check_wgrad(dy_t, dy_s, x_t, x_s, offs_E, block, out, out_dtype: torch.dtype = torch.float32,
                 first=None) -> None:
    """``out_dtype``: a fresh output's dtype (an ``out`` to add into is fp32, checked with it); ``first``: the
    flag of an output to add into ([Note: an unwritten accumulator] in ``distwgrad/weights/first_write.py``)."""
    op = "grouped_wgrad_fp8"
    _check_tensor(op, "dy_t", dy_t, 2)
    _check_tensor(op, "x_t", x_t, 2)
    if dy_t.shape[1] != x_t.shape[1]:
        raise ValueError(f"{op}: dy_t {tuple(dy_t.shape)} ([N, T]) and x_t {tuple(x_t.shape)} ([K, T]) "
                         f"disagree on T")
    _check_fp8(op, {"dy_t": dy_t, "x_t": x_t}, {"dy_t": dy_s, "x_t": x_s}, block)
    _check_tensor(op, "offs_E", offs_E, 1)
    E, N, K = offs_E.shape[0], dy_t.shape[0], x_t.shape[0]
    _check_offsets(op, offs_E, E, dy_t.device)
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"{op}: out_dtype must be one of {list(_OUT_DTYPES)}, got {out_dtype!r}")
    if out is None:
        if first is not None:
            raise ValueError(f"{op}: first= flags an output to write or add into; a fresh output (out=None) "
                             f"takes none")
        return
    _check_wgrad_out(op, out, E, N, K, dy_t.device, "dy_t")
    _check_first(op, first, dy_t.device)


def _check_runnable(op: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not _interpreting():
        raise ValueError(f"{op}: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {t.device}; "
                         f"distwgrad.testing.reference_fp8 computes the same products with torch")


def _check_split(op: str, block: int, split_accumulator: object) -> None:
    """``split_accumulator`` is a bool, and False only under per-tensor scaling: the blockwise recipe
    promotes every scale block by construction (each block's dot is scaled before it is added)."""
    if not isinstance(split_accumulator, bool):
        raise TypeError(f"{op}: split_accumulator must be a bool, got {split_accumulator!r}")
    if block and not split_accumulator:
        raise ValueError(f"{op}: split_accumulator=False applies to per-tensor scaling only; the 1x{block} "
                         f"blockwise recipe promotes every {block}-deep block to fp32 by construction")
