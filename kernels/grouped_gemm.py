"""Triton grouped GEMMs for MoE: the three products over ragged token groups, in one launch each.

Legend: E experts (groups), T tokens, K in-features, N out-features. ``offs_E`` holds int32 END offsets
on the tokens' device (as ``torch._grouped_mm`` takes them): group ``e`` owns tokens
``[offs_E[e-1], offs_E[e])``, with ``offs_E[-1]`` read as 0.

    fprop   y_TN[g]   = x_TK[g] @ w_ENK[e]^T (+ bias_EN[e])     grouped_fprop(x_TK, w_ENK, offs_E, bias_EN)
    dgrad   dx_TK[g]  = dy_TN[g] @ w_ENK[e]                     grouped_dgrad(dy_TN, w_ENK, offs_E)
    wgrad   dW_ENK[e] = dy_TN[g]^T @ x_TK[g]  (sum over g)      grouped_wgrad(dy_TN, x_TK, offs_E, out=None)

Dtypes: bf16, fp16 or fp32 operands (all the same), fp32 accumulation, outputs in the operand dtype,
except ``grouped_wgrad(..., out=...)`` which ADDS into fp32 buffers in the same pass: ``out`` is a
stacked ``[E, N, K]`` tensor or a list of E ``[N, K]`` tensors (discrete per-expert ``main_grad``;
their addresses go to the kernel as an int64 pointer table, so no full-size temporary exists). fp32
operands use IEEE fp32 products unless ``torch.backends.cuda.matmul.allow_tf32`` is set (as torch.mm).

No host sync: the offsets are read on the device only, so the ops can be captured in a CUDA graph
(after a warm-up call: Triton compiles, and a list ``out`` builds its pointer table, on first use).
Offsets are clamped into ``[0, T]`` in the kernel, so bad offsets give wrong groups, never stray
memory accesses. Rows at or past ``offs_E[-1]`` of fprop/dgrad outputs are left unwritten (as in
the reference and ``torch._grouped_mm``); an empty group writes nothing there, zeros in a fresh wgrad
and adds nothing in an accumulating one.

Scheduling: one program per output tile, tiles ordered group-major, ``group_m`` tiles along M share a
column of B for L2 reuse. For fprop/dgrad the number of M tiles per group lives on the device: the grid
covers the bound ``cdiv(T, BLOCK_M) + E`` M tiles and every program finds its group with a prefix sum
over the offsets (at most 256 lanes); spare programs exit at once; a group's last M tile of half the rows
or fewer runs at half height ([Note: half tail tiles]); these kernels live in ``_grouped_ragged``. wgrad
tiles the fixed [N, K] output of every group and walks that group's tokens as its reduction; its kernel
lives in ``_grouped_wgrad``.

Loads: Hopper TMA tensor descriptors when layouts allow (16-byte aligned base and row strides, unit
inner stride; for dgrad also N a multiple of BLOCK_K, so a reduction step never crosses into the next
expert's weight), else masked pointer loads (any strides). The results are the same. wgrad's last,
partial token block always takes the masked path, because a descriptor cannot stop at a group's end.
``TRITON_INTERPRET=1`` runs everything on CPU tensors; there bf16 operands are upcast to fp32 first
(the interpreter's bf16 ``tl.dot`` multiplies bit patterns).
"""

import functools
import os
import warnings
from collections.abc import Sequence

import torch
import triton
from triton.compiler.errors import CompilationError
from triton.tools.tensor_descriptor import TensorDescriptor

from . import _grouped_gemm_configs as _cfg
from ._context import ensure_context
from ._dispatch import call
from ._grouped_gemm_checks import _check_dgrad, _check_fprop, _check_wgrad
from ._grouped_ragged import _ragged_m_kernel
from ._grouped_wgrad import _wgrad_kernel
from ._host import cdiv, device_table, next_pow2
from ._tuning import current as _tuning

__all__ = ["grouped_fprop", "grouped_dgrad", "grouped_wgrad"]

