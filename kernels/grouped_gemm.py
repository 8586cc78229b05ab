"""Triton grouped GEMMs for MoE: the three products over ragged token groups, in one launch each.

Legend: E experts (groups), T tokens, K in-features, N out-features. ``offs_E``: int32 END offsets on the
tokens' device (as ``torch._grouped_mm`` takes them): group ``e`` owns tokens ``[offs_E[e-1], offs_E[e])``.

    fprop   y_TN[g]   = x_TK[g] @ w_ENK[e]^T (+ bias_EN[e])
    dgrad   dx_TK[g]  = dy_TN[g] @ w_ENK[e]
    wgrad   dW_ENK[e] = dy_TN[g]^T @ x_TK[g]  (sum over g)

bf16, fp16 or fp32 operands (fp32 follows torch's TF32 switch), fp32 accumulation. No host sync: offsets are
read on the device only (CUDA-graph capturable after a warm-up call) and clamped into ``[0, T]``, so bad
offsets give wrong groups, never stray accesses. fprop/dgrad (``_grouped_ragged``) launch the bound
``cdiv(T, BLOCK_M) + E`` M tiles, each finding its group on the device ([Note: half tail tiles]); wgrad
(``_grouped_wgrad``) tiles each group's [N, K] output. Under ``TRITON_INTERPRET=1`` bf16 is upcast to fp32
(the interpreter's bf16 ``tl.dot`` multiplies bit patterns).
"""

import functools
import os
import warnings
from collections.abc import Sequence

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from . import _grouped_gemm_configs as _cfg
from ._context import ensure_context
from ._dispatch import call
from ._grouped_gemm_checks import _check_dgrad, _check_fprop, _check_wgrad
from ._grouped_ragged import _ragged_m_kernel
from ._grouped_wgrad import _wgrad_kernel
from ._host import cdiv, device_table, next_pow2
from ._launch import launch
from ._tuning import current as _tuning

__all__ = ["grouped_fprop", "grouped_dgrad", "grouped_wgrad"]

_ADD_MODES = {"load": 1, "atomic": 3, "tma_add": 4}  # TileConfig.add_mode -> ADD_MODE

# ---------------------------------------------------------------------------------------------------
# Launchers: check, allocate, grid, launch
# ---------------------------------------------------------------------------------------------------


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _device_info(device: torch.device) -> tuple[int, int | None]:
    """(compute capability major, shared memory per block) of a CUDA device; (0, None) elsewhere."""
    if device.type != "cuda":
        return 0, None
    props = torch.cuda.get_device_properties(device)
    return props.major, getattr(props, "shared_memory_per_block_optin", None)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """SMs of a CUDA device (the persistent Gluon kernels launch a multiple of it); 4 elsewhere."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _dot_flags(dtype: torch.dtype, device: torch.device) -> tuple[bool, str | None]:
    """(UPCAST, PRECISION): bf16 is upcast only in the interpreter; fp32 follows torch's TF32 switch."""
    if _interpreting():
        return dtype == torch.bfloat16, "ieee" if dtype in (torch.bfloat16, torch.float32) else None
    if dtype == torch.float32:
        return False, "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    return False, None


def _tma_2d_ok(t: torch.Tensor, row_stride: int, inner_stride: int) -> bool:
    b = t.element_size()
    return t.data_ptr() % 16 == 0 and inner_stride == 1 and (row_stride * b) % 16 == 0


def _resolve_tma(requested: bool | None, eligible: bool, device: torch.device, what: str) -> bool:
    """None: TMA iff the device is Hopper or newer and the layouts allow. True: required (tests)."""
    if requested is None:
        return eligible and not _interpreting() and _device_info(device)[0] >= 9
    if requested and not eligible:
        raise ValueError(f"{what}: TMA was requested but the layouts do not allow it (16-byte aligned "
                         f"base and outer strides, unit inner stride; bf16 dgrad: N a multiple of BLOCK_K)")
    return requested


