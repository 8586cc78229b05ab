"""Tile configurations for ``distwgrad.kernels.grouped_gemm_fp8``.

Same scheme as the bf16 kernels (``_grouped_gemm_configs``): a fixed table, no ``triton.autotune`` (its
benchmark runs cannot happen inside a CUDA-graph capture and would add into an accumulating ``out``
repeatedly). Configs reuse ``TileConfig``; the FP8 kernels support ``add_mode`` "load" and "atomic".

UNMEASURED. No GPU run of the FP8 kernels exists yet, so nothing below cites a measurement (house style
rule 17 asks for one); the values are starting points derived from the bf16 sweeps (H200, 2026-11-29,
docs/benchmarks/grouped_gemm.md) by this reasoning, to be replaced by ``qa/bench/fp8.py --gemm-sweep``:
- fp8 elements are half the bytes of bf16, so BLOCK_K = 128 moves the same bytes per pipeline stage as
  bf16's BLOCK_K = 64, and is what the blockwise recipe forces anyway (one K step = one scale block);
- every K step of the blockwise path (and of the per-tensor path, which promotes the tensor-core partial
  sum into the fp32 accumulator each step: ``max_num_imprecise_acc``) holds a second fp32 accumulator,
  so a 128x256 tile on 8 warps would need ~256 accumulator registers per thread and spill: the default
  is 128x128 on 8 warps (2 x 64 registers), 4 stages (128 KB of shared memory).

Legend (kernel view) as in ``_grouped_gemm_configs``: fprop/dgrad tile ragged token rows x features,
wgrad tiles the fixed [N, K] output and reduces over each group's tokens.
"""

from __future__ import annotations

import dataclasses

from ._grouped_gemm_configs import TileConfig, _fit

__all__ = ["INTERPRETER", "RAGGED_CANDIDATES", "WGRAD_CANDIDATES", "ADD_MODES", "pick", "with_block_k"]

ADD_MODES = ("load", "atomic")  # of TileConfig.add_mode; "prefetch" and "tma_add" are bf16-only so far

# TRITON_INTERPRET=1: small M/N tiles so test shapes have several tiles per group and masked edges;
# BLOCK_K 32 (the smallest fp8 tl.dot depth on GPUs) so per-tensor K loops have several steps.
INTERPRETER = TileConfig(32, 32, 32, group_m=2, num_warps=1, num_stages=1)

_T = TileConfig
# Candidates for the sweep. block_k is replaced by the scale block (128) in the blockwise recipe.
RAGGED_CANDIDATES = (
    _T(128, 128, 128, num_warps=8, num_stages=4), _T(128, 128, 128, num_warps=4, num_stages=4),
    _T(128, 256, 128, num_warps=8, num_stages=3), _T(256, 128, 128, num_warps=8, num_stages=3),
    _T(64, 128, 128, num_warps=4, num_stages=5),
)
WGRAD_CANDIDATES = (
    _T(128, 128, 128, num_warps=8, num_stages=4), _T(128, 128, 128, num_warps=4, num_stages=4),
    _T(256, 128, 128, num_warps=8, num_stages=3), _T(128, 128, 64, num_warps=4, num_stages=5),
    _T(128, 128, 128, num_warps=8, num_stages=4, add_mode="atomic"),
    _T(128, 128, 128, num_warps=4, num_stages=4, add_mode="atomic"),
)


def with_block_k(cfg: TileConfig, block: int) -> TileConfig:
    """``cfg`` for the blockwise recipe: one K step per scale block (block > 0), else ``cfg`` as is."""
    if block and cfg.block_k != block:
        return dataclasses.replace(cfg, block_k=block)
    return cfg


def pick(op: str, *, block: int, accumulate: bool, smem_limit: int | None) -> TileConfig:
    """Config for ``op`` in ("fprop", "dgrad", "wgrad"); ``block`` the scale block (0: per-tensor)."""
    if op == "wgrad" and accumulate:  # bf16: "atomic" beat "load" at every shape (round 2)
        cfg = TileConfig(128, 128, 128, num_warps=8, num_stages=4, add_mode="atomic")
    else:
        cfg = TileConfig(128, 128, 128, num_warps=8, num_stages=4)
    return _fit(with_block_k(cfg, block), 1, smem_limit)
