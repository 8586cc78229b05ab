"""Rows + columns 1x128 FP8 quantization in Gluon: the same products as ``quantize._quantize_rowcol_kernel``
with a register layout chosen by hand, so that x^T leaves without a trip through shared memory.

[Note: rows and columns without a transpose]
The Triton kernel holds a 128x128 tile of x in the layout its loads want (8 contiguous columns per
thread) and lets the compiler transpose the fp8 bytes of x^T through shared memory before the store:
64 single-byte shared loads per thread and ~24 SASS instructions per element, against ~8.5 for the
rows-only kernel (sm_90a SASS; docs/benchmarks/LOG.md). Here every thread holds a 4x8 block (4 consecutive
rows, 8 consecutive columns; ``BlockedLayout([1, 4, 8], ...)`` over the tile viewed as [32, 4, 128]):
- x is loaded as 16-byte row pieces and x's quantized rows leave as 8-byte pieces, as before;
- for x^T, the 4 bytes of one column in a thread's 4 rows are consecutive in x^T's row, so they are
  packed into one 32-bit word in registers and stored directly: 8 lanes of a warp write 32 contiguous
  bytes of each of x^T's rows (whole 32-byte sectors), no shared memory, no shuffles;
- a row's amax reduces over 16 values in a thread, then 4 lanes and 2 warps; a column's over 4 values
  in a thread, then 8 lanes and 4 warps. Every value comes from the same helpers as the Triton kernel
  (``_scale_from_amax``, ``_inverse``, ``_to_fp8_bits``), so the bits are the same;
- each reduced amax moves to one thread (``gl.convert_layout``: Gluon keeps the conversion where it is
  written, which Triton's own compiler would not), which computes the scale and its inverse, stores the
  inverse once and broadcasts the scale back: 18.1 instructions per element (every holder of a row or
  column computing its scale took 24.6: docs/benchmarks/LOG.md).
H200 (2026-11-29, ``qa/L2_gpu/rowcol_gluon_check.py`` and ``qa/bench/kernels.py fp8 --quant-sweep``): 0.73-0.755
of the copy bandwidth against 0.59-0.61 for the Triton kernel, bit-exact in every run. A variant with 8
rows per thread (x^T in 8-byte words; 14.9 instructions per element) built, but gave wrong x^T bits on
Triton 3.6 in every run, so it is not offered.
Taken when the tile is 128 (the recipes' default), the scales are powers of two, M is a multiple of 4
(x^T rows are written in 4-byte words), the device is a CUDA GPU of compute capability 9 or newer and
this Triton has Gluon; otherwise, and in the interpreter (which does not run Gluon), the Triton kernel.
Gluon is experimental and its API moves between Triton releases: if this kernel does not build, the
first call warns once and every call takes the Triton kernel (``quantize._launch_gluon_rowcol``).
"""

import triton.language as tl

from .._quantize_kernels import _absmax, _inf_if_nan, _inverse, _scale_from_amax, _to_fp8_bits
from . import AVAILABLE, gl, gluon

__all__ = ["AVAILABLE", "L", "NUM_WARPS", "rowcol_kernel"]

L = 128           # the tile (the recipe's 1x128 scaling tile, both ways)
NUM_WARPS = tl.constexpr(8)  # the layouts below spread a tile over 8 warps


