"""bf16 / fp16 fprop and dgrad over ragged token groups in Gluon: persistent and warp-specialized, the
same products as ``grouped_gemm._ragged_m_kernel`` on Hopper.

[Note: persistent warp-specialized grouped GEMM]
One program per SM runs output tiles pid, pid + grid, ... (``_gluon_tiles``: group-major, swizzled in
bands of GROUP_M rows, a group cursor walked forward). One extra warp (the producer) issues the TMA
loads of every K step of every tile into a ring of NUM_STAGES shared-memory stages, waiting only for
the stage's ``empty`` mbarrier; the MMA warps (two warpgroups, 64 rows each) wait on the stage's
``ready`` mbarrier, issue the step's wgmma, wait for all but the newest (``wait_group 1``) and hand the
previous step's stage back. The ring's step count runs on across tiles, so the producer loads the next
tile's first stages while the MMA warps finish this tile's last steps and its epilogue: a
one-program-per-tile kernel starts every tile with an empty ring. In the FP8 kernels the same schedule
ran 1.04-1.29x the one-program-per-tile kernel ([Note: promotion under the next MMA]).
The products are those of the Triton kernel: the same tiles of the same operands, accumulated in fp32 by
the same wgmma instructions in the same K order: the same bits in every GPU test (bf16 and fp16, 5
shapes, fprop and dgrad). Measured on an H200 with 4-byte stores it ran 0.82-0.98x the speed of the
Triton kernel at the three MoE shapes (docs/benchmarks.md), and with 16-byte stores (below) no faster than
it at the two large ones, so it is opt-in (``grouped_gemm.RAGGED_GLUON``): without a
promotion there is no per-step work to hide, persistence saves only the ring's fill, and its 128x256 tile
pads ~128-token groups where the Triton configs shrink the tile. The epilogue stores 16-byte rows through
a layout conversion (``WIDE_STORES``, ``grouped_gemm.RAGGED_GLUON_WIDE_STORES``; [Note: the epilogue's
wide stores] in ``_grouped_gemm_fp8_gluon.py``), as the Triton kernel's does: 1.00-1.15x of storing the
MMA layout's 4-byte pairs and 0.96-1.02x of the Triton kernel at the two large MoE shapes (one run,
docs/benchmarks/LOG.md, gemm_profile_wide_stores_h200.json); its staging buffer fits beside the four stages
(229,444 bytes of shared memory in all). What else was
tried: docs/benchmarks/LOG.md.

Preconditions (``grouped_gemm._gluon_ragged`` checks them): a Hopper GPU (wgmma), a Triton with Gluon,
bf16 or fp16 operands, TMA-aligned, the weight's experts stacked as a 2-D view; dgrad's contraction (the
weight's rows) a multiple of BLOCK_K so that no K step straddles two experts. Fprop reads the weight
K-inner (B's tile rows past an expert's N read the next expert or TMA's zero fill, and only feed output
columns that the store masks); dgrad reads it N-inner (wgmma takes 16-bit B in either order).
Legend as in ``grouped_gemm``: T tokens, K the contraction, N output features, E groups.
"""

from __future__ import annotations

from ._gluon_tiles import AVAILABLE, descriptor, gl, gluon, mbarrier, warpgroup_mma, warpgroup_mma_wait
from ._gluon_tiles import WS_PAIRS as _WS_PAIRS
from ._gluon_tiles import define as _define_tiles
from ._gluon_tiles import tma_load as _tma_load

__all__ = ["AVAILABLE", "BLOCK_M", "BLOCK_N", "BLOCK_K", "ragged_kernel", "descriptor"]

# 128x256x64 (the Triton kernel's tile, picked by its sweeps): one fp32 accumulator of 128 registers per
# MMA thread; 48 KB per stage
BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64


