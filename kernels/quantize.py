"""Triton FP8 quantization: fused amax + scale + cast, bit-exact with ``distwgrad.fp8.quantize``.

Legend: M rows, N columns of a contiguous 2-D input; ``L`` the 1xL tile length. fp32 / fp16 / bf16 in; float8
(E4M3FN or E5M2) data and fp32 ``scale_inv`` out, as plain tensors. Kernels (``_quantize_kernels.py``): per
tensor, an amax pass (skipped for a caller-given amax) then the cast, as no element can be cast before the
global amax is known (``cast_transpose.py`` for an operand also needed as x^T); (bm, bn) blocks; 1xL row
tiles; the row tiles of x and of x^T from one read of an [L, L] tile (Gluon form: [Note: rows and columns
without a transpose]). Per-scale work is repeated by every thread holding part of a row or column, so the
tilings and division-free scales set the speed (docs/benchmarks/LOG.md).

Bit-exactness ([Note: fp8 scale arithmetic] in ``distwgrad/fp8/quantize.py``): IEEE division
(``tl.math.div_rn``; Triton's ``/`` is approximate on NVIDIA), the reference's clamps, NaN-propagating amaxes
(NaN -> +inf), and a saturating round-to-nearest-even cast: ``cvt.rn.satfinite`` on CUDA (sm_89+), integer
arithmetic under ``TRITON_INTERPRET=1`` (the interpreter's cast rounds wrongly). NaN bytes are unspecified.

[Note: power-of-two scales without division]
The reference takes ``s = fl(NUM / amax)``, clamps it to [2**-126, FLT_MAX] and keeps its exponent. With
NUM = mn * 2**en and amax = ma * 2**ea (mantissas in [1, 2)), the quotient lies in [1, 2) if mn >= ma, else
in (1/2, 1), and cannot round out of that range (its bound is representable): fl(NUM / amax) has exponent
en - ea - [mn < ma] exactly, which the kernels take from the bits, clamped to [-126, 127] (a subnormal amax
gives 2**127). ``scale_inv`` of 2**k is 2**-k. ``case_pow2_scales`` of tests/test_fp8_quantize_kernels.py
checks every exponent, 0, inf, NaN and random amaxes.
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError

from ._dispatch import call
from ._host import cdiv, next_pow2
from ._launch import launch
from ._quantize_kernels import (
    _amax_kernel,
    _cast_per_tensor_kernel,
    _quantize_blocks_kernel,
    _quantize_rowcol_kernel,
    _quantize_rows_kernel,
)
from ._tuning import current as _tuning

__all__ = ["quantize_per_tensor", "quantize_blockwise", "quantize_rowwise_and_columnwise"]

# Candidates of ``qa/bench/kernels.py fp8 --quant-sweep``: per benchmark op, ``QuantizeTuning`` fields to override
# (``tuning(quantize=...)``; the tuned values and their measurements: [Note: kernel tuning] in _tuning.py),
# each timed after a bit-exact check. Chosen from the register counts there to vary programs per SM, bytes
# per program and per-scale redundancy; the first of each list is the default.
SWEEP: dict[str, list[dict[str, int | bool | None]]] = {
    "per_tensor": [
        dict(per_tensor_block=4096, per_tensor_warps=4),
        dict(per_tensor_block=8192, per_tensor_warps=4),
        dict(per_tensor_block=8192, per_tensor_warps=8),    # amax 55 regs
        dict(per_tensor_block=2048, per_tensor_warps=4),
        dict(per_tensor_block=16384, per_tensor_warps=8),
        dict(per_tensor_block=16384, per_tensor_warps=16),
    ],
    "blockwise_1x128": [
        dict(rows_tile_m=32, rows_warps=4),
        dict(rows_tile_m=16, rows_warps=4),   # 37 regs (12/SM)
        dict(rows_tile_m=32, rows_warps=8),   # 37 regs (8/SM)
        dict(rows_tile_m=64, rows_warps=4),   # 96 regs (5/SM)
        dict(rows_tile_m=64, rows_warps=8),   # 59 regs (4/SM)
        dict(rows_tile_m=128, rows_warps=8),  # 97 regs (2/SM)
    ],
    "blockwise_128x128": [
        dict(blocks_warps=8),
        dict(blocks_warps=4),   # 167 regs (3/SM), fewest instructions per element
        dict(blocks_warps=16),  # 51 regs (2/SM)
    ],
    "rowcol_1x128": [
        # Gluon, sm_90a SASS instructions per element (docs/benchmarks/LOG.md): 18.1; the Triton kernel
        # (rowcol_gluon=False): 24.4 at 8 warps
        dict(rowcol_gluon=True),
        dict(rowcol_gluon=False, rowcol_warps=8, rowcol_maxnreg=128),
        dict(rowcol_gluon=False, rowcol_warps=4, rowcol_maxnreg=None),  # 206 regs (2/SM)
        dict(rowcol_gluon=False, rowcol_warps=16, rowcol_maxnreg=None),  # 64 regs (1/SM)
    ],
}

_TL_FP8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}
_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_input(x: torch.Tensor, *, two_d: bool) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"the fp8 quantize kernels take {list(_INPUT_DTYPES)}, got {x.dtype}")
    if x.device.type != "cuda" and not (_interpreting() and x.device.type == "cpu"):
        raise ValueError(f"the fp8 quantize kernels need a CUDA tensor (CPU only under TRITON_INTERPRET=1), "
                         f"got one on {x.device}; use distwgrad.fp8.quantize on CPU")
    if not x.is_contiguous():
        raise ValueError(f"the fp8 quantize kernels need a contiguous input, got shape {tuple(x.shape)} with "
                         f"strides {x.stride()}; call .contiguous() where the copy is intended")
    if two_d and x.dim() != 2:
        raise ValueError(f"blockwise quantization needs a 2-D tensor, got shape {tuple(x.shape)}")


def _check_block(block: tuple[int, int] | list[int]) -> tuple[int, int]:
    bad = lambda b: isinstance(b, bool) or not isinstance(b, int) or b < 1 or b & (b - 1)
    if len(block) != 2 or any(bad(b) for b in block):
        raise ValueError(f"the kernels need a block of two powers of two, got {block!r}")
    return int(block[0]), int(block[1])


def _format_of(dtype: torch.dtype) -> tuple[float, int, int]:
    info = torch.finfo(dtype)
    return info.max, -round(math.log2(info.eps)), round(math.log2(info.tiny))


# (taken once: every quantize call reads them, and torch.finfo costs microseconds of host time a call)
_FORMATS = {dtype: _format_of(dtype) for dtype in _TL_FP8}


def _fp8_format(dtype: torch.dtype) -> tuple[float, int, int]:
    """(largest finite value, explicit mantissa bits, exponent of the smallest normal) of a float8 dtype:
    448, 3, -6 for E4M3FN and 57344, 2, -14 for E5M2 (``torch.finfo``)."""
    fmt = _FORMATS.get(dtype) if isinstance(dtype, torch.dtype) else None
    if fmt is None:
        raise ValueError(f"the fp8 quantize kernels write float8_e4m3fn or float8_e5m2, got {dtype!r}")
    return fmt


def _fmt_args(dtype: torch.dtype, margin: int = 0) -> dict:
    """The kernels' format constexprs for ``dtype`` and ``margin`` (a shared dict: spread it, never edit it)."""
    return _fmt_args_of(dtype, margin, not _interpreting())


