"""Argument checks for ``distwgrad.kernels.grouped_gemm`` (user-facing: ValueError/TypeError naming the
bad value). They run in the eager launchers, the fake implementations and the public wrappers alike, so a
wrong call fails the same way eagerly and under torch.compile. Legend as in ``grouped_gemm``.
"""

import torch
from torch._subclasses.fake_tensor import is_fake

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_tensor(op: str, name: str, t, dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{op}: {name} must be {dim}-D, got shape {tuple(t.shape)}")


def _check_operands(op: str, named: dict, offs_E, num_groups: int) -> None:
    """Same dtype (bf16/fp16/fp32) and device for all operands; int32 offsets, one per group."""
    first_name, first = next(iter(named.items()))
    for name, t in named.items():
        if t.dtype not in _DTYPES:
            raise TypeError(f"{op}: {name} must be bfloat16, float16 or float32, got {t.dtype}")
        if t.dtype != first.dtype:
            raise TypeError(f"{op}: {name} is {t.dtype} but {first_name} is {first.dtype}")
        if t.device != first.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first_name} is on {first.device}")
    _check_tensor(op, "offs_E", offs_E, 1)
    if offs_E.dtype != torch.int32:
        raise TypeError(f"{op}: offs_E must hold int32 end offsets, got {offs_E.dtype}")
    if offs_E.shape[0] != num_groups:
        raise ValueError(f"{op}: offs_E has {offs_E.shape[0]} entries, expected one per group ({num_groups})")
    if offs_E.device != first.device:
        raise ValueError(f"{op}: offs_E is on {offs_E.device} but {first_name} is on {first.device}")


def _check_fprop(x_TK, w_ENK, offs_E, bias_EN) -> None:
    op = "grouped_fprop"
    _check_tensor(op, "x_TK", x_TK, 2)
    _check_tensor(op, "w_ENK", w_ENK, 3)
    if x_TK.shape[1] != w_ENK.shape[2]:
        raise ValueError(f"{op}: x_TK {tuple(x_TK.shape)} and w_ENK {tuple(w_ENK.shape)} disagree on K")
    named = {"x_TK": x_TK, "w_ENK": w_ENK}
    if bias_EN is not None:
        _check_tensor(op, "bias_EN", bias_EN, 2)
        if tuple(bias_EN.shape) != tuple(w_ENK.shape[:2]):
            raise ValueError(f"{op}: bias_EN must be [E, N] = {tuple(w_ENK.shape[:2])}, got "
                             f"{tuple(bias_EN.shape)}")
        named["bias_EN"] = bias_EN
    _check_operands(op, named, offs_E, w_ENK.shape[0])


def _check_dgrad(dy_TN, w_ENK, offs_E) -> None:
    op = "grouped_dgrad"
    _check_tensor(op, "dy_TN", dy_TN, 2)
    _check_tensor(op, "w_ENK", w_ENK, 3)
    if dy_TN.shape[1] != w_ENK.shape[1]:
        raise ValueError(f"{op}: dy_TN {tuple(dy_TN.shape)} and w_ENK {tuple(w_ENK.shape)} disagree on N")
    _check_operands(op, {"dy_TN": dy_TN, "w_ENK": w_ENK}, offs_E, w_ENK.shape[0])


def _data_ptr(t: torch.Tensor) -> int | None:
    """The address, or None while tracing (fake, functional and meta tensors have none to compare;
    the eager implementation repeats the check on real tensors)."""
    if torch.compiler.is_compiling() or is_fake(t) or t.device.type == "meta":
        return None
    try:
        return t.data_ptr() or None
    except (RuntimeError, NotImplementedError):
        return None


