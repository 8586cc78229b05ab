"""Tile configurations for ``distwgrad.kernels.grouped_gemm``, and the accuracy bound that accepts them.

A fixed table, not ``triton.autotune``: autotune benchmarks on a new key's first call, which cannot run inside a
CUDA-graph capture and would corrupt the accumulating wgrad (its runs add into ``out``). The candidates are
timed by ``qa/bench/kernels.py gemm --sweep``.

Legend (kernel view): ``C[M, N] (+)= A[M, K] @ B[K, N]``. fprop: M one expert's tokens, N out-, K in-features;
dgrad: N in-, K out-features; wgrad: M out-, N in-features, K one expert's tokens (ragged reduction).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ._tuning import GroupedGemmTuning

__all__ = ["TileConfig", "INTERPRETER", "RAGGED_CANDIDATES", "WGRAD_CANDIDATES", "WGRAD_ACC_CANDIDATES",
           "pick_ragged",
           "pick_wgrad", "smem_bytes", "error_vs_oracle"]


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One launch configuration. ``group_m``: M tiles sharing one column of B (L2 reuse). ``add_mode``
    (accumulating wgrad only): "load" reads the old fp32 tile after the main loop, "atomic" fp32 reductions in
    L2 (deterministic: one addend per element), "tma_add" one bulk tensor reduction per tile (Hopper, stacked
    16-byte-aligned ``out``; else "atomic"). ``tma=False``: masked pointer loads (the launcher's ``use_tma`` wins).
    ``l2_prefetch`` (accumulating wgrad): [Note: L2 prefetch of the accumulated tile] in kernels/_grouped_wgrad.py.
    ``half_tail`` / ``wide_tail`` (fprop/dgrad, ``block_m`` >= 32): a group's last tile of <= ``block_m`` / 2 rows
    runs a half-height MMA / joins the tile before it ([Note: half tail tiles], [Note: wide tail tiles])."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    add_mode: str = "load"
    tma: bool = True
    l2_prefetch: bool = False
    half_tail: bool = False
    wide_tail: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"TileConfig.{name} must be a power of two >= 16 (tl.dot), got {v}")
        if self.group_m < 1 or self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"bad TileConfig: group_m={self.group_m}, num_warps={self.num_warps}, "
                             f"num_stages={self.num_stages}")
        if self.add_mode not in ("load", "atomic", "tma_add"):
            raise ValueError(f"TileConfig.add_mode must be 'load', 'atomic' or 'tma_add', got {self.add_mode!r}")
        for name in ("half_tail", "wide_tail"):
            if getattr(self, name) and self.block_m < 32:
                raise ValueError(f"TileConfig: {name} needs block_m >= 32 (a half tile is a tl.dot of 16 rows or "
                                 f"more), got block_m={self.block_m}")
        if self.l2_prefetch and self.block_n < 32:
            raise ValueError(f"TileConfig: l2_prefetch needs block_n >= 32 (one 128-byte line), got "
                             f"block_n={self.block_n}")

    def short(self) -> str:
        mode = "" if self.add_mode == "load" else f"/{self.add_mode}"
        flags = ("" if self.tma else "/ptr") + ("/l2pf" if self.l2_prefetch else "")
        flags += ("/half" if self.half_tail else "") + ("/wide" if self.wide_tail else "")
        return (f"{self.block_m}x{self.block_n}x{self.block_k}/g{self.group_m}/w{self.num_warps}"
                f"/s{self.num_stages}{mode}{flags}")


# Tiny tiles for TRITON_INTERPRET=1: several tiles per group and masked edges at test shapes.
INTERPRETER = TileConfig(16, 16, 16, group_m=2, num_warps=1, num_stages=1)

# Candidates that ``qa/bench/kernels.py gemm --sweep`` times (bf16, H200). Rounds and their results are
# in docs/benchmarks/LOG.md (the candidates that never came within 5% of the best are no longer timed).
# Wgmma wants 64 rows per warpgroup; 128x128/w4/s3 (96 KB of shared memory) lets two programs share an
# SM, so one's epilogue overlaps the other's main loop.
_T = TileConfig
RAGGED_CANDIDATES = (
    _T(128, 256, 64, num_warps=8, num_stages=3), _T(128, 256, 64, num_warps=8, num_stages=4),
    _T(256, 128, 64, num_warps=8, num_stages=3), _T(256, 128, 64, num_warps=8, num_stages=4),
    _T(128, 128, 64, num_warps=4, num_stages=3),
    # Round 9: half tail tiles ([Note: half tail tiles] in kernels/_grouped_ragged.py) on the 128-row tiles;
    # 128x128 with 4 warps leaves room for two (x64/s3, 96 KB) or three (x32/s4, 64 KB) programs per SM.
    _T(128, 256, 64, num_warps=8, num_stages=4, half_tail=True),
    _T(128, 256, 64, num_warps=8, num_stages=3, half_tail=True),
    _T(128, 128, 64, num_warps=4, num_stages=3, half_tail=True),
    _T(128, 128, 32, num_warps=4, num_stages=4, half_tail=True),
    _T(128, 128, 64, num_warps=4, num_stages=3, half_tail=True, tma=False),
    _T(128, 256, 64, num_warps=8, num_stages=4, half_tail=True, tma=False),
    # Round 10: other K depths of a stage at ~128 tokens per expert (none beat the default;
    # docs/benchmarks/LOG.md).
    _T(128, 256, 32, num_warps=8, num_stages=6, half_tail=True),
    _T(128, 256, 32, num_warps=8, num_stages=8, half_tail=True),
    _T(128, 256, 128, num_warps=8, num_stages=2, half_tail=True),
    _T(128, 128, 128, num_warps=8, num_stages=3, half_tail=True),
    # wide tail tiles ([Note: wide tail tiles] in kernels/_grouped_ragged.py): s4 needs 229,408 bytes of shared
    # memory (its wide stage is 56 KB), s3 172,056 (sm_90a builds)
    _T(128, 256, 64, num_warps=8, num_stages=4, half_tail=True, wide_tail=True),
    _T(128, 256, 64, num_warps=8, num_stages=3, half_tail=True, wide_tail=True),
)
# No 64-row fprop/dgrad tiles: they lost at ~128 tokens per expert too (round 5, docs/benchmarks/LOG.md).
WGRAD_CANDIDATES = (
    _T(256, 128, 64, num_warps=8, num_stages=3), _T(256, 128, 64, num_warps=8, num_stages=4),
    _T(128, 256, 64, num_warps=8, num_stages=4), _T(128, 128, 64, num_warps=4, num_stages=3),
    _T(128, 128, 32, num_warps=4, num_stages=4),
)
WGRAD_ACC_CANDIDATES = (
    _T(128, 128, 32, num_warps=4, num_stages=4),
    _T(128, 128, 64, num_warps=4, num_stages=3, add_mode="atomic"),
    _T(128, 128, 32, num_warps=4, num_stages=4, add_mode="atomic"),
    _T(256, 128, 64, num_warps=8, num_stages=3, add_mode="atomic"),
    _T(128, 256, 64, num_warps=8, num_stages=3, add_mode="atomic"),
    _T(128, 128, 64, num_warps=4, num_stages=3, add_mode="tma_add"),
    _T(128, 128, 32, num_warps=4, num_stages=4, add_mode="tma_add"),
    _T(128, 128, 64, num_warps=8, num_stages=3, add_mode="tma_add"),
    _T(256, 128, 64, num_warps=8, num_stages=2, add_mode="tma_add"),
    _T(128, 128, 32, num_warps=4, num_stages=4, add_mode="atomic", tma=False),
    # Round 7: the old tile prefetched into L2 under the main loop ([Note: L2 prefetch of the accumulated
    # tile]), on the picks of rounds 2-4 at each shape.
    _T(128, 256, 64, num_warps=8, num_stages=3, add_mode="atomic", l2_prefetch=True),
    _T(128, 128, 32, num_warps=4, num_stages=4, l2_prefetch=True),
    _T(128, 128, 32, num_warps=4, num_stages=4, add_mode="atomic", l2_prefetch=True),
    _T(128, 128, 32, num_warps=4, num_stages=4, add_mode="tma_add", l2_prefetch=True),
    _T(128, 128, 32, num_warps=4, num_stages=4, add_mode="atomic", tma=False, l2_prefetch=True),
)


def smem_bytes(cfg: TileConfig, elem_bytes: int) -> int:
    """Shared memory of the operand ring (the epilogue may need more); wide tail stages hold block_m / 2 more rows."""
    rows = cfg.block_m + (cfg.block_m // 2 if cfg.wide_tail else 0)
    return cfg.num_stages * (rows + cfg.block_n) * cfg.block_k * elem_bytes


def _fit(cfg: TileConfig, elem_bytes: int, smem_limit: int | None, margin: int = 8192) -> TileConfig:
    """Drops stages, then halves N, until the operand ring plus ``margin`` bytes fits ``smem_limit``."""
    if smem_limit is None:
        return cfg
    while smem_bytes(cfg, elem_bytes) + margin > smem_limit:
        if cfg.num_stages > 2:
            cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_n > 32:
            cfg = dataclasses.replace(cfg, block_n=cfg.block_n // 2)
        else:
            break
    return cfg


# The tables below cite the H200 sweeps (bf16, TFLOP/s, median of do_bench; rounds 1 and 2 on
# 2026-11-29, averaged where both timed a config: one config moved by up to 10% between rounds) at the
# three benchmark shapes, named by tokens per expert: 4096 (E=8, K=4096, N=14336), 1024 (E=64, K=7168,
# N=2048) and 128 (E=128, K=2048, N=768). Other GPUs and dtypes get the same tiles, shrunk to fit.


_DEFAULTS = GroupedGemmTuning()
# The fprop/dgrad kernel stages no epilogue in shared memory: its sm_90a builds use the ring plus 32 bytes
# of barriers (196,640 bytes at 128x256x64/s4; 229,408 with wide tails), so a 1 KB margin suffices there.
_RAGGED_SMEM_MARGIN = 1024


def pick_ragged(*, num_tokens: int, num_groups: int, n: int, k: int, elem_bytes: int,
                smem_limit: int | None, tuning: GroupedGemmTuning = _DEFAULTS) -> TileConfig:
    """Config for fprop/dgrad (ragged M); wide tails where groups average <= ``tuning.wide_tail_max_tokens``."""
    del n, k
    # 128x256x64/w8, fprop/dgrad. 4096/expert: s4 666/715 vs s3 666/690; 1024: s4 648/585 vs s3
    # 652/595; 128: s4 322/317 vs s3 315/309. 256x128x64/w8 (round 2, better of s3/s4): 676/699,
    # 600/570, 302/261. 64-row tiles (round 1) lost at every shape, by 5-10%. Half tail tiles (round 9,
    # docs/benchmarks/LOG.md, grouped_gemm_half_tail_h200.json): 128/expert 331/331 vs 319/312, the large shapes
    # unchanged; with them on, 128x128x64/w4/s3, 128x128x32/w4/s4 and pointer loads came within 3% or lost
    # at 128, 256 and 512 tokens per expert (grouped_gemm_ragged_sweep_round9_h200.json).
    wide = num_tokens <= tuning.wide_tail_max_tokens * max(num_groups, 1)
    return _fit(TileConfig(128, 256, 64, num_warps=8, num_stages=4, half_tail=True, wide_tail=wide), elem_bytes,
                smem_limit, margin=_RAGGED_SMEM_MARGIN)


def pick_wgrad(*, num_tokens: int, num_groups: int, n: int, k: int, elem_bytes: int,
               smem_limit: int | None, accumulate: bool) -> TileConfig:
    """Config for wgrad (ragged K), fresh or accumulating."""
    del n, k
    big = num_tokens / max(num_groups, 1) >= 2048
    if accumulate:
        # add_mode "atomic" beat "load" at every shape (round 2): 4096/expert 629 (256x128x64/w8/s3)
        # vs 552; 1024: 397 (128x128x32/w4/s4) vs 362; 128: 81 vs 75.
        # Round 3, "tma_add" vs "atomic": 602 vs 621, 414 vs 392, 81 vs 80. Round 4 (all candidates
        # in one run): 4096/expert 128x256x64/w8/s3/atomic 641 vs 256x128x64 589; 1024: 128x128x32/
        # w4/s4/tma_add 421 vs atomic 397 (the second run in which tma_add led at 1024); 128/expert:
        # pointer loads 91 vs TMA 80 (a group's ~4 token steps do not amortize the descriptor loads).
        # "tma_add" falls back to "atomic" where it cannot run (lists of buffers, odd strides).
        # Round 7 (docs/benchmarks/LOG.md, grouped_gemm_wgrad_sweep_round7_h200.json, one run), the old tile
        # prefetched into L2 under the main loop: 128/expert 115 vs 91 TFLOP/s (the fp32 traffic caps
        # that shape at 127), 1024: 398-409 vs 431-434 (so not there), 4096: 639 vs 601 / 623 (within
        # that run's spread of the same config; not taken).
        tokens_per_group = num_tokens / max(num_groups, 1)
        if big:
            cfg = TileConfig(128, 256, 64, num_warps=8, num_stages=3, add_mode="atomic")
        elif tokens_per_group >= 512:
            cfg = TileConfig(128, 128, 32, num_warps=4, num_stages=4, add_mode="tma_add")
        else:
            cfg = TileConfig(128, 128, 32, num_warps=4, num_stages=4, add_mode="atomic", tma=False, l2_prefetch=True)
    elif big:  # 256x128x64/w8/s3 676 vs 128x256x64/w8/s4 664, 128x128x32/w4/s4 626
        cfg = TileConfig(256, 128, 64, num_warps=8, num_stages=3)
    else:      # 1024/expert: 128x128x32/w4/s4 601 vs 128x128x64/w4/s3 580; 128/expert: 246 vs 184
        cfg = TileConfig(128, 128, 32, num_warps=4, num_stages=4)
    return _fit(cfg, elem_bytes, smem_limit)


# ---- accuracy bound (tests and the benchmark's pre-timing check share it) ---------------------------
# [Note: grouped gemm error bound]
# A low-precision GEMM is judged against an fp64 oracle relative to the error the in-package torch
# reference makes at the same precision: ours must satisfy err(ours) <= RATIO * err(reference) + floor,
# measured both in the Frobenius norm (overall accuracy) and in the max norm (a single bad tile). Both
# implementations round every output once to the output dtype after fp32 accumulation, so their errors
# agree to within a rounding step; RATIO = 2 leaves room for a different summation order and for the
# fused fp32 accumulate (which rounds less than the reference's bf16 GEMM + add). The floor (1e-5 of the
# oracle's norm, ~100 fp32 ulps) covers cases where the reference happens to be exact, e.g. fp32 data.
# A wrong or unwritten tile errs by O(|value|) and a NaN-poisoned one fails outright.
ERROR_RATIO = 2.0
ERROR_FLOOR = 1e-5


def error_vs_oracle(ours: torch.Tensor, reference: torch.Tensor, oracle: torch.Tensor) -> dict:
    """Errors of ``ours`` and ``reference`` against the fp64 ``oracle``; ``ok`` applies the bound above."""
    o = oracle.double()
    res = {}
    for norm in ("fro", "max"):
        def dist(t, norm=norm):
            d = (t.double() - o).flatten()
            return float(torch.linalg.vector_norm(d, 2 if norm == "fro" else math.inf))
        scale = float(torch.linalg.vector_norm(o.flatten(), 2 if norm == "fro" else math.inf))
        e_ours, e_ref = dist(ours), dist(reference)
        bound = ERROR_RATIO * e_ref + ERROR_FLOOR * scale
        res[norm] = {"ours": e_ours, "reference": e_ref, "bound": bound,
                     "ok": bool(e_ours <= bound)}  # NaN compares False
    res["ok"] = res["fro"]["ok"] and res["max"]["ok"]
    return res
