"""Tile configurations for ``distwgrad.kernels.grouped_gemm_fp8``.

A fixed table of ``TileConfig``, as for bf16 (``_grouped_gemm_configs``: no ``triton.autotune``); the FP8 kernels
support ``add_mode`` "load" and "atomic". ``pick`` cites the H200 sweep (``qa/bench/kernels.py fp8 --gemm-sweep``,
docs/benchmarks/LOG.md) as ratios to our bf16 kernels. BLOCK_K = 128 moves the bytes of bf16's 64 per stage and
is the blockwise scale block anyway; the blockwise path holds a second fp32 accumulator per K step, so tiles
wider than 128x128 spill there (sm_90a builds) and ran slower. Legend (kernel view): ``_grouped_gemm_configs``.
"""

from __future__ import annotations

import dataclasses

from ._grouped_gemm_configs import TileConfig, _fit

__all__ = ["INTERPRETER", "RAGGED_CANDIDATES", "WGRAD_CANDIDATES", "ADD_MODES", "pick", "with_block_k"]

ADD_MODES = ("load", "atomic")  # of TileConfig.add_mode; "tma_add" is bf16-only so far

# TRITON_INTERPRET=1: small M/N tiles so test shapes have several tiles per group and masked edges;
# BLOCK_K 32 (the smallest fp8 tl.dot depth on GPUs) so per-tensor K loops have several steps.
INTERPRETER = TileConfig(32, 32, 32, group_m=2, num_warps=1, num_stages=1)

_T = TileConfig
# Candidates for the sweep (block_k becomes the scale block, 128, in the blockwise recipe). The spill
# notes above: 64-row tiles build spill-free everywhere, the 256-wide ones spill in the blockwise path.
RAGGED_CANDIDATES = (
    _T(128, 128, 128, num_warps=8, num_stages=4), _T(128, 128, 128, num_warps=8, num_stages=3),
    _T(64, 128, 128, num_warps=4, num_stages=5), _T(128, 256, 128, num_warps=8, num_stages=3),
    _T(256, 128, 128, num_warps=8, num_stages=3), _T(128, 128, 128, num_warps=8, num_stages=5),
    _T(128, 128, 128, group_m=16, num_warps=8, num_stages=4),
    _T(128, 128, 128, group_m=4, num_warps=8, num_stages=4),
    _T(256, 128, 128, num_warps=8, num_stages=4), _T(256, 128, 128, group_m=16, num_warps=8, num_stages=3),
    _T(128, 256, 128, num_warps=8, num_stages=4),
)
WGRAD_CANDIDATES = (  # "load" configs serve the fresh wgrad too; the benchmark times the others accumulating
    _T(128, 128, 128, num_warps=8, num_stages=4), _T(64, 128, 128, num_warps=4, num_stages=4),
    _T(256, 128, 128, num_warps=8, num_stages=3),
    _T(128, 128, 128, num_warps=8, num_stages=4, add_mode="atomic"),
    _T(128, 128, 128, num_warps=8, num_stages=3, add_mode="atomic"),
    _T(64, 128, 128, num_warps=4, num_stages=4, add_mode="atomic"),
    # the old tile prefetched into L2 under the main loop (bf16: 115 vs 91 TFLOP/s at ~128 tokens per
    # expert, docs/benchmarks/LOG.md round 7)
    _T(64, 128, 128, num_warps=4, num_stages=4, add_mode="atomic", l2_prefetch=True),
    _T(128, 128, 128, num_warps=8, num_stages=4, add_mode="atomic", l2_prefetch=True),
)


def with_block_k(cfg: TileConfig, block: int) -> TileConfig:
    """``cfg`` for the blockwise recipe: one K step per scale block (block > 0), else ``cfg`` as is."""
    if block and cfg.block_k != block:
        return dataclasses.replace(cfg, block_k=block)
    return cfg


def pick(op: str, *, block: int, accumulate: bool, smem_limit: int | None,
         tokens_per_group: float = 0.0, split_accumulator: bool = True) -> TileConfig:
    """Config for ``op`` ("fprop", "dgrad", "wgrad"); ``block``: the scale block (0: per-tensor); ``tokens_per_group``:
    T / E, known without a sync; ``split_accumulator=False`` frees registers ([Note: fp8 split accumulator])."""
    if op not in ("fprop", "dgrad", "wgrad"):
        raise ValueError(f"pick: op must be 'fprop', 'dgrad' or 'wgrad', got {op!r}")
    if op == "wgrad":
        # 64x128/w4/s4, both recipes. Fresh, vs bf16: per-tensor 1.08 / 0.70 (128x128/w8: 1.11 / 0.64),
        # blockwise 0.82 / 0.58 (128x128/w8: 0.63 / 0.44). Accumulating, "atomic" vs "load": per-tensor
        # 1.15 / 0.91 vs 1.08 / 0.80, blockwise 0.87 / 0.77 vs 0.84 / 0.68.
        # Accumulating at < 512 tokens per group, the old tile prefetched into L2 under the main loop
        # (docs/benchmarks/LOG.md, fp8_wgrad_l2pf_h200.json, one run): ~128/expert per-tensor 67 vs 59 TFLOP/s,
        # blockwise 64 vs 56; ~1024/expert 367 vs 376 and 314 vs 314 (so not there).
        cfg = TileConfig(64, 128, 128, num_warps=4, num_stages=4, add_mode="atomic" if accumulate else "load",
                         l2_prefetch=accumulate and tokens_per_group < 512)
    elif not block and not split_accumulator and tokens_per_group >= 1024:
        # per-tensor without the split accumulator (one fp32 accumulator: 128 registers at 128x256/w8),
        # docs/benchmarks/LOG.md, fp8_gemm_sweep_split_acc_h200.json: fprop 1.84 / 1.80 (256x128/s3: 1.77 / 1.67;
        # 128x128/s3: 1.73 / 1.68), dgrad on the N-contiguous weight 2.02 / 1.88 (256x128/s3: 1.86 / 1.73).
        cfg = TileConfig(128, 256, 128, num_warps=8, num_stages=3)
    elif not block and tokens_per_group >= 1024:
        # per-tensor fprop 1.43 / 1.41 (128x128/w8/s4: 1.24 / 1.31; 128x256: 1.26 / 1.37), dgrad on the
        # N-contiguous weight 1.41 / 1.33 (128x128: 1.25 / 1.20). 256 rows need groups that fill them.
        cfg = TileConfig(256, 128, 128, num_warps=8, num_stages=3)
    elif block:
        # blockwise fprop 0.97 / 1.06, dgrad 0.97 / 0.95 at s3 (s4: 0.96 / 1.02, 0.95 / 0.95); the wider
        # tiles spill (above) and ran at 0.5-0.8x of these.
        cfg = TileConfig(128, 128, 128, num_warps=8, num_stages=3)
    else:  # per-tensor, small groups: not swept; the spill-free 128x128 tile
        cfg = TileConfig(128, 128, 128, num_warps=8, num_stages=4)
    return _fit(with_block_k(cfg, block), 1, smem_limit)
