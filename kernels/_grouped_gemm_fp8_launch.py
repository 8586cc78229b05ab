"""Launchers of the FP8 grouped GEMMs (math, Notes, public API: ``grouped_gemm_fp8.py``): check, allocate, pick
a config and grid, launch the Triton kernels or, where they apply, the Gluon ones; then the three raw products.

Legend: E experts, T tokens, K in-features, N out-features, L the scale block (``block``; 0: per-tensor).
fprop/dgrad ``out[g] = a[g] @ b_EKN[e]``; wgrad ``out[e] = a_NT[:, g] @ b_KT[:, g]^T``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from triton.compiler.errors import CompilationError
from triton.tools.tensor_descriptor import TensorDescriptor

from . import _grouped_gemm_fp8_configs as _cfg
from ._context import ensure_context
from ._grouped_gemm_fp8_checks import _check_ragged, _check_runnable, _check_split, _check_wgrad
from ._grouped_gemm_fp8_kernels import _fp8_ragged_kernel, _wgrad_fp8_kernel
from ._host import cdiv, next_pow2
from ._launch import launch
from ._tuning import current as _tuning
from .grouped_gemm import _device_info, _gluon_failed, _interpreting, _num_sms, _ptr_table, _resolve_tma

_ADD_MODES = {"load": 1, "atomic": 3}  # ADD_MODE values as in grouped_gemm's _wgrad_kernel
_GLUON_FAILED: dict[str, str] = {}  # "ragged", "wgrad" -> why that Gluon kernel did not build here


def _aligned(t: torch.Tensor, outer_strides: Sequence[int], inner_stride: int) -> bool:
    """TMA-able 1-byte layout: 16-byte aligned base and outer strides, unit inner stride."""
    return t.data_ptr() % 16 == 0 and inner_stride == 1 and all(s % 16 == 0 for s in outer_strides)


def _config(op: str, config, block: int, accumulate: bool, device: torch.device, tokens_per_group: float = 0.0,
            split_acc: bool = True):
    """``config``, else the table's pick for ``op`` ("grouped_fprop_fp8", ...)."""
    if config is None:
        config = _cfg.INTERPRETER if _interpreting() else _cfg.pick(
            op.removeprefix("grouped_").removesuffix("_fp8"), block=block, accumulate=accumulate,
            smem_limit=_device_info(device)[1], tokens_per_group=tokens_per_group, split_accumulator=split_acc)
    config = _cfg.with_block_k(config, block)
    if config.block_k < 32 or config.add_mode not in _cfg.ADD_MODES or config.half_tail or config.wide_tail:
        raise ValueError(f"{op}: fp8 configs need block_k >= 32, add_mode in {_cfg.ADD_MODES} and no half_tail "
                         f"or wide_tail (bf16 fprop/dgrad only), got {config.short()}")
    return config


def _gluon_ragged(a: torch.Tensor, b_EKN: torch.Tensor, block: int, split_acc: bool, tma_k_inner: bool) -> bool:
    """Whether the Gluon fprop/dgrad kernel can run this ([Note: promotion under the next MMA]): sm_90 with Gluon,
    a promoting accumulation, TMA-aligned operands with K innermost, experts stacked as a 2-D ``[E * N, K]``."""
    if not (tma_k_inner and a.is_cuda) or _interpreting():
        return False
    from .gluon import grouped_gemm_fp8 as kg
    E, _, N = b_EKN.shape
    sb = b_EKN.stride()
    return (kg.AVAILABLE and (block == kg.BLOCK if block else split_acc) and (E <= 1 or sb[0] == N * sb[2])
            and torch.cuda.get_device_capability(a.device)[0] == 9)


