"""Tile configurations for ``distwgrad.kernels.grouped_gemm_fp8``.

Same scheme as the bf16 kernels (``_grouped_gemm_configs``): a fixed table, no ``triton.autotune`` (its
benchmark runs cannot happen inside a CUDA-graph capture and would add into an accumulating ``out``
repeatedly). Configs reuse ``TileConfig``; the FP8 kernels support ``add_mode`` "load" and "atomic".

UNTUNED. The kernels run and pass their tests on an H200 with these defaults (docs/benchmarks.md has
their speed), but no candidate below has been timed against another, so no value cites a sweep (house
style rule 17 asks for one); they are starting points, to be replaced from ``qa/bench/fp8.py
--gemm-sweep`` on an H200. What they rest on:
- the bf16 sweeps (H200, 2026-11-29, docs/benchmarks/grouped_gemm.md): fp8 elements are half the bytes,
  so BLOCK_K = 128 moves the bytes of bf16's BLOCK_K = 64 per pipeline stage; the blockwise recipe forces
  it anyway (one K step = one scale block);
- an sm_90a build without a GPU (triton 3.9 + its ptxas, JIT specializations emulated, first MoE shape;
  the recipe behind ``test_compiles_for_sm90``), registers/thread and spill bytes at 128x128x128/w8/s4:
  fprop/dgrad 231-236 (blockwise) and 165 (per-tensor), no spills; wgrad 170-186 (per-tensor), 255 with
  24-32 B of spills (blockwise, accumulating). Every K step of the blockwise path holds a second fp32
  accumulator (the step's dot before scaling): 128x256/w8 and 256x128/w8 spilled 88-250 B in fprop and
  more in wgrad, 128x128/w4 (blockwise) 296-592 B; 64x128/w4/s4-5 built without spills everywhere.
  The masked pointer-load fallback (unaligned layouts) spills in wgrad blockwise (~340-420 B).

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
# Candidates for the sweep (block_k becomes the scale block, 128, in the blockwise recipe). The spill
# notes above: 64-row tiles build spill-free everywhere, the 256-wide ones spill in the blockwise path.
RAGGED_CANDIDATES = (
    _T(128, 128, 128, num_warps=8, num_stages=4), _T(128, 128, 128, num_warps=8, num_stages=3),
    _T(64, 128, 128, num_warps=4, num_stages=5), _T(128, 256, 128, num_warps=8, num_stages=3),
    _T(256, 128, 128, num_warps=8, num_stages=3), _T(128, 128, 128, num_warps=8, num_stages=5),
    _T(128, 128, 128, group_m=16, num_warps=8, num_stages=4),
    _T(128, 128, 128, group_m=4, num_warps=8, num_stages=4),
)
WGRAD_CANDIDATES = (  # "load" configs serve the fresh wgrad too; the benchmark times the others accumulating
    _T(128, 128, 128, num_warps=8, num_stages=4), _T(64, 128, 128, num_warps=4, num_stages=4),
    _T(256, 128, 128, num_warps=8, num_stages=3),
    _T(128, 128, 128, num_warps=8, num_stages=4, add_mode="atomic"),
    _T(128, 128, 128, num_warps=8, num_stages=3, add_mode="atomic"),
    _T(64, 128, 128, num_warps=4, num_stages=4, add_mode="atomic"),
)


def with_block_k(cfg: TileConfig, block: int) -> TileConfig:
    """``cfg`` for the blockwise recipe: one K step per scale block (block > 0), else ``cfg`` as is."""
    if block and cfg.block_k != block:
        return dataclasses.replace(cfg, block_k=block)
    return cfg


def pick(op: str, *, block: int, accumulate: bool, smem_limit: int | None) -> TileConfig:
    """Config for ``op`` in ("fprop", "dgrad", "wgrad"); ``block`` the scale block (0: per-tensor)."""
    # 128x128x128/w8/s4 everywhere: spill-free in fprop/dgrad and per-tensor wgrad (see above).
    if op == "wgrad" and accumulate:  # bf16: "atomic" beat "load" at every shape (round 2)
        cfg = TileConfig(128, 128, 128, num_warps=8, num_stages=4, add_mode="atomic")
    else:
        cfg = TileConfig(128, 128, 128, num_warps=8, num_stages=4)
    return _fit(with_block_k(cfg, block), 1, smem_limit)