_ADD_MODES = {"load": 1, "atomic": 3, "tma_add": 4}  # TileConfig.add_mode -> ADD_MODE
_GLUON_FAILED: dict[str, str] = {}  # "wgrad16" -> why the Gluon wgrad did not build here (then Triton runs)

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
    """Streaming multiprocessors of a CUDA device: the persistent Gluon kernels launch a multiple of it.
    Elsewhere 4 (those kernels run on CUDA only)."""
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
    """Records why a Gluon kernel did not build here (``failed[key]``, the launcher module's
    ``_GLUON_FAILED``: later calls skip it) and warns once; returns False, for the launcher to return (its
    caller then runs ``fallback``)."""
    failed[key] = f"{type(exc).__name__}: {exc}"[:2000]
    warnings.warn(f"the Gluon {kernel} does not build with triton {triton.__version__}; using {fallback}: "
                  f"{failed[key][:400]}", RuntimeWarning, stacklevel=5)
    return False


def _ran_gluon(gluon: bool | None, what: str, applies: bool, needs, launch) -> bool:
    """The dispatchers' ``gluon=`` contract once the Gluon kernel is wanted: ``launch()`` where it
    ``applies``; whether it ran (else the Triton kernel runs). With ``gluon=True`` a ValueError naming what it
    ``needs()`` where it does not apply, a RuntimeError where it does not build."""
    if gluon and not applies:
        raise ValueError(f"{what}: gluon=True, but the Gluon kernel needs {needs()}")
    if applies and launch():
        return True
    if gluon:
        raise RuntimeError(f"{what}: gluon=True, but the Gluon kernel does not build here: {_GLUON_FAILED}")
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
    _ragged_m_kernel[grid](
        a_desc, a_half_desc, w_desc, a, w_ENK, out, bias_EN, offs_E,
        T, E, N, K, w_rows,
        a.stride(0), a.stride(1), sw[0], stride_bk, stride_bn,
        out.stride(0), out.stride(1), bias_strides[0], bias_strides[1], offs_E.stride(0),
        W_TRANS=w_trans, HAS_BIAS=bias_EN is not None, USE_TMA=tma, UPCAST=upcast, PRECISION=precision,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
        BLOCK_E=max(16, next_pow2(E)), HALF_TAIL=half_tail, WIDE_TAIL=wide_tail,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def _gluon_wgrad(dy_TN: torch.Tensor, x_TK: torch.Tensor, out: torch.Tensor, accumulate: bool = True) -> bool:
    """Whether the Gluon wgrad can take this bf16 / fp16 wgrad: a Hopper GPU, a Triton with Gluon, dy and x
    of one 16-bit dtype, TMA-aligned (16-byte aligned base and row stride, unit inner stride), tokens, and
    an fp32 output, added into or fresh (a fresh output in dy's dtype runs the Triton kernel)."""
    if not dy_TN.is_cuda or _interpreting() or dy_TN.dtype not in (torch.bfloat16, torch.float16):
        return False
    from .gluon import grouped_wgrad_fp8 as kw
    out_ok = out.dtype == torch.float32
    return (kw.AVAILABLE and x_TK.dtype == dy_TN.dtype and dy_TN.shape[0] > 0 and out_ok
            and _tma_2d_ok(dy_TN, dy_TN.stride(0), dy_TN.stride(1)) and _tma_2d_ok(x_TK, x_TK.stride(0), x_TK.stride(1))
            and torch.cuda.get_device_capability(dy_TN.device)[0] == 9)


def _gluon_wgrad_by_default(T: int, E: int, accumulate: bool, config, use_tma) -> bool:
    """Whether the default dispatch tries the Gluon wgrad: the tuning wants it for this problem
    (``GroupedGemmTuning.wgrad_gluon_wanted``: an accumulating call, groups of ``wgrad_gluon_min_tokens``
    tokens or more on average) and neither a config nor ``use_tma=False`` asked for a Triton kernel
    (``_gluon_wgrad`` then checks that it applies)."""
    return config is None and use_tma is not False and _tuning().grouped_gemm.wgrad_gluon_wanted(T, E, accumulate)


def _launch_gluon_wgrad(dy_TN, x_TK, offs_E, out, table, accumulate: bool, first=None) -> bool:
    """Launches the Gluon wgrad (adding into ``out`` iff ``accumulate``); False (and one warning) if this
    Triton cannot build it: the caller then runs the Triton kernel."""
    from .gluon import grouped_wgrad_fp8_launch as kl
    if "wgrad16" in _GLUON_FAILED:
        return False
    t = _tuning().grouped_gemm
    add_mode = _ADD_MODES[t.wgrad_gluon_add_mode] if accumulate else 0
    try:
        kl.launch_tokens_outer(dy_TN, x_TK, offs_E, out, table, add_mode=add_mode,
                               stages=t.wgrad_gluon_stages, epilogue_warps=t.wgrad_gluon_epilogue_warps,
                               num_sms=_num_sms(dy_TN.device), tail=t.wgrad_gluon_tail, first=first)
    except CompilationError as exc:
        return _gluon_failed(_GLUON_FAILED, "wgrad16", "wgrad kernel", "the Triton kernel", exc)
    return True


def _launch_wgrad(dy_TN, x_TK, offs_E, out, *, accumulate: bool, table, config, use_tma,
                  gluon: bool | None = None, first=None):
    """dW_e for every group into ``out`` ([E, N, K]) or, with ``table``, into the per-group buffers it
    points to (``out`` is then entry 0, read for its strides); adds to them iff ``accumulate`` (and, with the
    int32 flag ``first`` set, writes them: [Note: an unwritten accumulator]). ``gluon``: None picks (the Gluon
    kernel where ``_gluon_wgrad_by_default`` and it applies), True requires it, False runs a Triton kernel."""
    ensure_context(dy_TN.device)  # [Note: a current context on any thread]
    T, N = dy_TN.shape
    K = x_TK.shape[1]
    E = offs_E.shape[0]
    if E == 0 or N == 0 or K == 0:
        return
    if gluon if gluon is not None else _gluon_wgrad_by_default(T, E, accumulate, config, use_tma):
        needs = lambda: (f"a Hopper GPU, a Triton with Gluon, bf16 or fp16 TMA-aligned dy and x of one dtype and "  # noqa: E731
                         f"an fp32 output; got {dy_TN.dtype} and {x_TK.dtype} on {dy_TN.device}, strides "
                         f"{tuple(dy_TN.stride())} and {tuple(x_TK.stride())}, output {out.dtype}, "
                         f"accumulate={accumulate}")
        if _ran_gluon(gluon, "grouped_wgrad", _gluon_wgrad(dy_TN, x_TK, out, accumulate), needs,
                      lambda: _launch_gluon_wgrad(dy_TN, x_TK, offs_E, out, table, accumulate, first)):
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
    _wgrad_kernel[(num_tiles,)](*args, *strides, **meta)


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
    """``y_TN[g] = x_TK[g] @ w_ENK[e]^T (+ bias_EN[e])`` for the tokens g of every group e.

    Args:
        x_TK: ``[T, K]`` tokens, sorted by group; bf16, fp16 or fp32.
        w_ENK: ``[E, N, K]`` stacked weights, same dtype and device.
        offs_E: ``[E]`` int32 end offsets on the same device (never read on the host).
        bias_EN: optional ``[E, N]`` bias, same dtype.

    Returns:
        ``[T, N]`` in x's dtype (rows at or past ``offs_E[-1]`` unwritten).
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
    """``dW_e = dy_TN[g]^T @ x_TK[g]`` summed over the tokens g of each group e.

    Args:
        dy_TN: ``[T, N]`` output gradients; x_TK: ``[T, K]`` inputs (same dtype, device, token order).
        offs_E: ``[E]`` int32 end offsets on the same device.
        out: None for a fresh ``[E, N, K]`` tensor (an empty group gives zeros); or fp32 buffers to ADD
            into in the same pass (``main_grad``): a stacked ``[E, N, K]`` tensor, or a list of E ``[N, K]``
            tensors sharing shape and strides (an empty group adds nothing).
        out_dtype: a fresh tensor's dtype, dy's (the default) or float32 (the fp32 accumulator as it is,
            never rounded: what adding into zeros would hold); only without ``out``.
        first: only with ``out``: an int32 ``[1]`` flag on the device; while it is not 0, ``out`` holds
            nothing yet and is written instead of added into, every group (an empty one as zeros). The
            caller clears it afterwards ([Note: an unwritten accumulator] in ``distwgrad/weights/first_write.py``).

    Returns:
        The fresh tensor, or ``out`` itself.
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
