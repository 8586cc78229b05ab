"""Rows + columns 1x128 FP8 quantization in Gluon: the bits of ``quantize._quantize_rowcol_kernel``, with a
register layout chosen by hand so that x^T leaves without a trip through shared memory.

[Note: rows and columns without a transpose]
The Triton kernel lets the compiler transpose x^T's fp8 bytes through shared memory (~24 SASS instructions per
element against ~8.5 for rows only). Here each thread holds a 4x8 block (4 rows, 8 columns: ``BlockedLayout([1,
4, 8], ...)`` over the tile seen as [32, 4, 128]): a column's 4 bytes in a thread are consecutive in x^T's row,
so they are packed into one 32-bit word and stored directly (whole 32-byte sectors, no shared memory, no
shuffles). Each reduced amax moves to one thread (``gl.convert_layout``, kept where written, unlike in Triton),
which computes the scale once and broadcasts it. The Triton kernel's helpers (``_scale_from_amax``,
``_inverse``, ``_to_fp8_bits``) keep the bits identical. Measurements: docs/benchmarks/LOG.md.
Taken for a 128 tile, power-of-two scales, M % 4 == 0 (x^T is written in 4-byte words), CUDA sm_90+ and a
Triton with Gluon; otherwise, and in the interpreter, the Triton kernel. If it does not build, the first call
warns once and every call takes the Triton kernel (``quantize._launch_gluon_rowcol``).
"""

import triton.language as tl

from .._quantize_kernels import _absmax, _inf_if_nan, _inverse, _scale_from_amax, _to_fp8_bits
from . import AVAILABLE, gl, gluon

__all__ = ["AVAILABLE", "L", "NUM_WARPS", "rowcol_kernel"]

L = 128           # the tile (the recipe's 1x128 scaling tile, both ways)
NUM_WARPS = tl.constexpr(8)  # the layouts below spread a tile over 8 warps


@gluon.jit
def _row_scales(amax_ir, s_inv_ptr, row0, M, N, pid_n, NUM: tl.constexpr):
    """Scales of the tile's 128 rows ([32, 4]), each computed by one thread, broadcast back; inverses stored."""
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
    """One 128x128 tile per program: q in 1x128 row tiles (``s_inv`` [M, cdiv(N, 128)]) and x^T as int32 words
    ``qt32`` [N, M / 4] (``st_inv`` [N, cdiv(M, 128)]). Power-of-two scales, hardware fp8 cast."""
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
