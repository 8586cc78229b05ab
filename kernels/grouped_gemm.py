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
or fewer runs at half height ([Note: half tail tiles]). wgrad tiles the fixed [N, K] output of
every group and walks that group's tokens as its reduction; its kernels live in ``_grouped_wgrad``, with
a persistent variant (``TileConfig.persistent`` programs per SM loop over the tiles, so that one tile's
fp32 reduction into ``out`` drains while the next tile's main loop runs; [Note: persistent wgrad]).

Loads: Hopper TMA tensor descriptors when layouts allow (16-byte aligned base and row strides, unit
inner stride; for dgrad also N a multiple of BLOCK_K, so a reduction step never crosses into the next
expert's weight), else masked pointer loads (any strides). The results are the same. wgrad's last,
partial token block always takes the masked path, because a descriptor cannot stop at a group's end.
``TRITON_INTERPRET=1`` runs everything on CPU tensors; there bf16 operands are upcast to fp32 first
(the interpreter's bf16 ``tl.dot`` multiplies bit patterns).
"""

import collections
import functools
import inspect
import os
import warnings
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError
from triton.tools.tensor_descriptor import TensorDescriptor

from . import _grouped_gemm_configs as _cfg
from ._context import ensure_context
from ._dispatch import call
from ._grouped_gemm_checks import _check_dgrad, _check_fprop, _check_wgrad
from ._grouped_wgrad import _mma, _swizzle, _wgrad_kernel, _wgrad_persistent_kernel
from ._tuning import current as _tuning

__all__ = ["grouped_fprop", "grouped_dgrad", "grouped_wgrad"]

_ADD_MODES = {"load": 1, "prefetch": 2, "atomic": 3, "tma_add": 4}  # TileConfig.add_mode -> ADD_MODE
# tl.range(..., warp_specialize=) exists in newer Triton only; TileConfig.warp_specialize needs it
_RANGE_WARP_SPECIALIZE = "warp_specialize" in inspect.signature(tl.range.__init__).parameters
_GLUON_FAILED: dict[str, str] = {}  # "wgrad16" -> why the Gluon wgrad did not build here (then Triton runs)

# ---------------------------------------------------------------------------------------------------
# Kernels (fprop/dgrad; the wgrad kernels and the shared tile helpers are in _grouped_wgrad.py)
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _tiles_m(size, BLOCK_M: tl.constexpr, WIDE_TAIL: tl.constexpr):
    """M tiles of a group of ``size`` rows; ``WIDE_TAIL``: a last remainder of BLOCK_M / 2 rows or fewer
    joins the tile before it ([Note: wide tail tiles])."""
    if WIDE_TAIL:
        return tl.where(size > 0, tl.maximum(tl.cdiv(size - BLOCK_M // 2, BLOCK_M), 1), 0)
    return tl.cdiv(size, BLOCK_M)


@triton.jit
def _find_group(offs_ptr, stride_o, E, T, pid, tiles_n, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                WIDE_TAIL: tl.constexpr = False):
    """(group, tile within it, first token, tokens, total tiles) for tile ``pid``; offsets clamped."""
    eidx = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + eidx * stride_o, mask=eidx < E, other=0)
    starts = tl.load(offs_ptr + (eidx - 1) * stride_o, mask=(eidx > 0) & (eidx < E), other=0)
    ends = tl.minimum(tl.maximum(ends, 0), T)
    starts = tl.minimum(tl.maximum(starts, 0), T)
    sizes = tl.maximum(ends - starts, 0)
    tiles = _tiles_m(sizes, BLOCK_M, WIDE_TAIL) * tiles_n
    done = tl.cumsum(tiles, 0) <= pid
    this = eidx == tl.sum(done.to(tl.int32), 0)
    e = tl.sum(done.to(tl.int32), 0)
    local = pid - tl.sum(tl.where(done, tiles, 0), 0)
    start = tl.sum(tl.where(this, starts, 0), 0)
    size = tl.sum(tl.where(this, sizes, 0), 0)
    return e, local, start, size, tl.sum(tiles, 0)


# [Note: half tail tiles]
# A group's tokens rarely fill its last M tile. At ~128 tokens per expert (E=128 of the benchmark: 128 +- 11
# under random routing) every other group spills a few rows into a second 128-row tile, and that tile costs
# as many MMAs as a full one: a third of the launch's tiles compute mostly rows that are masked at the
# store. With ``TileConfig.half_tail`` a tile with BLOCK_M / 2 rows or fewer runs the same loop at half
# height (its own TMA descriptor of [BLOCK_M / 2, BLOCK_K] x rows; the weight tile is unchanged), so it
# issues half the MMAs (m64n128 per warpgroup instead of m64n256 at 128x256x64/w8). Both loops are
# compiled into one kernel and the branch is uniform per program; they share one shared-memory ring
# (sm_90a: 196,640 bytes with or without the half loop) and neither spills. The products and their K order
# are the same, so the bits match full-height tiles (GPU test). The grid is unchanged: a half tile is still
# one program. H200, one process, medians of three interleaved rounds (docs/benchmarks.md): E=128 fprop
# 331 vs 319 TFLOP/s, dgrad 331 vs 312; at 1024 and 4096 tokens per group the few half tiles change
# nothing measurable (E=64 fprop 630 vs 634, dgrad 591 vs 586). No tile beat the default with it (round 9
# of docs/benchmarks/LOG.md).


# [Note: wide tail tiles]
# Half tail tiles still cost a program and a full read of the weight tile for at most BLOCK_M / 2 rows, and at
# ~128 tokens per expert a third of the launch's tiles are such tails. The E=128 shape is bound by its memory
# streams (Nsight Compute, H200: DRAM 70% and L2 84-89% of peak; docs/benchmarks.md), so the weight read
# matters more than the MMAs. With ``TileConfig.wide_tail`` a remainder of BLOCK_M / 2 rows or fewer joins
# the group's tile before it (``_tiles_m``): that program runs 1.5 BLOCK_M rows, a BLOCK_M-row and a
# BLOCK_M / 2-row product against each weight stage it loads once (``_ragged_wide_tile``; the second through
# the half-height descriptor). A group of one such remainder only (<= BLOCK_M / 2 tokens) keeps its half tile.
# At E=128 the launch loses its 195 tail tiles (579 -> 384 programs), the weight tiles cross L2 once per
# (expert, column) instead of up to twice, and the wave count drops from 4.4 to 2.9. The products and their
# K order are those of full-height tiles, so the bits match (GPU test). The wide loop lifts the kernel's
# registers (sm_90a, 128x256x64/w8: 218 against 154, no spills) and its ring (229,408 bytes at s4), and the
# build that has it runs every full tile slower (H200: 0.61-0.95x at 256-4096 tokens per group). Triton 3.6's
# ptxas serializes that build's wgmma pipeline (C7515), but that is not the whole cause: a build that ran a
# wide tile as the full tile's loop and then the half tile's had no C7515 and ran full tiles as slowly (and
# E=128 at 270 TFLOP/s; docs/benchmarks.md). So ``pick_ragged`` turns it on only where the groups average
# GroupedGemmTuning.wide_tail_max_tokens tokens or fewer. H200, one process, medians of three interleaved rounds
# (docs/benchmarks.md, "Wide tail tiles"): E=128 fprop 347 vs 324 TFLOP/s, dgrad 351 vs 324.


@triton.jit
def _ragged_tile(a_desc, w_desc, a_ptr, w_ptr, out_ptr, bias_ptr, e, row0, row_end, col0, N, K, W_ROWS,
                 stride_at, stride_ak, stride_we, stride_bk, stride_bn, stride_ot, stride_on, stride_be, stride_bn_bias,
                 W_TRANS: tl.constexpr, HAS_BIAS: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr,
                 PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One output tile: out[row0 : row0 + BLOCK_M (rows < row_end), col0 : col0 + BLOCK_N] of group e."""
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    rows_ok = rows < row_end
    rows64 = rows.to(tl.int64)
    e64 = e.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        # Rows past the group (next group's tokens) and columns past N only feed outputs that are
        # masked at the store; K past the end is zero-filled by the descriptor.
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([row0, k0])
            if W_TRANS:
                b = w_desc.load([e * W_ROWS + col0, k0]).T
            else:
                b = w_desc.load([e * W_ROWS + k0, col0])
            acc = _mma(a, b, acc, UPCAST, PRECISION)
    else:
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows64[:, None] * stride_at + ks[None, :] * stride_ak
        b_ptrs = w_ptr + e64 * stride_we + ks[:, None] * stride_bk + cols.to(tl.int64)[None, :] * stride_bn
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs, mask=rows_ok[:, None] & (ks[None, :] < K - k0), other=0.0)
            b = tl.load(b_ptrs, mask=(ks[:, None] < K - k0) & (cols[None, :] < N), other=0.0)
            acc = _mma(a, b, acc, UPCAST, PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        bias = tl.load(bias_ptr + e64 * stride_be + cols * stride_bn_bias, mask=cols < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    o_ptrs = out_ptr + rows64[:, None] * stride_ot + cols[None, :] * stride_on
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=rows_ok[:, None] & (cols[None, :] < N))


@triton.jit
def _ragged_store(acc, out_ptr, bias_ptr, e64, row0, row_end, col0, N, stride_ot, stride_on, stride_be, stride_bn_bias,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A wide tile's epilogue for one of its two products: bias, cast, store of rows row0 .. row0 + BLOCK_M
    below row_end, columns below N. (``_ragged_tile`` keeps the same lines inline: called from there, this
    helper made ptxas serialize the full tile's wgmma pipeline under Triton 3.6; [Note: wide tail tiles].)"""
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + e64 * stride_be + cols * stride_bn_bias, mask=cols < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + cols[None, :] * stride_on
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < row_end)[:, None] & (cols[None, :] < N))


@triton.jit
def _ragged_wide_tile(a_desc, a_half_desc, w_desc, a_ptr, w_ptr, out_ptr, bias_ptr, e, row0, row_end, col0, N, K,
                      W_ROWS, stride_at, stride_ak, stride_we, stride_bk, stride_bn, stride_ot, stride_on, stride_be,
                      stride_bn_bias, W_TRANS: tl.constexpr, HAS_BIAS: tl.constexpr, USE_TMA: tl.constexpr,
                      UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """A group's last tile with the remainder it absorbed: rows row0 .. row0 + 1.5 BLOCK_M (below row_end)
    as a BLOCK_M-row and a BLOCK_M / 2-row product that share each weight stage ([Note: wide tail tiles])."""
    HALF: tl.constexpr = BLOCK_M // 2
    e64 = e.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((HALF, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([row0, k0])
            a2 = a_half_desc.load([row0 + BLOCK_M, k0])
            if W_TRANS:
                b = w_desc.load([e * W_ROWS + col0, k0]).T
            else:
                b = w_desc.load([e * W_ROWS + k0, col0])
            acc = _mma(a, b, acc, UPCAST, PRECISION)
            acc2 = _mma(a2, b, acc2, UPCAST, PRECISION)
    else:
        rows = row0 + tl.arange(0, BLOCK_M)
        rows2 = row0 + BLOCK_M + tl.arange(0, HALF)
        cols = col0 + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_at + ks[None, :] * stride_ak
        a2_ptrs = a_ptr + rows2.to(tl.int64)[:, None] * stride_at + ks[None, :] * stride_ak
        b_ptrs = w_ptr + e64 * stride_we + ks[:, None] * stride_bk + cols.to(tl.int64)[None, :] * stride_bn
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=(rows < row_end)[:, None] & k_ok[None, :], other=0.0)
            a2 = tl.load(a2_ptrs, mask=(rows2 < row_end)[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & (cols[None, :] < N), other=0.0)
            acc = _mma(a, b, acc, UPCAST, PRECISION)
            acc2 = _mma(a2, b, acc2, UPCAST, PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            a2_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    _ragged_store(acc, out_ptr, bias_ptr, e64, row0, row_end, col0, N, stride_ot, stride_on, stride_be,
                  stride_bn_bias, HAS_BIAS, BLOCK_M, BLOCK_N)
    _ragged_store(acc2, out_ptr, bias_ptr, e64, row0 + BLOCK_M, row_end, col0, N, stride_ot, stride_on, stride_be,
                  stride_bn_bias, HAS_BIAS, HALF, BLOCK_N)


@triton.jit(do_not_specialize=["T", "E"])  # token and group counts change per step: one compile
def _ragged_m_kernel(a_desc, a_half_desc, w_desc, a_ptr, w_ptr, out_ptr, bias_ptr, offs_ptr,
                     T, E, N, K, W_ROWS,
                     stride_at, stride_ak, stride_we, stride_bk, stride_bn,
                     stride_ot, stride_on, stride_be, stride_bn_bias, stride_o,
                     W_TRANS: tl.constexpr, HAS_BIAS: tl.constexpr, USE_TMA: tl.constexpr,
                     UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr, HALF_TAIL: tl.constexpr,
                     WIDE_TAIL: tl.constexpr = False):
    """out[t, :N] = a[t, :K] @ B_e for the tokens t of group e; B_e = W_e^T (fprop) or W_e (dgrad).
    ``HALF_TAIL``: a group's last M tile with BLOCK_M / 2 rows or fewer runs at half height ([Note: half
    tail tiles]); ``WIDE_TAIL``: such a remainder joins the tile before it, where there is one ([Note:
    wide tail tiles])."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    e, local, start, size, total = _find_group(offs_ptr, stride_o, E, T, pid, tiles_n, BLOCK_M, BLOCK_E, WIDE_TAIL)
    if pid >= total:
        return
    pid_m, pid_n = _swizzle(local, _tiles_m(size, BLOCK_M, WIDE_TAIL), tiles_n, GROUP_M)
    row0 = start + pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N
    if WIDE_TAIL and size - pid_m * BLOCK_M > BLOCK_M:
        _ragged_wide_tile(a_desc, a_half_desc, w_desc, a_ptr, w_ptr, out_ptr, bias_ptr, e, row0, start + size, col0,
                          N, K, W_ROWS, stride_at, stride_ak, stride_we, stride_bk, stride_bn, stride_ot, stride_on,
                          stride_be, stride_bn_bias, W_TRANS, HAS_BIAS, USE_TMA, UPCAST, PRECISION, BLOCK_M, BLOCK_N,
                          BLOCK_K)
    elif HALF_TAIL and size - pid_m * BLOCK_M <= BLOCK_M // 2:
        _ragged_tile(a_half_desc, w_desc, a_ptr, w_ptr, out_ptr, bias_ptr, e, row0, start + size, col0, N, K, W_ROWS,
                     stride_at, stride_ak, stride_we, stride_bk, stride_bn, stride_ot, stride_on, stride_be,
                     stride_bn_bias, W_TRANS, HAS_BIAS, USE_TMA, UPCAST, PRECISION, BLOCK_M // 2, BLOCK_N, BLOCK_K)
    else:
        _ragged_tile(a_desc, w_desc, a_ptr, w_ptr, out_ptr, bias_ptr, e, row0, start + size, col0, N, K, W_ROWS,
                     stride_at, stride_ak, stride_we, stride_bk, stride_bn, stride_ot, stride_on, stride_be,
                     stride_bn_bias, W_TRANS, HAS_BIAS, USE_TMA, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)


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
    """Streaming multiprocessors of a CUDA device: persistent kernels launch a multiple of it. Elsewhere
    (the interpreter) 4, so that test programs loop over several tiles."""
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
                         f"base and row strides, unit inner stride; dgrad: N a multiple of BLOCK_K)")
    return requested


def _elem_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _gluon_failed(key: str, kernel: str, fallback: str, exc: Exception) -> bool:
    """Records why a Gluon kernel did not build here (``_GLUON_FAILED[key]``: later calls skip it) and warns
    once; returns False, for the launcher to return (its caller then runs ``fallback``)."""
    _GLUON_FAILED[key] = f"{type(exc).__name__}: {exc}"[:2000]
    warnings.warn(f"the Gluon {kernel} does not build with triton {triton.__version__}; using {fallback}: "
                  f"{_GLUON_FAILED[key][:400]}", RuntimeWarning, stacklevel=5)
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
    if config.persistent:
        raise ValueError(f"grouped_fprop/grouped_dgrad: persistent configs are for wgrad only, got "
                         f"{config.short()}")
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
    grid = ((triton.cdiv(T, bm) + E) * triton.cdiv(N, bn),)
    _ragged_m_kernel[grid](
        a_desc, a_half_desc, w_desc, a, w_ENK, out, bias_EN, offs_E,
        T, E, N, K, w_rows,
        a.stride(0), a.stride(1), sw[0], stride_bk, stride_bn,
        out.stride(0), out.stride(1), bias_strides[0], bias_strides[1], offs_E.stride(0),
        W_TRANS=w_trans, HAS_BIAS=bias_EN is not None, USE_TMA=tma, UPCAST=upcast, PRECISION=precision,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
        BLOCK_E=max(16, triton.next_power_of_2(E)), HALF_TAIL=half_tail, WIDE_TAIL=wide_tail,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def _gluon_wgrad(dy_TN: torch.Tensor, x_TK: torch.Tensor, out: torch.Tensor, accumulate: bool = True) -> bool:
    """Whether the Gluon wgrad can take this bf16 / fp16 wgrad: a Hopper GPU, a Triton with Gluon, dy and x
    of one 16-bit dtype, TMA-aligned (16-byte aligned base and row stride, unit inner stride), tokens, and
    an fp32 output to add into (a fresh wgrad runs the Triton kernel)."""
    if not dy_TN.is_cuda or _interpreting() or dy_TN.dtype not in (torch.bfloat16, torch.float16):
        return False
    from . import _grouped_wgrad_fp8_gluon as kw
    out_ok = accumulate and out.dtype == torch.float32
    return (kw.AVAILABLE and x_TK.dtype == dy_TN.dtype and dy_TN.shape[0] > 0 and out_ok
            and _tma_2d_ok(dy_TN, dy_TN.stride(0), dy_TN.stride(1)) and _tma_2d_ok(x_TK, x_TK.stride(0), x_TK.stride(1))
            and torch.cuda.get_device_capability(dy_TN.device)[0] == 9)


def _gluon_wgrad_by_default(T: int, E: int, accumulate: bool, config, use_tma) -> bool:
    """Whether the default dispatch tries the Gluon wgrad: the tuning wants it for this problem
    (``GroupedGemmTuning.wgrad_gluon_wanted``: an accumulating call, groups of ``wgrad_gluon_min_tokens``
    tokens or more on average) and neither a config nor ``use_tma=False`` asked for a Triton kernel
    (``_gluon_wgrad`` then checks that it applies)."""
    return config is None and use_tma is not False and _tuning().grouped_gemm.wgrad_gluon_wanted(T, E, accumulate)


def _launch_gluon_wgrad(dy_TN, x_TK, offs_E, out, table) -> bool:
    """Launches the Gluon wgrad; False (and one warning) if this Triton cannot build it: the caller then
    runs the Triton kernel."""
    from . import _grouped_wgrad_fp8_gluon_launch as kl
    if "wgrad16" in _GLUON_FAILED:
        return False
    t = _tuning().grouped_gemm
    try:
        kl.launch_tokens_outer(dy_TN, x_TK, offs_E, out, table, add_mode=_ADD_MODES[t.wgrad_gluon_add_mode],
                               stages=t.wgrad_gluon_stages, epilogue_warps=t.wgrad_gluon_epilogue_warps,
                               num_sms=_num_sms(dy_TN.device), tail=t.wgrad_gluon_tail)
    except CompilationError as exc:
        return _gluon_failed("wgrad16", "wgrad kernel", "the Triton kernel", exc)
    return True


def _launch_wgrad(dy_TN, x_TK, offs_E, out, *, accumulate: bool, table, config, use_tma,
                  gluon: bool | None = None):
    """dW_e for every group into ``out`` ([E, N, K]) or, with ``table``, into the per-group buffers it
    points to (``out`` is then entry 0, read for its strides); adds to them iff ``accumulate``. ``gluon``:
    None picks (the Gluon kernel where ``_gluon_wgrad_by_default`` and it applies), True requires it, False
    runs a Triton kernel."""
    ensure_context(dy_TN.device)  # [Note: a current context on any thread]
    T, N = dy_TN.shape
    K = x_TK.shape[1]
    E = offs_E.shape[0]
    if E == 0 or N == 0 or K == 0:
        return
    if gluon if gluon is not None else _gluon_wgrad_by_default(T, E, accumulate, config, use_tma):
        needs = lambda: (f"a Hopper GPU, a Triton with Gluon, bf16 or fp16 TMA-aligned dy and x of one dtype and "  # noqa: E731
                         f"an fp32 output to add into; got {dy_TN.dtype} and {x_TK.dtype} on {dy_TN.device}, strides "
                         f"{tuple(dy_TN.stride())} and {tuple(x_TK.stride())}, output {out.dtype}, "
                         f"accumulate={accumulate}")
        if _ran_gluon(gluon, "grouped_wgrad", _gluon_wgrad(dy_TN, x_TK, out, accumulate), needs,
                      lambda: _launch_gluon_wgrad(dy_TN, x_TK, offs_E, out, table)):
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
            out_desc = TensorDescriptor(out, [E, N, K], list(so), [1, bm, bn // config.subtile])
        else:
            add_mode = 3
    upcast, precision = _dot_flags(dy_TN.dtype, dy_TN.device)
    args = (dy_desc, x_desc, out_desc, dy_TN, x_TK, out if table is None else table, offs_E, T, N, K)
    strides = (dy_TN.stride(0), dy_TN.stride(1), x_TK.stride(0), x_TK.stride(1),
               so[0], so[1], so[2], offs_E.stride(0))
    meta = dict(ADD_MODE=add_mode, PTR_TABLE=table is not None, USE_TMA=tma, UPCAST=upcast,
                PRECISION=precision, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
                L2_PREFETCH=config.l2_prefetch and add_mode != 0 and not _interpreting(),
                num_warps=config.num_warps, num_stages=config.num_stages)
    num_tiles = E * triton.cdiv(N, bm) * triton.cdiv(K, bn)
    if not config.persistent:
        _wgrad_kernel[(num_tiles,)](*args, *strides, **meta)
        return
    if config.warp_specialize and not _RANGE_WARP_SPECIALIZE:
        raise ValueError(f"grouped_wgrad: {config.short()} asks for warp specialization, which "
                         f"tl.range of triton {triton.__version__} does not take")
    programs = min(num_tiles, _num_sms(dy_TN.device) * config.persistent)
    _wgrad_persistent_kernel[(programs,)](*args, E, programs, *strides, SUBTILE=config.subtile,
                                          WARP_SPECIALIZE=config.warp_specialize, **meta)


def _check_runnable(op: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not _interpreting():
        raise ValueError(f"{op}: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got "
                         f"{t.device}; distwgrad.ops.grouped_gemm runs the torch reference elsewhere")


# ---- pointer tables for a list of per-group outputs -------------------------------------------------
# Kept for the process's life (up to _PTR_TABLES_MAX, 2 KB each at E=256): a CUDA graph that captured a
# launch keeps reading its table, so a table must not be freed while graphs may replay.
_PTR_TABLES: collections.OrderedDict = collections.OrderedDict()
_PTR_TABLES_MAX = 4096


def _ptr_table(outs: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    key = (str(device), tuple(t.data_ptr() for t in outs))
    hit = _PTR_TABLES.get(key)
    if hit is not None:
        _PTR_TABLES.move_to_end(key)
        return hit[1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("grouped_wgrad: first use of this list of out buffers inside a CUDA graph "
                           "capture; call once before capturing (a warm-up, as Triton's compile needs)")
    host = torch.tensor(key[1], dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    _PTR_TABLES[key] = (host, host.to(device, non_blocking=True))
    while len(_PTR_TABLES) > _PTR_TABLES_MAX:
        _PTR_TABLES.popitem(last=False)
    return _PTR_TABLES[key][1]


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


def _wgrad(dy_TN, x_TK, offs_E, out=None, *, config=None, use_tma=None):
    _check_wgrad(dy_TN, x_TK, offs_E, out)
    _check_runnable("grouped_wgrad", dy_TN)
    kw = dict(config=config, use_tma=use_tma)
    if out is None:
        dW_ENK = dy_TN.new_empty(offs_E.shape[0], dy_TN.shape[1], x_TK.shape[1])
        _launch_wgrad(dy_TN, x_TK, offs_E, dW_ENK, accumulate=False, table=None, **kw)
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


def _wgrad_impl(dy_TN: torch.Tensor, x_TK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    return _wgrad(dy_TN, x_TK, offs_E)


_wgrad_op = torch.library.custom_op("distwgrad::grouped_wgrad", _wgrad_impl, mutates_args=())


@_wgrad_op.register_fake
def _(dy_TN, x_TK, offs_E):
    _check_wgrad(dy_TN, x_TK, offs_E, None)
    return dy_TN.new_empty(offs_E.shape[0], dy_TN.shape[1], x_TK.shape[1])


def _wgrad_acc_impl(dy_TN: torch.Tensor, x_TK: torch.Tensor, offs_E: torch.Tensor, out: torch.Tensor) -> None:
    _wgrad(dy_TN, x_TK, offs_E, out)


_wgrad_acc_op = torch.library.custom_op("distwgrad::grouped_wgrad_accumulate", _wgrad_acc_impl, mutates_args=("out",))


@_wgrad_acc_op.register_fake
def _(dy_TN, x_TK, offs_E, out):
    _check_wgrad(dy_TN, x_TK, offs_E, out)


def _wgrad_acc_list_impl(dy_TN: torch.Tensor, x_TK: torch.Tensor, offs_E: torch.Tensor,
                         out: list[torch.Tensor]) -> None:
    _wgrad(dy_TN, x_TK, offs_E, out)


_wgrad_acc_list_op = torch.library.custom_op(
    "distwgrad::grouped_wgrad_accumulate_list", _wgrad_acc_list_impl, mutates_args=("out",))


@_wgrad_acc_list_op.register_fake
def _(dy_TN, x_TK, offs_E, out):
    _check_wgrad(dy_TN, x_TK, offs_E, out)


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
                  out: torch.Tensor | Sequence[torch.Tensor] | None = None):
    """``dW_e = dy_TN[g]^T @ x_TK[g]`` summed over the tokens g of each group e.

    Args:
        dy_TN: ``[T, N]`` output gradients; x_TK: ``[T, K]`` inputs (same dtype, device, token order).
        offs_E: ``[E]`` int32 end offsets on the same device.
        out: None for a fresh ``[E, N, K]`` tensor in dy's dtype (an empty group gives zeros); or fp32
            buffers to ADD into in the same pass (``main_grad``): a stacked ``[E, N, K]`` tensor, or a
            list of E ``[N, K]`` tensors sharing shape and strides (an empty group adds nothing).

    Returns:
        The fresh tensor, or ``out`` itself.
    """
    _check_wgrad(dy_TN, x_TK, offs_E, out)
    if out is None:
        return call(torch.ops.distwgrad.grouped_wgrad, _wgrad_impl, dy_TN, x_TK, offs_E)
    if isinstance(out, torch.Tensor):
        call(torch.ops.distwgrad.grouped_wgrad_accumulate, _wgrad_acc_impl, dy_TN, x_TK, offs_E, out, mutated=(3,))
    else:
        call(torch.ops.distwgrad.grouped_wgrad_accumulate_list, _wgrad_acc_list_impl, dy_TN, x_TK, offs_E, list(out),
             mutated=(3,))
    return out