def _check_wgrad(dy_TN, x_TK, offs_E, out, out_dtype=None, first=None) -> None:
    op = "grouped_wgrad"
    _check_tensor(op, "dy_TN", dy_TN, 2)
    _check_tensor(op, "x_TK", x_TK, 2)
    if dy_TN.shape[0] != x_TK.shape[0]:
        raise ValueError(f"{op}: dy_TN {tuple(dy_TN.shape)} and x_TK {tuple(x_TK.shape)} disagree on T")
    _check_tensor(op, "offs_E", offs_E, 1)
    E, N, K = offs_E.shape[0], dy_TN.shape[1], x_TK.shape[1]
    _check_operands(op, {"dy_TN": dy_TN, "x_TK": x_TK}, offs_E, E)
    if out_dtype is not None:
        if out is not None:
            raise ValueError(f"{op}: out_dtype={out_dtype} is a fresh output's dtype; pass out (added into) or "
                             f"out_dtype, not both")
        if out_dtype not in (dy_TN.dtype, torch.float32):
            raise ValueError(f"{op}: out_dtype must be dy's dtype ({dy_TN.dtype}) or torch.float32, got "
                             f"{out_dtype!r}")
    if out is None:
        if first is not None:
            raise ValueError(f"{op}: first= flags an output to write or add into; a fresh output (out=None) "
                             f"takes none")
        return
    _check_wgrad_out(op, out, E, N, K, dy_TN.device, "dy_TN")
    _check_first(op, first, dy_TN.device)


def _check_first(op: str, first, device: torch.device) -> None:
    """``first`` of an accumulating wgrad: None, or one int32 on the output's device ([Note: an unwritten
    accumulator] in ``distwgrad/weights/first_write.py``)."""
    if first is None:
        return
    if not isinstance(first, torch.Tensor) or first.dtype != torch.int32 or first.numel() != 1:
        got = (f"{first.dtype} of shape {tuple(first.shape)}" if isinstance(first, torch.Tensor)
               else type(first).__name__)
        raise TypeError(f"{op}: first must be an int32 tensor of one element (the flag), got {got}")
    if first.device != device:
        raise ValueError(f"{op}: first is on {first.device} but the output is on {device}")


def _check_wgrad_out(op: str, out, E: int, N: int, K: int, device: torch.device, ref_name: str) -> None:
    """``out`` of an accumulating wgrad: an fp32 ``[E, N, K]`` tensor whose groups do not overlap, or a
    list of E distinct fp32 ``[N, K]`` buffers with equal strides, all on ``device``."""
    if isinstance(out, torch.Tensor):
        outs, want = [("out", out)], (E, N, K)
        if tuple(out.shape) != want:
            raise ValueError(f"{op}: out must be [E, N, K] = {want}, got {tuple(out.shape)}")
        if E > 1 and _data_ptr(out) is not None and torch._debug_has_internal_overlap(out) == 1:
            raise ValueError(f"{op}: out's groups overlap in memory (strides {out.stride()})")
    elif isinstance(out, (list, tuple)):
        if len(out) != E:
            raise ValueError(f"{op}: out has {len(out)} buffers, expected one per group ({E})")
        outs, want = [(f"out[{i}]", t) for i, t in enumerate(out)], (N, K)
        for name, t in outs:
            _check_tensor(op, name, t, 2)
            if tuple(t.shape) != want or t.stride() != out[0].stride():
                raise ValueError(f"{op}: {name} has shape {tuple(t.shape)} and strides {t.stride()}; "
                                 f"every buffer must be [N, K] = {want} with out[0]'s strides "
                                 f"{out[0].stride()}")
        ptrs = [_data_ptr(t) for t in out]
        if None not in ptrs and len(set(ptrs)) != len(ptrs):
            raise ValueError(f"{op}: two buffers of out share memory; accumulating both in one pass would "
                             f"race (tied experts need separate calls)")
    else:
        raise TypeError(f"{op}: out must be None, an fp32 [E, N, K] tensor or a list of E fp32 [N, K] "
                        f"tensors, got {type(out).__name__}")
    for name, t in outs:
        if t.dtype != torch.float32:
            raise TypeError(f"{op}: {name} must be float32 (gradients accumulate in fp32), got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but {ref_name} is on {device}")