@gluon.jit
def _row_scales(amax_ir, s_inv_ptr, row0, M, N, pid_n, NUM: tl.constexpr):
    """Scales of the tile's 128 rows ([32, 4], as reduced); their inverses stored. Each is computed
    once (one per thread) and the scales are broadcast back through shared memory."""
    lay_ir: gl.constexpr = amax_ir.type.layout
    one: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [NUM_WARPS, 1], [1, 0])
    rows = (row0 + 4 * gl.arange(0, 32, layout=gl.SliceLayout(1, one))[:, None]
            + gl.arange(0, 4, layout=gl.SliceLayout(0, one))[None, :])
    scale = _scale_from_amax(gl.convert_layout(amax_ir, one), NUM, True)
    gl.store(s_inv_ptr + rows * ((N + 127) // 128) + pid_n, _inverse(scale, True), mask=rows < M)
    return gl.convert_layout(scale, lay_ir)


@gluon.jit
def _col_scales(amax_c, st_inv_ptr, col0, M, N, pid_m, NUM: tl.constexpr):
    """Scales of the tile's 128 columns, as ``_row_scales``."""
    lay_c: gl.constexpr = amax_c.type.layout
    one: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    cols = col0 + gl.arange(0, 128, layout=one)
    scale = _scale_from_amax(gl.convert_layout(amax_c, one), NUM, True)
    gl.store(st_inv_ptr + cols * ((M + 127) // 128) + pid_m, _inverse(scale, True), mask=cols < N)
    return gl.convert_layout(scale, lay_c)


@gluon.jit
def rowcol_kernel(x_ptr, q_ptr, s_inv_ptr, qt32_ptr, st_inv_ptr, M, N, NUM: tl.constexpr,
                  FP8: tl.constexpr):
    """One 128x128 tile of x per program: q (x quantized in 1x128 row tiles, scales ``s_inv``
    [M, cdiv(N, 128)]) and x^T (``qt32``: its bytes as int32 words, [N, M / 4]; scales ``st_inv``
    [N, cdiv(M, 128)]). Power-of-two scales, hardware fp8 cast."""
    # [i, r, c]: row 4 i + r, column c of the tile; a thread holds r = 0..3 and 8 columns (twice).
    lay: gl.constexpr = gl.BlockedLayout([1, 4, 8], [8, 1, 4], [NUM_WARPS // 2, 1, 2], [2, 1, 0])
    lay_ir: gl.constexpr = gl.SliceLayout(2, lay)   # [i, r]: per row
    lay_ic: gl.constexpr = gl.SliceLayout(1, lay)   # [i, c]: per column and row quad
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    r = gl.arange(0, 4, layout=gl.SliceLayout(0, lay_ir))
    rows_ir = pid_m * 128 + 4 * gl.arange(0, 32, layout=gl.SliceLayout(1, lay_ir))[:, None] + r[None, :]
    cols = pid_n * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, lay_ic))
    rows3 = gl.expand_dims(rows_ir, 2)                                   # [32, 4, 1]
    cols3 = gl.expand_dims(gl.expand_dims(cols, 0), 1)                   # [1, 1, 128]
    mask = (rows3 < M) & (cols3 < N)
    offs = rows3.to(tl.int64) * N + cols3
    xf = gl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)      # [32, 4, 128]

    # Row tiles (along N): one scale per row.
    scale_r = _row_scales(_inf_if_nan(_absmax(xf, 2)), s_inv_ptr, pid_m * 128, M, N, pid_n, NUM)
    gl.store(q_ptr + offs, _to_fp8_bits(xf * gl.expand_dims(scale_r, 2), FP8, 0.0, 0, 0, True), mask=mask)

    # Column tiles (x^T's rows, along M): one scale per column; 4 rows' bytes make one word of x^T.
    amax_c = _inf_if_nan(_absmax(_absmax(xf, 1), 0))                     # [128]
    scale_c = _col_scales(amax_c, st_inv_ptr, pid_n * 128, M, N, pid_m, NUM)
    qt = _to_fp8_bits(xf * gl.expand_dims(gl.expand_dims(scale_c, 0), 1), FP8, 0.0, 0, 0, True)
    shift = gl.expand_dims(gl.expand_dims(8 * r, 0), 2)                  # [1, 4, 1]
    words = gl.sum(qt.to(tl.int32) << shift, axis=1)                     # [32, 128], in registers
    quad = pid_m * 32 + gl.arange(0, 32, layout=gl.SliceLayout(1, lay_ic))
    w_offs = gl.expand_dims(cols, 0).to(tl.int64) * (M // 4) + gl.expand_dims(quad, 1)
    w_mask = (gl.expand_dims(quad, 1) < M // 4) & (gl.expand_dims(cols, 0) < N)
    gl.store(qt32_ptr + w_offs, words, mask=w_mask)