def _launch_gluon_ragged(a, a_s, b_EKN, bs_EKN, offs_E, bias_EN, out, block, sas, sbs, sbias) -> bool:
    """Launches the Gluon kernel; False (warned once) if this Triton cannot build it: run the Triton one."""
    ensure_context(a.device)  # [Note: a current context on any thread]
    from .gluon import grouped_gemm_fp8 as kg
    T, K = a.shape
    E, _, N = b_EKN.shape
    t = _tuning().grouped_gemm_fp8
    L, bm = kg.BLOCK, t.ragged_gluon_block_m
    if "ragged" in _GLUON_FAILED:
        return False
    b2 = b_EKN.as_strided((E * N, K), (b_EKN.stride(2), 1))
    tiles = (cdiv(T, bm) + E) * cdiv(N, L)  # >= the tiles of any split (offsets stay on device)
    try:
        launch(kg.ragged_kernel, (min(tiles, _num_sms(a.device)),),
               kg.descriptor(a, (bm, L)), kg.descriptor(b2, (L, L)), a_s, bs_EKN, out, bias_EN, offs_E,
               T, E, N, K, N,
               sas[0], sas[1], sbs[0], sbs[1], sbs[2],
               out.stride(0), out.stride(1), sbias[0], sbias[1], offs_E.stride(0),
               BLOCKWISE=block > 0, HAS_BIAS=bias_EN is not None, GROUP_M=8,
               BLOCK_E=max(16, next_pow2(E)), NUM_STAGES=t.ragged_gluon_stages, num_warps=bm // 16)
    except CompilationError as exc:
        return _gluon_failed(_GLUON_FAILED, "ragged", "FP8 grouped GEMM kernel",
                             "the Triton kernel (same products, slower)", exc)
    return True


def _launch_ragged(a, a_s, b_EKN, bs_EKN, offs_E, bias_EN, out, *, block: int, op: str, config, use_tma,
                   split_acc: bool = True, gluon: bool | None = None):
    """out[g] = a[g] @ b_EKN[e] per group; a [T, K] fp8, b_EKN [E, K, N] any strides; blockwise scales a_s
    [T, cdiv(K, L)], bs_EKN [E, cdiv(K, L), cdiv(N, L)]. ``gluon``: None picks, True/False force Gluon/Triton."""
    ensure_context(a.device)  # [Note: a current context on any thread]
    T, K = a.shape
    E, _, N = b_EKN.shape
    if T == 0 or N == 0 or E == 0:
        return out
    cfg = _config(op, config, block, False, a.device, T / E, split_acc)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    sb = b_EKN.stride()
    b_k_inner = sb[1] == 1 and sb[2] != 1
    a_ok = K > 0 and _aligned(a, [a.stride(0)], a.stride(1))
    b_ok = _aligned(b_EKN, [sb[0], sb[2]], sb[1]) if b_k_inner else _aligned(b_EKN, [sb[0], sb[1]], sb[2])
    tma = _resolve_tma(use_tma, a_ok and b_ok, a.device, op)
    sas = a_s.stride() if block else (0, 0)
    sbs = bs_EKN.stride() if block else (bs_EKN.stride(0), 0, 0)
    sbias = bias_EN.stride() if bias_EN is not None else (0, 0)
    applies = _gluon_ragged(a, b_EKN, block, split_acc, tma and b_k_inner)
    if gluon and not applies:
        raise ValueError(f"{op}: gluon=True, but the Gluon kernel needs a Hopper GPU, a Triton with Gluon, TMA-aligned "
                         f"operands with the contraction innermost, stacked weights and a promoting accumulation; "
                         f"got block={block}, split_accumulator={split_acc}, tma={tma}, weight strides {tuple(sb)}")
    preferred = _tuning().grouped_gemm_fp8.ragged_gluon_wanted(K, block)
    if gluon or (gluon is None and applies and config is None and preferred):
        if _launch_gluon_ragged(a, a_s, b_EKN, bs_EKN, offs_E, bias_EN, out, block, sas, sbs, sbias):
            return out
        if gluon:
            raise RuntimeError(f"{op}: gluon=True, but the Gluon kernel does not build here: {_GLUON_FAILED}")
    a_desc = b_desc = None
    if tma:
        a_desc = TensorDescriptor(a, [T, K], [a.stride(0), 1], [bm, bk])
        if b_k_inner:
            b_desc = TensorDescriptor(b_EKN, [E, N, K], [sb[0], sb[2], 1], [1, bn, bk])
        else:
            b_desc = TensorDescriptor(b_EKN, [E, K, N], [sb[0], sb[1], 1], [1, bk, bn])
    grid = ((cdiv(T, bm) + E) * cdiv(N, bn),)
    launch(_fp8_ragged_kernel, grid,
           a_desc, b_desc, a, b_EKN, a_s, bs_EKN, out, bias_EN, offs_E,
           T, E, N, K,
           a.stride(0), a.stride(1), sb[0], sb[1], sb[2],
           sas[0], sas[1], sbs[0], sbs[1], sbs[2],
           out.stride(0), out.stride(1), sbias[0], sbias[1], offs_E.stride(0),
           BLOCKWISE=block > 0, B_K_INNER=b_k_inner, HAS_BIAS=bias_EN is not None, USE_TMA=tma,
           UPCAST=_interpreting(), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m,
           BLOCK_E=max(16, next_pow2(E)), SPLIT_ACC=split_acc, num_warps=cfg.num_warps,
           num_stages=cfg.num_stages)
    return out


def _gluon_wgrad(a_NT: torch.Tensor, block: int, split_acc: bool, tma: bool) -> bool:
    """Whether the Gluon wgrad can run this ([Note: fp8 wgrad under the next MMA]): sm_90 with Gluon, TMA-aligned,
    per-tensor with split accumulator, or 1x128 blockwise if the tuning's ``wgrad_gluon_blockwise``."""
    from . import gluon as kg
    from .gluon import grouped_wgrad_fp8 as kw
    # blockwise stages its column scales by cp.async ([Note: blockwise wgrad scales]): a Triton without Gluon's
    # async copies keeps the Triton kernel
    blockwise = (block == kw.BLOCK and _tuning().grouped_gemm_fp8.wgrad_gluon_blockwise
                 and kg.async_load is not None and kg.async_mbarrier_arrive is not None)
    if not (tma and a_NT.is_cuda and ((block == 0 and split_acc) or blockwise)) or _interpreting():
        return False
    return kw.AVAILABLE and torch.cuda.get_device_capability(a_NT.device)[0] == 9


def _handoff_16(out, accumulate: bool, table) -> bool:
    """A fresh bf16/fp16 stacked output: 16-bit handoff, room for more stages ([Note: a 16-bit handoff])."""
    return not accumulate and table is None and out.dtype != torch.float32


def _launch_gluon_wgrad(a_NT, as_, b_KT, bs, offs_E, out, accumulate: bool, table, first=None,
                        block: int = 0) -> bool:
    """Launches the Gluon wgrad; False (warned once) if this Triton cannot build it: run the Triton one."""
    from .gluon import grouped_wgrad_fp8_launch as kl
    if "wgrad" in _GLUON_FAILED:
        return False
    try:
        t = _tuning().grouped_gemm_fp8
        stages = t.wgrad_gluon_stages_blockwise if block else t.wgrad_stages(_handoff_16(out, accumulate, table))
        kl.launch(a_NT, as_, b_KT, bs, offs_E, out, table, add_mode=_ADD_MODES[t.wgrad_gluon_add_mode] if accumulate
                  else 0, stages=stages,
                  epilogue_warps=t.wgrad_gluon_epilogue_warps, num_sms=_num_sms(a_NT.device), first=first,
                  block=block)
    except CompilationError as exc:
        return _gluon_failed(_GLUON_FAILED, "wgrad", "FP8 wgrad kernel", "the Triton kernel (same products, slower)",
                             exc)
    return True


def _launch_wgrad(a_NT, as_, b_KT, bs, offs_E, out, *, block: int, accumulate: bool, table, config, use_tma,
                  split_acc: bool = True, gluon: bool | None = None, first=None):
    """dW_e per group into ``out`` [E, N, K] or ``table``'s buffers; a set int32 ``first`` makes an accumulating
    launch write, not add ([Note: an unwritten accumulator]). ``gluon``: None picks, True/False force one."""
    ensure_context(a_NT.device)  # [Note: a current context on any thread]
    N, T = a_NT.shape
    K = b_KT.shape[0]
    E = offs_E.shape[0]
    if E == 0 or N == 0 or K == 0:
        return
    if gluon or (gluon is None and _tuning().grouped_gemm_fp8.wgrad_gluon and config is None and use_tma is not False):
        eligible = (T > 0 and _aligned(a_NT, [a_NT.stride(0)], a_NT.stride(1))
                    and _aligned(b_KT, [b_KT.stride(0)], b_KT.stride(1)))
        can = _gluon_wgrad(a_NT, block, split_acc, eligible)
        if gluon and not can:
            raise ValueError("grouped_wgrad_fp8: gluon=True needs a Hopper GPU, a Triton with Gluon, per-tensor "
                             "scaling with the split accumulator or blockwise 1x128 tiles (with the tuning's "
                             "wgrad_gluon_blockwise) and TMA-aligned operands (16-byte aligned base and "
                             f"outer strides, T % 16 == 0); got block={block}, split_accumulator={split_acc}, "
                             f"aligned={eligible}, device={a_NT.device}")
        if can:
            if _launch_gluon_wgrad(a_NT, as_, b_KT, bs, offs_E, out, accumulate, table, first, block):
                return
            if gluon:
                raise RuntimeError(f"grouped_wgrad_fp8: gluon=True, but the Gluon kernel does not build here: "
                                   f"{_GLUON_FAILED['wgrad']}")
    cfg = _config("grouped_wgrad_fp8", config, block, accumulate, a_NT.device, tokens_per_group=T / E,
                  split_acc=split_acc)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    eligible = (T > 0 and _aligned(a_NT, [a_NT.stride(0)], a_NT.stride(1))
                and _aligned(b_KT, [b_KT.stride(0)], b_KT.stride(1)))
    tma = _resolve_tma(use_tma, eligible, a_NT.device, "grouped_wgrad_fp8")
    a_desc = b_desc = None
    if tma:
        a_desc = TensorDescriptor(a_NT, [N, T], [a_NT.stride(0), 1], [bm, bk])
        b_desc = TensorDescriptor(b_KT, [K, T], [b_KT.stride(0), 1], [bn, bk])
    so = (0,) + out.stride() if table is not None else out.stride()
    sas = as_.stride() if block else (0, 0)
    sbs = bs.stride() if block else (0, 0)
    grid = (E * cdiv(N, bm) * cdiv(K, bn),)
    launch(_wgrad_fp8_kernel, grid,
           a_desc, b_desc, a_NT, b_KT, as_, bs, out if table is None else table, offs_E,
           offs_E if first is None else first, T, N, K,
           a_NT.stride(0), a_NT.stride(1), b_KT.stride(0), b_KT.stride(1),
           sas[0], sas[1], sbs[0], sbs[1],
           so[0], so[1], so[2], offs_E.stride(0),
           BLOCKWISE=block > 0, ADD_MODE=_ADD_MODES[cfg.add_mode] if accumulate else 0,
           PTR_TABLE=table is not None, USE_TMA=tma, UPCAST=_interpreting(),
           BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
           GROUP_M=cfg.group_m, SPLIT_ACC=split_acc, L2_PREFETCH=cfg.l2_prefetch and accumulate and not _interpreting(),
           FIRST=first is not None and accumulate, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


# ---- the three products on raw tensors (config and use_tma are for tests and benchmarks) -----------


def _fprop(x, x_s, w, w_s, offs_E, bias_EN, block, out_dtype, *, config=None, use_tma=None, out=None,
           split_accumulator: bool = True, gluon: bool | None = None, checked: bool = False):
    """``out``: a preallocated [T, N] output (tests poison it); ``checked``: the caller checked the arguments."""
    if not checked:
        _check_ragged("grouped_fprop_fp8", x, x_s, w, w_s, offs_E, block, out_dtype, bias_EN)
        _check_split("grouped_fprop_fp8", block, split_accumulator)
    _check_runnable("grouped_fprop_fp8", x)
    y = torch.empty(x.shape[0], w.shape[1], dtype=out_dtype, device=x.device) if out is None else out
    return _launch_ragged(x, x_s, w.transpose(1, 2), w_s.transpose(1, 2) if block else w_s, offs_E, bias_EN, y,
                          block=block, op="grouped_fprop_fp8", config=config, use_tma=use_tma,
                          split_acc=split_accumulator, gluon=gluon)


def _dgrad(dy, dy_s, w, w_s, offs_E, block, out_dtype, *, config=None, use_tma=None, out=None,
           split_accumulator: bool = True, gluon: bool | None = None, checked: bool = False):
    if not checked:
        _check_ragged("grouped_dgrad_fp8", dy, dy_s, w, w_s, offs_E, block, out_dtype)
        _check_split("grouped_dgrad_fp8", block, split_accumulator)
    _check_runnable("grouped_dgrad_fp8", dy)
    dx = torch.empty(dy.shape[0], w.shape[2], dtype=out_dtype, device=dy.device) if out is None else out
    return _launch_ragged(dy, dy_s, w, w_s, offs_E, None, dx, block=block, op="grouped_dgrad_fp8",
                          config=config, use_tma=use_tma, split_acc=split_accumulator, gluon=gluon)


def _wgrad(dy_t, dy_s, x_t, x_s, offs_E, block, out=None, *, out_dtype: torch.dtype = torch.float32, config=None,
           use_tma=None, split_accumulator: bool = True, gluon: bool | None = None, checked: bool = False,
           first=None):
    if not checked:
        _check_wgrad(dy_t, dy_s, x_t, x_s, offs_E, block, out, out_dtype, first)
        _check_split("grouped_wgrad_fp8", block, split_accumulator)
    _check_runnable("grouped_wgrad_fp8", dy_t)
    kw = dict(block=block, config=config, use_tma=use_tma, split_acc=split_accumulator, gluon=gluon)
    args = (dy_t, dy_s, x_t, x_s, offs_E)
    if out is None:
        dW = torch.empty(offs_E.shape[0], dy_t.shape[0], x_t.shape[0], dtype=out_dtype, device=dy_t.device)
        _launch_wgrad(*args, dW, accumulate=False, table=None, **kw)
        return dW
    kw["first"] = first
    if isinstance(out, torch.Tensor):
        _launch_wgrad(*args, out, accumulate=True, table=None, **kw)
    elif len(out) > 0:
        _launch_wgrad(*args, out[0], accumulate=True, table=_ptr_table(out, dy_t.device), **kw)
    return out