def _elem_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _gluon_failed(failed: dict[str, str], key: str, kernel: str, fallback: str, exc: Exception) -> bool:
    """Records in ``failed[key]`` why a Gluon kernel did not build (later calls skip it), warns once; False."""
    failed[key] = f"{type(exc).__name__}: {exc}"[:2000]
    warnings.warn(f"the Gluon {kernel} does not build with triton {triton.__version__}; using {fallback}: "
                  f"{failed[key][:400]}", RuntimeWarning, stacklevel=5)
    return False


def _launch_ragged(a, w_ENK, offs_E, bias_EN, out, *, w_trans: bool, config, use_tma):
    """out[g] = a[g] @ (w_e^T if w_trans else w_e) for every group; a is [T, K], out is [T, N]."""
    ensure_context(a.device)  # [Note: a current context on any thread]
    T, K = a.shape
    E, w_rows, w_cols = w_ENK.shape
    N = out.shape[1]
    if T == 0 or N == 0 or E == 0:
        return out
    what = "grouped_fprop" if w_trans else "grouped_dgrad"
    if config is None:
        config = (_cfg.INTERPRETER if _interpreting() else
                  _cfg.pick_ragged(num_tokens=T, num_groups=E, n=N, k=K, elem_bytes=a.element_size(),
                                   smem_limit=_device_info(a.device)[1], tuning=_tuning().grouped_gemm))
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    sw = w_ENK.stride()
    eligible = (K > 0 and _tma_2d_ok(a, a.stride(0), a.stride(1)) and _tma_2d_ok(w_ENK, sw[1], sw[2])
                and (E == 1 or sw[0] == w_rows * sw[1]) and (w_trans or w_rows % bk == 0))
    tma = _resolve_tma(use_tma if use_tma is not None or config.tma else False, eligible, a.device, what)
    half_tail, wide_tail = config.half_tail, config.wide_tail
    a_desc = a_half_desc = w_desc = None
    if tma:
        a_desc = TensorDescriptor(a, [T, K], [a.stride(0), 1], [bm, bk])
        if half_tail or wide_tail:
            a_half_desc = TensorDescriptor(a, [T, K], [a.stride(0), 1], [bm // 2, bk])
        w_desc = TensorDescriptor(w_ENK, [E * w_rows, w_cols], [sw[1], 1], [bn, bk] if w_trans else [bk, bn])
    stride_bk, stride_bn = (sw[2], sw[1]) if w_trans else (sw[1], sw[2])
    bias_strides = bias_EN.stride() if bias_EN is not None else (0, 0)
    upcast, precision = _dot_flags(a.dtype, a.device)
    grid = ((cdiv(T, bm) + E) * cdiv(N, bn),)
    launch(
        _ragged_m_kernel, grid, a_desc, a_half_desc, w_desc, a, w_ENK, out, bias_EN, offs_E,
        T, E, N, K, w_rows,
        a.stride(0), a.stride(1), sw[0], stride_bk, stride_bn,
        out.stride(0), out.stride(1), bias_strides[0], bias_strides[1], offs_E.stride(0),
        W_TRANS=w_trans, HAS_BIAS=bias_EN is not None, USE_TMA=tma, UPCAST=upcast, PRECISION=precision,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
        BLOCK_E=max(16, next_pow2(E)), HALF_TAIL=half_tail, WIDE_TAIL=wide_tail,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def _launch_wgrad(dy_TN, x_TK, offs_E, out, *, accumulate: bool, table, config, use_tma, first=None):
    """dW_e into ``out`` ([E, N, K]) or, with ``table``, the buffers it points to (``out`` is then entry 0, for
    its strides); adds iff ``accumulate`` (``first``: [Note: an unwritten accumulator])."""
    ensure_context(dy_TN.device)  # [Note: a current context on any thread]
    T, N = dy_TN.shape
    K = x_TK.shape[1]
    E = offs_E.shape[0]
    if E == 0 or N == 0 or K == 0:
        return
    if config is None:
        config = (_cfg.INTERPRETER if _interpreting() else
                  _cfg.pick_wgrad(num_tokens=T, num_groups=E, n=N, k=K, elem_bytes=dy_TN.element_size(),
                                  smem_limit=_device_info(dy_TN.device)[1], accumulate=accumulate))
    if config.half_tail or config.wide_tail:
        raise ValueError(f"grouped_wgrad: half_tail and wide_tail are for fprop/dgrad (ragged M) only, got "
                         f"{config.short()}")
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    eligible = (T > 0 and _tma_2d_ok(dy_TN, dy_TN.stride(0), dy_TN.stride(1))
                and _tma_2d_ok(x_TK, x_TK.stride(0), x_TK.stride(1)))
    tma = _resolve_tma(use_tma if use_tma is not None or config.tma else False, eligible, dy_TN.device,
                       "grouped_wgrad")
    dy_desc = x_desc = None
    if tma:
        dy_desc = TensorDescriptor(dy_TN, [T, N], [dy_TN.stride(0), 1], [bk, bm])
        x_desc = TensorDescriptor(x_TK, [T, K], [x_TK.stride(0), 1], [bk, bn])
    so = (0,) + out.stride() if table is not None else out.stride()
    add_mode = _ADD_MODES[config.add_mode] if accumulate else 0
    out_desc = None
    if add_mode == 4:  # bulk tensor reduction: Hopper, stacked out with TMA-able strides; else mode 3
        if table is None and tma and not _interpreting() and _tma_2d_ok(out, so[1], so[2]) and so[0] % 4 == 0:
            out_desc = TensorDescriptor(out, [E, N, K], list(so), [1, bm, bn])
        else:
            add_mode = 3
    upcast, precision = _dot_flags(dy_TN.dtype, dy_TN.device)
    args = (dy_desc, x_desc, out_desc, dy_TN, x_TK, out if table is None else table, offs_E,
            offs_E if first is None else first, T, N, K)
    strides = (dy_TN.stride(0), dy_TN.stride(1), x_TK.stride(0), x_TK.stride(1),
               so[0], so[1], so[2], offs_E.stride(0))
    meta = dict(ADD_MODE=add_mode, PTR_TABLE=table is not None, USE_TMA=tma, UPCAST=upcast,
                PRECISION=precision, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
                L2_PREFETCH=config.l2_prefetch and add_mode != 0 and not _interpreting(),
                FIRST=first is not None and add_mode != 0, num_warps=config.num_warps, num_stages=config.num_stages)
    num_tiles = E * cdiv(N, bm) * cdiv(K, bn)
    launch(_wgrad_kernel, (num_tiles,), *args, *strides, **meta)


def _check_runnable(op: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not _interpreting():
        raise ValueError(f"{op}: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got "
                         f"{t.device}; distwgrad.ops.grouped_gemm runs the torch reference elsewhere")


def _ptr_table(outs: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The addresses of a list of per-group outputs on ``device`` ([Note: device tables] in ``_host.py``)."""
    return device_table(tuple(t.data_ptr() for t in outs), device, "grouped_wgrad (a list of out buffers)")


# ---- the three products (config and use_tma are for tests and benchmarks) --------------------------


def _fprop(x_TK, w_ENK, offs_E, bias_EN=None, *, config=None, use_tma=None) -> torch.Tensor:
    _check_fprop(x_TK, w_ENK, offs_E, bias_EN)
    _check_runnable("grouped_fprop", x_TK)
    y_TN = x_TK.new_empty(x_TK.shape[0], w_ENK.shape[1])
    return _launch_ragged(x_TK, w_ENK, offs_E, bias_EN, y_TN, w_trans=True, config=config, use_tma=use_tma)


def _dgrad(dy_TN, w_ENK, offs_E, *, config=None, use_tma=None) -> torch.Tensor:
    _check_dgrad(dy_TN, w_ENK, offs_E)
    _check_runnable("grouped_dgrad", dy_TN)
    dx_TK = dy_TN.new_empty(dy_TN.shape[0], w_ENK.shape[2])
    return _launch_ragged(dy_TN, w_ENK, offs_E, None, dx_TK, w_trans=False, config=config, use_tma=use_tma)


def _wgrad(dy_TN, x_TK, offs_E, out=None, *, out_dtype=None, config=None, use_tma=None, first=None):
    _check_wgrad(dy_TN, x_TK, offs_E, out, out_dtype, first)
    _check_runnable("grouped_wgrad", dy_TN)
    kw = dict(config=config, use_tma=use_tma, first=first)
    if out is None:  # every tile is written, an empty group's as zeros
        dW_ENK = dy_TN.new_empty(offs_E.shape[0], dy_TN.shape[1], x_TK.shape[1], dtype=out_dtype or dy_TN.dtype)
        _launch_wgrad(dy_TN, x_TK, offs_E, dW_ENK, accumulate=False, table=None, config=config, use_tma=use_tma)
        return dW_ENK
    if isinstance(out, torch.Tensor):
        _launch_wgrad(dy_TN, x_TK, offs_E, out, accumulate=True, table=None, **kw)
    elif len(out) > 0:
        table = _ptr_table(out, dy_TN.device)
        _launch_wgrad(dy_TN, x_TK, offs_E, out[0], accumulate=True, table=table, **kw)
    return out


# ---------------------------------------------------------------------------------------------------
# torch.library custom ops (+ fake implementations, so torch.compile traces them) and the public API
# ---------------------------------------------------------------------------------------------------


def _fprop_impl(x_TK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor,
                bias_EN: torch.Tensor | None) -> torch.Tensor:
    return _fprop(x_TK, w_ENK, offs_E, bias_EN)


_fprop_op = torch.library.custom_op("distwgrad::grouped_fprop", _fprop_impl, mutates_args=())


@_fprop_op.register_fake
def _(x_TK, w_ENK, offs_E, bias_EN):
    _check_fprop(x_TK, w_ENK, offs_E, bias_EN)
    return x_TK.new_empty(x_TK.shape[0], w_ENK.shape[1])


def _dgrad_impl(dy_TN: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    return _dgrad(dy_TN, w_ENK, offs_E)


_dgrad_op = torch.library.custom_op("distwgrad::grouped_dgrad", _dgrad_impl, mutates_args=())


@_dgrad_op.register_fake
def _(dy_TN, w_ENK, offs_E):
    _check_dgrad(dy_TN, w_ENK, offs_E)
    return dy_TN.new_empty(dy_TN.shape[0], w_ENK.shape[2])


def _wgrad_impl(dy_TN: torch.Tensor, x_TK: torch.Tensor, offs_E: torch.Tensor,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return _wgrad(dy_TN, x_TK, offs_E, out_dtype=out_dtype)


_wgrad_op = torch.library.custom_op("distwgrad::grouped_wgrad", _wgrad_impl, mutates_args=())


@_wgrad_op.register_fake
def _(dy_TN, x_TK, offs_E, out_dtype=None):
    _check_wgrad(dy_TN, x_TK, offs_E, None, out_dtype)
    return dy_TN.new_empty(offs_E.shape[0], dy_TN.shape[1], x_TK.shape[1], dtype=out_dtype or dy_TN.dtype)


def _wgrad_acc_impl(dy_TN: torch.Tensor, x_TK: torch.Tensor, offs_E: torch.Tensor, out: torch.Tensor,
                    first: torch.Tensor | None = None) -> None:
    _wgrad(dy_TN, x_TK, offs_E, out, first=first)


_wgrad_acc_op = torch.library.custom_op("distwgrad::grouped_wgrad_accumulate", _wgrad_acc_impl, mutates_args=("out",))


@_wgrad_acc_op.register_fake
def _(dy_TN, x_TK, offs_E, out, first=None):
    _check_wgrad(dy_TN, x_TK, offs_E, out, None, first)


def _wgrad_acc_list_impl(dy_TN: torch.Tensor, x_TK: torch.Tensor, offs_E: torch.Tensor,
                         out: list[torch.Tensor], first: torch.Tensor | None = None) -> None:
    _wgrad(dy_TN, x_TK, offs_E, out, first=first)


_wgrad_acc_list_op = torch.library.custom_op(
    "distwgrad::grouped_wgrad_accumulate_list", _wgrad_acc_list_impl, mutates_args=("out",))


@_wgrad_acc_list_op.register_fake
def _(dy_TN, x_TK, offs_E, out, first=None):
    _check_wgrad(dy_TN, x_TK, offs_E, out, None, first)


def grouped_fprop(x_TK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor,
                  bias_EN: torch.Tensor | None = None) -> torch.Tensor:
    """``y_TN[g] = x_TK[g] @ w_ENK[e]^T (+ bias_EN[e])`` for the tokens g of each group e: ``[T, N]`` in x's dtype.

    Args:
        x_TK: ``[T, K]`` tokens sorted by group; bf16, fp16 or fp32.
        w_ENK, bias_EN: ``[E, N, K]`` stacked weights, optional ``[E, N]`` bias; same dtype and device.
        offs_E: ``[E]`` int32 end offsets on the device; output rows at or past ``offs_E[-1]`` stay unwritten.
    """
    _check_fprop(x_TK, w_ENK, offs_E, bias_EN)
    return call(torch.ops.distwgrad.grouped_fprop, _fprop_impl, x_TK, w_ENK, offs_E, bias_EN)


def grouped_dgrad(dy_TN: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """``dx_TK[g] = dy_TN[g] @ w_ENK[e]`` for every group; arguments as in :func:`grouped_fprop`."""
    _check_dgrad(dy_TN, w_ENK, offs_E)
    return call(torch.ops.distwgrad.grouped_dgrad, _dgrad_impl, dy_TN, w_ENK, offs_E)


def grouped_wgrad(dy_TN: torch.Tensor, x_TK: torch.Tensor, offs_E: torch.Tensor,
                  out: torch.Tensor | Sequence[torch.Tensor] | None = None, *, out_dtype: torch.dtype | None = None,
                  first: torch.Tensor | None = None):
    """``dW_e = dy_TN[g]^T @ x_TK[g]`` summed over the tokens g of each group e: a fresh tensor, or ``out``.

    Args:
        dy_TN, x_TK: ``[T, N]`` output gradients and ``[T, K]`` inputs (same dtype, device, token order).
        offs_E: ``[E]`` int32 end offsets on the same device.
        out: None for a fresh ``[E, N, K]`` (zeros for an empty group); or fp32 buffers to ADD into in the same
            pass: a stacked ``[E, N, K]`` or a list of E ``[N, K]`` sharing shape and strides.
        out_dtype: a fresh tensor's dtype: dy's (default) or float32 (the accumulator unrounded); not with ``out``.
        first: only with ``out``: an int32 ``[1]`` device flag; while not 0, ``out`` is written instead of added
            into ([Note: an unwritten accumulator] in ``distwgrad/weights/first_write.py``).
    """
    _check_wgrad(dy_TN, x_TK, offs_E, out, out_dtype, first)
    if out is None:
        return call(torch.ops.distwgrad.grouped_wgrad, _wgrad_impl, dy_TN, x_TK, offs_E, out_dtype)
    if isinstance(out, torch.Tensor):
        call(torch.ops.distwgrad.grouped_wgrad_accumulate, _wgrad_acc_impl, dy_TN, x_TK, offs_E, out, first,
             mutated=(3,))
    else:
        call(torch.ops.distwgrad.grouped_wgrad_accumulate_list, _wgrad_acc_list_impl, dy_TN, x_TK, offs_E, list(out),
             first, mutated=(3,))
    return out