@functools.lru_cache(maxsize=64)
def _fmt_args_of(dtype: torch.dtype, margin: int, hw_cast: bool) -> dict:
    fp8_max, mantissa_bits, min_normal_exp = _fp8_format(dtype)
    return dict(NUM=fp8_max * 2.0**-margin, FP8=_TL_FP8[dtype], FP8_MAX=fp8_max, MANT=mantissa_bits,
                EMIN_BIASED=min_normal_exp + 127, HW_CAST=hw_cast)


def _amax(x: torch.Tensor) -> torch.Tensor:
    """The per-tensor amax pass: ``max |x|`` of a contiguous ``x`` into a one-element fp32 tensor (0 if empty)."""
    t = _tuning().quantize
    amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    n = x.numel()
    grid = (max(1, min(cdiv(n, t.per_tensor_block), t.amax_max_programs)),)
    launch(_amax_kernel, grid, x, amax, n, BLOCK=t.per_tensor_block, num_warps=t.per_tensor_warps)
    return amax


def _per_tensor_impl(x: torch.Tensor, amax: torch.Tensor | None, dtype: torch.dtype,
                     margin: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_input(x, two_d=False)
    n = x.numel()
    t = _tuning().quantize
    if amax is None:
        amax = _amax(x)
    elif amax.numel() != 1 or amax.dtype != torch.float32 or amax.device != x.device:
        raise ValueError(f"amax must be one float32 value on {x.device}, got shape {tuple(amax.shape)}, "
                         f"{amax.dtype} on {amax.device}")
    data = torch.empty(x.shape, dtype=dtype, device=x.device)
    scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    grid = (max(1, cdiv(n, t.per_tensor_block)),)
    launch(_cast_per_tensor_kernel, grid, x, amax, data.view(torch.uint8), scale_inv, n, BLOCK=t.per_tensor_block,
           num_warps=t.per_tensor_warps, **_fmt_args(dtype, margin))
    return data, scale_inv


_per_tensor_op = torch.library.custom_op("distwgrad::fp8_quantize_per_tensor", _per_tensor_impl, mutates_args=())


@_per_tensor_op.register_fake
def _(x, amax, dtype, margin):
    return torch.empty_like(x, dtype=dtype), x.new_empty((), dtype=torch.float32)


def _blockwise_impl(x: torch.Tensor, block_m: int, block_n: int, dtype: torch.dtype,
                    power_of_two: bool) -> tuple[torch.Tensor, torch.Tensor]:
    _check_input(x, two_d=True)
    bm, bn = _check_block((block_m, block_n))
    (M, N), grid = x.shape, (cdiv(x.shape[0], bm), cdiv(x.shape[1], bn))
    data = torch.empty(x.shape, dtype=dtype, device=x.device)
    scale_inv = torch.empty(grid, dtype=torch.float32, device=x.device)
    if M * N == 0:
        return data, scale_inv
    t = _tuning().quantize
    if bm == 1:
        tile_m = min(t.rows_tile_m, next_pow2(M))
        launch(_quantize_rows_kernel, (cdiv(M, tile_m), grid[1]),
               x, data.view(torch.uint8), scale_inv, M, N, POW2=power_of_two, TILE_M=tile_m, L=bn,
               num_warps=t.rows_warps, **_fmt_args(dtype))
    else:
        launch(_quantize_blocks_kernel, grid, x, data.view(torch.uint8), scale_inv, M, N, M, POW2=power_of_two,
               TRANSPOSE=False, BLOCK_M=bm, BLOCK_N=bn, num_warps=t.blocks_warps,
               **_fmt_args(dtype))
    return data, scale_inv


_blockwise_op = torch.library.custom_op("distwgrad::fp8_quantize_blockwise", _blockwise_impl, mutates_args=())


@_blockwise_op.register_fake
def _(x, block_m, block_n, dtype, power_of_two):
    grid = (-(-x.shape[0] // block_m), -(-x.shape[1] // block_n))
    return torch.empty_like(x, dtype=dtype), x.new_empty(grid, dtype=torch.float32)


def _rowcol_impl(x: torch.Tensor, tile: int, dtype: torch.dtype,
                 power_of_two: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_input(x, two_d=True)
    _, L = _check_block((1, tile))
    M, N = x.shape
    data = torch.empty((M, N), dtype=dtype, device=x.device)
    scale_inv = torch.empty((M, cdiv(N, L)), dtype=torch.float32, device=x.device)
    data_t = torch.empty((N, M), dtype=dtype, device=x.device)
    scale_inv_t = torch.empty((N, cdiv(M, L)), dtype=torch.float32, device=x.device)
    if M * N > 0 and not (_gluon_rowcol(x, L, power_of_two)
                          and _launch_gluon_rowcol(x, data, scale_inv, data_t, scale_inv_t, dtype)):
        t = _tuning().quantize
        launch(_quantize_rowcol_kernel, (cdiv(M, L), cdiv(N, L)),
               x, data.view(torch.uint8), scale_inv, data_t.view(torch.uint8), scale_inv_t, M, N,
               POW2=power_of_two, L=L, num_warps=t.rowcol_warps, maxnreg=t.rowcol_maxnreg,
               **_fmt_args(dtype))
    return data, scale_inv, data_t, scale_inv_t


_GLUON_FAILED: str | None = None  # why the Gluon kernel did not build here, once it failed


def _launch_gluon_rowcol(x, data, scale_inv, data_t, scale_inv_t, dtype) -> bool:
    """Launches the Gluon rows + columns kernel; False (and one warning) if this Triton cannot build it
    (Gluon's API moves between releases): the caller then runs the Triton kernel, same bits."""
    global _GLUON_FAILED
    if _GLUON_FAILED is not None:
        return False
    from .gluon import quantize_rowcol as kg
    M, N = x.shape
    try:
        launch(kg.rowcol_kernel, (cdiv(M, kg.L), cdiv(N, kg.L)),
               x, data.view(torch.uint8), scale_inv, data_t.view(torch.uint8).view(torch.int32), scale_inv_t, M, N,
               NUM=_fmt_args(dtype)["NUM"], FP8=_TL_FP8[dtype], num_warps=kg.NUM_WARPS.value)
    except CompilationError as exc:
        _GLUON_FAILED = f"{type(exc).__name__}: {exc}"[:2000]
        warnings.warn(f"the Gluon rows + columns FP8 quantize kernel does not build with triton "
                      f"{triton.__version__}; using the Triton kernel (same bits, slower): {_GLUON_FAILED[:400]}",
                      RuntimeWarning, stacklevel=3)
        return False
    return True


def _gluon_rowcol(x: torch.Tensor, L: int, power_of_two: bool) -> bool:
    """Whether the Gluon rows + columns kernel takes this call ([Note: rows and columns without a transpose]):
    asked for in the tuning, available, L = 128, power-of-two scales, M % 4 == 0, sm_90+."""
    if not _tuning().quantize.rowcol_gluon or not x.is_cuda or _interpreting():
        return False
    from .gluon import quantize_rowcol as kg
    return (kg.AVAILABLE and L == kg.L and power_of_two and x.shape[0] % 4 == 0
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


_rowcol_op = torch.library.custom_op("distwgrad::fp8_quantize_rowwise_and_columnwise", _rowcol_impl, mutates_args=())


@_rowcol_op.register_fake
def _(x, tile, dtype, power_of_two):
    M, N = x.shape
    return (torch.empty_like(x, dtype=dtype), x.new_empty((M, -(-N // tile)), dtype=torch.float32),
            x.new_empty((N, M), dtype=dtype), x.new_empty((N, -(-M // tile)), dtype=torch.float32))


def quantize_per_tensor(x: torch.Tensor, dtype: torch.dtype, *, amax: torch.Tensor | None = None,
                        margin: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale_inv)`` of ``x`` (any shape) with one scale: the bits of ``distwgrad.fp8.quantize``'s
    ``quantize_per_tensor``. ``amax``, if given: one fp32 value on ``x``'s device (e.g. the shard group's
    all-reduced amax), read on the device, never synced."""
    _fp8_format(dtype)
    return call(torch.ops.distwgrad.fp8_quantize_per_tensor, _per_tensor_impl, x, amax, dtype, margin)


def quantize_blockwise(x: torch.Tensor, block: tuple[int, int], dtype: torch.dtype, *,
                       power_of_two: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale_inv)`` of a 2-D ``x_MN``, one scale per ``block`` ``(bm, bn)`` (powers of two), ``scale_inv``
    ``[cdiv(M, bm), cdiv(N, bn)]``: the bits of ``distwgrad.fp8.quantize.quantize_blockwise``."""
    _fp8_format(dtype)
    bm, bn = _check_block(block)
    return call(torch.ops.distwgrad.fp8_quantize_blockwise, _blockwise_impl, x, bm, bn, dtype, power_of_two)


def quantize_rowwise_and_columnwise(x: torch.Tensor, dtype: torch.dtype, *, block: int, power_of_two: bool = True,
                                    margin: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(data, scale_inv, data_t, scale_inv_t)``: a 2-D ``x_MN`` quantized as ``x`` and as ``x^T`` (``data_t``
    ``[N, M]``) from one read of ``x`` (per tensor: after the amax pass), the bits of
    ``distwgrad.fp8.quantize.quantize_rowwise_and_columnwise``.

    ``block`` L > 0: 1xL tiles along N for ``x`` and along M for ``x^T``, scales ``[M, cdiv(N, L)]`` and
    ``[N, cdiv(M, L)]``. ``block`` 0: one scale (``margin``) shared by both, so ``scale_inv_t`` is ``scale_inv``.
    """
    if block:
        return call(torch.ops.distwgrad.fp8_quantize_rowwise_and_columnwise, _rowcol_impl, x, block, dtype,
                    power_of_two)
    from .cast_transpose import cast_transpose_per_tensor  # (it builds on this module)
    data, scale_inv, data_t, _ = cast_transpose_per_tensor(x, dtype, margin=margin)
    return data, scale_inv, data_t, scale_inv  # the bits of quantize_per_tensor and transpose_quantized