def _define():
    t = _define_tiles()
    _cursor, _origin, _tile, _total_tiles, _store_rows = t.cursor, t.origin, t.tile, t.total_tiles, t.store_rows

    @gluon.jit
    def _produce(a_desc, b_desc, ready, empty, a_bufs, b_bufs, offs_ptr, stride_o, T, N, W_ROWS, n_k, pid, total,
                 nprog, W_TRANS: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr):
        """The TMA warp: ring step g waits until the MMA warps hand its stage back (a fresh mbarrier counts
        as released for the first round), then loads A's [BLOCK_M, BLOCK_K] and B's tile into it."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0] if W_TRANS else b_desc.block_type.shape[1]
        e = pid * 0
        first = e
        base = e
        for tile in range(pid, total, nprog):
            e, first, start, size = _cursor(offs_ptr, stride_o, T, e, first, tile, gl.cdiv(N, BN), BM)
            row0, col0, brow0 = _origin(e, tile - first, start, size, N, W_ROWS, GROUP_M, BM, BN)
            for k in range(n_k):
                g = base + k
                s = g % NUM_STAGES
                mbarrier.wait(empty.index(s), ((g // NUM_STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                _tma_load(a_desc, [row0, k * BK], bar, a_bufs.index(s))
                if W_TRANS:  # fprop: W_e's output rows, the contraction inner
                    _tma_load(b_desc, [brow0, k * BK], bar, b_bufs.index(s))
                else:  # dgrad: W_e's contraction rows (never past the expert: W_ROWS % BK == 0), outputs inner
                    _tma_load(b_desc, [e * W_ROWS + k * BK, col0], bar, b_bufs.index(s))
            base += n_k

    @gluon.jit
    def _consume(a_desc, b_desc, ready, empty, a_bufs, b_bufs, offs_ptr, stride_o, T, N, W_ROWS, n_k, pid, total,
                 nprog, out_ptr, bias_ptr, stride_ot, stride_on, stride_biase, stride_biasn, mma: gl.constexpr,
                 W_TRANS: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr,
                 WIDE_STORES: gl.constexpr):
        """The MMA warps over the producer's tiles, in the same order: the K loop, then the epilogue
        (bias, cast, masked store) while the producer already fills the ring for the next tile."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BN: gl.constexpr = b_desc.block_type.shape[0] if W_TRANS else b_desc.block_type.shape[1]
        e = pid * 0
        first = e
        base = e
        for tile in range(pid, total, nprog):
            e, first, start, size = _cursor(offs_ptr, stride_o, T, e, first, tile, gl.cdiv(N, BN), BM)
            row0, col0, brow0, rows, cols, rows_ok, cols_ok, e64 = _tile(e, tile - first, start, size, N, W_ROWS,
                                                                        mma, GROUP_M, BM, BN)
            acc = gl.zeros([BM, BN], gl.float32, mma)
            for k in range(n_k):
                g = base + k
                s = g % NUM_STAGES
                mbarrier.wait(ready.index(s), (g // NUM_STAGES) & 1)
                if W_TRANS:
                    acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
                else:
                    acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                if k > 0:  # step k-1's MMAs are done: its stage goes back to the producer
                    mbarrier.arrive(empty.index((g - 1) % NUM_STAGES), count=1)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((base + n_k - 1) % NUM_STAGES), count=1)
            base += n_k
            if HAS_BIAS:
                bias = gl.load(bias_ptr + e64 * stride_biase + cols * stride_biasn, mask=cols_ok, other=0.0)
                acc = acc + bias.to(gl.float32)[None, :]
            if WIDE_STORES:  # [Note: the epilogue's wide stores] in _grouped_gemm_fp8_gluon.py
                _store_rows(out_ptr, acc, row0, col0, start + size, N, stride_ot, stride_on, mma)
            else:
                o_ptrs = out_ptr + rows.to(gl.int64)[:, None] * stride_ot + cols[None, :] * stride_on
                gl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=rows_ok[:, None] & cols_ok[None, :])

    @gluon.jit(do_not_specialize=["T", "E"])
    def ragged_kernel(a_desc, b_desc, out_ptr, bias_ptr, offs_ptr, T, E, N, K, W_ROWS,
                      stride_ot, stride_on, stride_biase, stride_biasn, stride_o,
                      W_TRANS: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_E: gl.constexpr,
                      NUM_STAGES: gl.constexpr, num_warps: gl.constexpr, WIDE_STORES: gl.constexpr = False):
        """out[t, :N] = a[t, :K] @ B_e for the tokens t of group e, B_e = W_e^T (fprop, ``W_TRANS``: b_desc
        over the stacked [E * W_ROWS, K] weight, W_ROWS = N) or W_e (dgrad: b_desc over [E * W_ROWS, N],
        W_ROWS = K); [Note: persistent warp-specialized grouped GEMM]."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0] if W_TRANS else b_desc.block_type.shape[1]
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BN, 16])
        pid = gl.program_id(0)
        total = _total_tiles(offs_ptr, stride_o, E, T, gl.cdiv(N, BN), BM, BLOCK_E, num_warps)
        if pid >= total:
            return
        nprog = gl.num_programs(0)
        B0: gl.constexpr = b_desc.block_type.shape[0]
        B1: gl.constexpr = b_desc.block_type.shape[1]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BM, BK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, B0, B1], b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        n_k = gl.cdiv(K, BK)  # >= 1 (the host takes this kernel only for K > 0)
        # (the argument tuples are written out in each call: a tuple variable would turn the constexprs in
        # it into tensors)
        if _WS_PAIRS:
            gl.warp_specialize([
                (_consume, (a_desc, b_desc, ready, empty, a_bufs, b_bufs, offs_ptr, stride_o, T, N, W_ROWS, n_k, pid,
                            total, nprog, out_ptr, bias_ptr, stride_ot, stride_on, stride_biase, stride_biasn, mma,
                            W_TRANS, HAS_BIAS, GROUP_M, NUM_STAGES, WIDE_STORES)),
                (_produce, (a_desc, b_desc, ready, empty, a_bufs, b_bufs, offs_ptr, stride_o, T, N, W_ROWS, n_k, pid,
                            total, nprog, W_TRANS, GROUP_M, NUM_STAGES)),
            ], [1], [24])
        else:
            gl.warp_specialize((a_desc, b_desc, ready, empty, a_bufs, b_bufs, offs_ptr, stride_o, T, N, W_ROWS, n_k,
                                pid, total, nprog, out_ptr, bias_ptr, stride_ot, stride_on, stride_biase,
                                stride_biasn, mma, W_TRANS, HAS_BIAS, GROUP_M, NUM_STAGES, WIDE_STORES),
                               _consume,
                               (a_desc, b_desc, ready, empty, a_bufs, b_bufs, offs_ptr, stride_o, T, N, W_ROWS, n_k,
                                pid, total, nprog, W_TRANS, GROUP_M, NUM_STAGES), [_produce], [1], [24])
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))

    return ragged_kernel


ragged_kernel = _define() if AVAILABLE else None
