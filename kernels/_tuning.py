"""The kernels' tuning: one frozen dataclass per kernel family, read by the kernels at each call, overridden
only inside a ``with tuning(...)`` block.

[Note: kernel tuning]
Each kernel family has one frozen, validated dataclass of the knobs its launchers read: block sizes, ring
depths, warps, the problem sizes from which a Gluon kernel takes over, and the switches that force a
fallback (the Triton kernel where a Gluon one would run) so that tests and benchmarks can reach it. The
defaults below are the tuned values, each with the measurement it rests on; what a launcher does with them
for one problem is a pure function of the problem's shape and dtype (``pick_ragged`` / ``pick_wgrad`` /
``pick`` choose a ``TileConfig``, the methods below the Gluon kernels' share). Nothing else in ``kernels/``
chooses tuning or paths, and nothing sets attributes on kernel modules: a test or benchmark writes

    with tuning(grouped_gemm=dict(wgrad_gluon=False)):      # fields of one family
        ...
    with tuning(QuantizeTuning(rows_tile_m=16)):            # or a whole family
        ...

and the override ends with the block (nested blocks start from the enclosing one's values; an exception
restores them too). Overrides are process-wide, as the module constants they replace were: a kernel that
launches on another thread (the autograd engine's device threads run backward on CUDA, and a context
variable would not reach them) sees them as well. Blocks must nest; overriding from two threads at once
is not supported (it raises where it can tell). ``tests/test_kernel_tuning.py`` freezes the set of knobs.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any

__all__ = ["GroupedGemmTuning", "GroupedGemmFp8Tuning", "QuantizeTuning", "TokenLayoutTuning", "KernelTuning",
           "tuning", "current"]

_WARPS = (1, 2, 4, 8, 16)


def _require(owner: object, name: str, ok: bool, what: str) -> None:
    """ValueError naming ``owner``'s field ``name``, its value and what it must be, unless ``ok``."""
    if not ok:
        raise ValueError(f"{type(owner).__name__}.{name} must be {what}, got {getattr(owner, name)!r}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _pow2(v: object, lo: int = 1) -> bool:
    return _is_int(v) and v >= lo and not v & (v - 1)  # type: ignore[operator]


def _check_fields(obj: object, rules: dict[str, tuple[Any, str]]) -> None:
    """Validates ``obj``'s fields: ``rules`` maps a field to (predicate, what it must be); bool fields must
    be bools."""
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        v = getattr(obj, f.name)
        if f.type in ("bool", bool):
            _require(obj, f.name, isinstance(v, bool), "a bool")
        elif f.name in rules:
            pred, what = rules[f.name]
            _require(obj, f.name, pred(v), what)


@dataclasses.dataclass(frozen=True)
class GroupedGemmTuning:
    """The bf16 / fp16 / fp32 grouped GEMMs (``kernels/grouped_gemm.py``; tile configs: ``TileConfig``).

    ``wide_tail_max_tokens``: fprop/dgrad run wide tail tiles where the groups average this many tokens or
    fewer ([Note: wide tail tiles]). H200, E=128, K=2048, N=768 (docs/benchmarks.md, "Wide tail tiles"),
    fprop / dgrad TFLOP/s with and without: 128 tokens per group 347 / 351 vs 324 / 324, 160: 437 / 401 vs
    369 / 354; 192: 404 / 388 vs 421 / 392, 224: 396 / 362 vs 462 / 421; at 256 (E=64) 405 / 368 vs 436 /
    409, and at 1024 and 4096 they lose 27-39%: the build with the wide loop runs every full tile slower.

    ``wgrad_gluon``: the accumulating bf16 / fp16 wgrad runs in the Gluon FP8 wgrad kernel (TOKENS_OUTER,
    [Note: the bf16 wgrad in the fp8 kernel]) on Hopper where the groups hold ``wgrad_gluon_min_tokens``
    tokens or more on average (T >= that x E); the Triton kernel otherwise, and always with False (the
    fallback, for tests and benchmarks). H200, chained, tails zero-filled by TMA, medians of interleaved
    rounds: 1.13-1.17x the Triton kernel at 1024 tokens per group (E=64), 1.02-1.05x at 4096 (E=8), 1.09x
    and 1.20x at 512, 1.00x and 1.06x at 256, 0.78x at 128 (E=128; docs/benchmarks.md). A fresh wgrad (in dy's
    dtype, or fp32: a step's first contribution, [Note: a fresh first contribution] in
    ``distwgrad/wgrad/accumulate.py``) runs the Triton kernel by default; fp32, Triton / Gluon ms at E, T,
    K, N = 16, 32768, 2048, 2048: 0.540 / 0.690; 8, 32768, 4096, 14336: 6.31 / 6.21; 64, 65536, 7168, 2048:
    3.80 / 3.85 (H200, one call between two CUDA events, its host launch included; docs/benchmarks/LOG.md,
    2026-12-01). ``wgrad_gluon_stages``: its ring depth; ``wgrad_gluon_epilogue_warps``: 2, an epilogue
    partition writes each tile beside the next tile's MMAs, or 0, the MMA warps write it (what a Triton
    without ``warp_specialize`` pairs runs);
    ``wgrad_gluon_add_mode``: "atomic" (fp32 reductions, one addend per element: deterministic) or "load"
    (load-add-store); ``wgrad_gluon_tail``: a group's last chunk loses the rows past the group's end to TMA's
    zero fill through per-group descriptors ("tma") or to the MMA warps ("zero", what a Triton without the
    allocator setting runs;
    [Note: a group's tail zero-filled by TMA]).
    """

    wide_tail_max_tokens: int = 160
    wgrad_gluon: bool = True
    wgrad_gluon_min_tokens: int = 256
    wgrad_gluon_stages: int = 5
    wgrad_gluon_epilogue_warps: int = 2
    wgrad_gluon_add_mode: str = "atomic"
    wgrad_gluon_tail: str = "tma"

    def __post_init__(self) -> None:
        _check_fields(self, {
            "wide_tail_max_tokens": (lambda v: _is_int(v) and v >= 0, "an int >= 0"),
            "wgrad_gluon_min_tokens": (lambda v: _is_int(v) and v >= 0, "an int >= 0"),
            "wgrad_gluon_stages": (lambda v: _is_int(v) and 2 <= v <= 8, "an int in 2..8 (shared-memory stages)"),
            "wgrad_gluon_epilogue_warps": (lambda v: v in (0, 2) and _is_int(v), "0 or 2"),
            "wgrad_gluon_add_mode": (lambda v: v in ("atomic", "load"), "'atomic' or 'load'"),
            "wgrad_gluon_tail": (lambda v: v in ("tma", "zero"), "'tma' or 'zero'"),
        })

    def wgrad_gluon_wanted(self, num_tokens: int, num_groups: int, accumulate: bool) -> bool:
        """Whether the default dispatch tries the Gluon wgrad for this problem (it then checks that it
        applies: a Hopper GPU, TMA-aligned 16-bit operands)."""
        return self.wgrad_gluon and accumulate and num_tokens >= self.wgrad_gluon_min_tokens * num_groups


@dataclasses.dataclass(frozen=True)
class GroupedGemmFp8Tuning:
    """The FP8 grouped GEMMs (``kernels/grouped_gemm_fp8.py``; tile configs: ``_grouped_gemm_fp8_configs``).

    ``ragged_gluon``: fprop / dgrad with promotion (per-tensor split accumulator, blockwise) run in the
    persistent warp-specialized Gluon kernel where it applies ([Note: promotion under the next MMA]) and
    the contraction is ``ragged_gluon_min_depth_per_tensor`` / ``_blockwise`` deep or more; the Triton
    kernel otherwise, and always with False. H200, vs our bf16 kernels in the same process, Gluon | Triton,
    (E, contraction) (docs/benchmarks/LOG.md, fp8_gemm_gluon_persistent_h200.json):
      per-tensor fprop  1.58 | 1.43 (8, 4096)    1.76 | 1.42 (64, 7168)   0.80 | 1.33 (128, 2048)
      per-tensor dgrad  1.70 | 1.43 (8, 14336)   1.49 | 1.36 (64, 2048)   1.00 | 0.97 (128, 768)
      blockwise fprop   1.44 | 0.94              1.62 | 1.04              1.16 | 0.63
      blockwise dgrad   1.69 | 0.93              1.40 | 0.95              0.89 | 0.80
    E=128 calls take 0.11-0.3 ms and their times are bimodal (fp8_gemm_gluon_persistent_e128_h200.json: two
    more runs, per-tensor fprop 1.49 / 1.50 vs Triton 1.34 / 1.35, dgrad 1.10 / 1.11 vs 0.97 / 0.99;
    blockwise fprop 0.77 / 1.43 vs 0.96 / 1.07, dgrad 1.05 / 1.07 vs 0.80 / 0.82): hence the Gluon kernel
    from 768-deep contractions, both recipes (the shallowest measured; it won there in every run).
    ``ragged_gluon_block_m``: rows per program, 128 (two warpgroups); 64 (one, two programs per SM) ran
    0.98-1.38x bf16 at the large shapes vs 0.99-1.59x (fp8_gemm_gluon_h200_run3.json).
    ``ragged_gluon_stages``: the ring depth (32 KB per stage); 3 ran 0.87-0.94x the speed of 4, 5 0.87-1.03x.

    ``wgrad_gluon``: per-tensor wgrad with the split accumulator runs in the Gluon kernel that promotes
    under the next MMA where it applies ([Note: fp8 wgrad under the next MMA]); the Triton kernel with
    False. With the epilogue partition (docs/benchmarks/LOG.md, fp8_wgrad_epilogue_run2_h200.json),
    accumulating, E=8 / E=64 TFLOP/s: atomic s5 946 / 583 against 827 / 458 without the partition, load
    with its L2 prefetch s5 901 / 345; fresh s5 1010 / 614. ``wgrad_gluon_add_mode``: accumulating,
    "atomic" (fp32 reductions) or "load" (load-add-store); ``wgrad_gluon_stages``: the ring depth (32 KB
    per stage, beside the 64 KB handed-off tile); ``wgrad_gluon_stages_16``: that of a fresh bf16 / fp16
    wgrad, beside a 32 KB handed-off tile ([Note: a 16-bit handoff]); H200, medians of two runs' passes, 6 /
    5 stages: E=64 plain 727 / 688, 712 / 686, aligned 918 / 896, 894 / 888; E=8 plain 1084 / 1093, 1071 /
    1068, aligned 1192 / 1177, 1173 / 1188. ``wgrad_gluon_epilogue_warps``: as ``GroupedGemmTuning``'s.
    ``wgrad_gluon_blockwise``: the blockwise wgrad (1x128 tiles) runs in the same Gluon kernel, each chunk's
    column scales staged with its operands ([Note: blockwise wgrad scales] in ``gluon/grouped_wgrad_fp8.py``);
    ``wgrad_gluon_stages_blockwise``: its ring depth (the scales' slots take shared memory a fifth stage needs).
    The blockwise E=8 layer step (T=32768, K=4096, N=14336) with one choice changed, against the defaults in the
    same process (H200, ``layer_step.py --tunings``): 3 stages 0.983x, epilogue warps 0 0.976x, add mode "load"
    0.986x; ``main_grad`` the same bits in each.
    """

    ragged_gluon: bool = True
    ragged_gluon_min_depth_per_tensor: int = 768
    ragged_gluon_min_depth_blockwise: int = 768
    ragged_gluon_block_m: int = 128
    ragged_gluon_stages: int = 4
    wgrad_gluon: bool = True
    wgrad_gluon_blockwise: bool = True
    wgrad_gluon_stages_blockwise: int = 4
    wgrad_gluon_add_mode: str = "atomic"
    wgrad_gluon_stages: int = 5
    wgrad_gluon_stages_16: int = 6
    wgrad_gluon_epilogue_warps: int = 2

    def __post_init__(self) -> None:
        stages = (lambda v: _is_int(v) and 2 <= v <= 8, "an int in 2..8 (shared-memory stages)")
        _check_fields(self, {
            "ragged_gluon_min_depth_per_tensor": (lambda v: _is_int(v) and v >= 0, "an int >= 0"),
            "ragged_gluon_min_depth_blockwise": (lambda v: _is_int(v) and v >= 0, "an int >= 0"),
            "ragged_gluon_block_m": (lambda v: v in (64, 128) and _is_int(v), "64 or 128 (one warpgroup per 64 rows)"),
            "ragged_gluon_stages": stages,
            "wgrad_gluon_add_mode": (lambda v: v in ("atomic", "load"), "'atomic' or 'load'"),
            "wgrad_gluon_stages": stages,
            "wgrad_gluon_stages_16": stages,
            "wgrad_gluon_stages_blockwise": (lambda v: _is_int(v) and 2 <= v <= 4,
                                             "an int in 2..4 (stages beside the column scales)"),
            "wgrad_gluon_epilogue_warps": (lambda v: v in (0, 2) and _is_int(v), "0 or 2"),
        })

    def ragged_gluon_wanted(self, depth: int, block: int) -> bool:
        """Whether the default dispatch gives a promoting fprop / dgrad of contraction ``depth`` (scale block
        ``block``, 0: per-tensor) to the Gluon kernel where it applies."""
        return self.ragged_gluon and depth >= (self.ragged_gluon_min_depth_blockwise if block
                                               else self.ragged_gluon_min_depth_per_tensor)

    def wgrad_stages(self, fresh_16bit: bool) -> int:
        """The Gluon wgrad's ring depth: a fresh bf16 / fp16 stacked output hands its tiles off in 16 bits
        and has room for ``wgrad_gluon_stages_16``."""
        return self.wgrad_gluon_stages_16 if fresh_16bit else self.wgrad_gluon_stages


@dataclasses.dataclass(frozen=True)
class QuantizeTuning:
    """The FP8 quantize kernels (``kernels/quantize.py``) and the grouped weight quantize
    (``kernels/weights_fp8.py``). Every value only moves speed: each element's arithmetic is the same for
    any tiling. GB/s: H200, 2026-11-29, 8192x16384 bf16 -> e4m3, GB/s of minimal traffic (copy ~4135),
    from ``python qa/bench/kernels.py fp8 --benchmarks quantize --quant-sweep`` (candidates: ``quantize.SWEEP``,
    each checked bit-exact first). Run-to-run noise was +-15-30% (one 128x128 config measured 2682 and 3837
    GB/s in one process), so only differences well beyond that moved a default. Registers: ptxas -v for
    sm_90a, Triton 3.9, bf16 input; "k/SM": programs resident per SM.

    ``per_tensor_block``: elements per program (and amax loop step): 2429, 2432 (two sweeps); 8192: 2294,
    2321. ``per_tensor_warps``: cast 39 regs (12/SM), amax 94 regs (5/SM); 8 warps 2275.
    ``amax_max_programs``: grid cap of the amax pass, bounds the atomics on one address (~8 per SM).
    ``blocks_warps``: 128x128 blocks, one per program: 3837 vs 3781 (4 warps), 3754 (16); 80 regs (3/SM).
    ``rows_tile_m`` / ``rows_warps``: rows per program of the 1x128 row-wise kernel: 3637 (32 rows, 4 warps)
    vs 3634 (8 warps), 2680 (16 rows), 1817-2470 (64 rows); 53 regs (9/SM).
    ``rowcol_warps`` / ``rowcol_maxnreg``: the rows + columns Triton kernel, one 128x128 tile per program;
    8 warps with Triton's ``maxnreg`` 128 (111 regs, 2/SM): 2914, 2723, 2763 (graph), vs 4 warps 2204, 2758,
    2804; 16 warps 1989. ``rowcol_gluon``: the Gluon kernel where it applies ([Note: rows and columns
    without a transpose]): 3096 / 3107 (graph) vs 2505 / 2536 for the Triton kernel; False: the Triton
    kernel. ``weights_tile``: the grouped weight quantize's transposing cast, [tile, tile] tiles.
    """

    per_tensor_block: int = 4096
    per_tensor_warps: int = 4
    amax_max_programs: int = 1024
    blocks_warps: int = 8
    rows_tile_m: int = 32
    rows_warps: int = 4
    rowcol_warps: int = 8
    rowcol_maxnreg: int | None = 128
    rowcol_gluon: bool = True
    weights_tile: int = 64

    def __post_init__(self) -> None:
        warps = (lambda v: v in _WARPS and _is_int(v), f"one of {_WARPS}")
        _check_fields(self, {
            "per_tensor_block": (lambda v: _pow2(v, 128), "a power of two >= 128"),
            "per_tensor_warps": warps,
            "amax_max_programs": (lambda v: _is_int(v) and v >= 1, "an int >= 1"),
            "blocks_warps": warps,
            "rows_tile_m": (lambda v: _pow2(v), "a power of two"),
            "rows_warps": warps,
            "rowcol_warps": warps,
            "rowcol_maxnreg": (lambda v: v is None or (_is_int(v) and 24 <= v <= 255), "None or an int in 24..255"),
            "weights_tile": (lambda v: _pow2(v, 16), "a power of two >= 16"),
        })


@dataclasses.dataclass(frozen=True)
class TokenLayoutTuning:
    """The FP8 x^T transposes (``kernels/token_layout.py``): output columns (token places) ``block_t`` and
    rows (features) ``block_r`` per program. ``transpose_aligned`` finds a program's group once when the
    alignment is a multiple of ``block_t`` (the 128 of the FP8 wgrad's chunks with the default)."""

    block_t: int = 128
    block_r: int = 64

    def __post_init__(self) -> None:
        _check_fields(self, {
            "block_t": (lambda v: _pow2(v, 16), "a power of two >= 16"),
            "block_r": (lambda v: _pow2(v, 16), "a power of two >= 16"),
        })


@dataclasses.dataclass(frozen=True)
class KernelTuning:
    """Every family's tuning: what the kernels read (``current()``)."""

    grouped_gemm: GroupedGemmTuning = GroupedGemmTuning()
    grouped_gemm_fp8: GroupedGemmFp8Tuning = GroupedGemmFp8Tuning()
    quantize: QuantizeTuning = QuantizeTuning()
    token_layout: TokenLayoutTuning = TokenLayoutTuning()


_FAMILIES = {f.name: f.type for f in dataclasses.fields(KernelTuning)}
_CLASSES = {GroupedGemmTuning: "grouped_gemm", GroupedGemmFp8Tuning: "grouped_gemm_fp8",
            QuantizeTuning: "quantize", TokenLayoutTuning: "token_layout"}
_lock = threading.Lock()
_current = KernelTuning()
_open: list[_Scope] = []  # the open blocks, outermost first


def current() -> KernelTuning:
    """The tuning in force: the defaults, or those of the innermost open ``tuning`` block."""
    return _current


def _family_update(family: str, value: object, base: KernelTuning) -> object:
    """The family ``family`` of ``base`` with ``value`` applied: a whole instance, or a dict of fields."""
    cls = type(getattr(base, family))
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"tuning({family}=...) takes a dict of {cls.__name__} fields or a {cls.__name__}, "
                        f"got {type(value).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ValueError(f"tuning: {cls.__name__} has no knob {', '.join(map(repr, unknown))}; its knobs are "
                         f"{', '.join(names)}")
    return dataclasses.replace(getattr(base, family), **value)


def _overrides(families: tuple, named: dict) -> dict:
    """{family name: a family instance or a dict of fields} from ``tuning``'s arguments, checked."""
    out: dict[str, object] = {}
    for fam in families:
        name = _CLASSES.get(type(fam))
        if name is None:
            raise TypeError(f"tuning() takes {', '.join(c.__name__ for c in _CLASSES)} instances positionally, "
                            f"got {type(fam).__name__}")
        out[name] = fam
    for name, value in named.items():
        if name not in _FAMILIES:
            raise ValueError(f"tuning: no kernel family {name!r}; the families are {', '.join(_FAMILIES)}")
        if name in out:
            raise ValueError(f"tuning: the family {name!r} is given twice (as an instance and as {name}=...)")
        out[name] = value
    return out


class _Scope:
    """The block of one ``tuning(...)`` call: on entry its overrides apply on top of the open blocks' (the
    tuning in force is always the defaults with every open block's overrides applied, outermost first), and
    on exit it is gone from that stack."""

    def __init__(self, overrides: dict) -> None:
        self._overrides = overrides

    def _apply(self, base: KernelTuning) -> KernelTuning:
        return dataclasses.replace(base, **{n: _family_update(n, v, base) for n, v in self._overrides.items()})

    def __enter__(self) -> KernelTuning:
        global _current
        with _lock:
            if any(s is self for s in _open):
                raise RuntimeError("tuning: this block is already open; call tuning(...) again for another")
            _current = self._apply(_current)
            _open.append(self)
            return _current

    def __exit__(self, exc_type, exc, tb) -> bool:
        global _current
        with _lock:
            innermost = _open[-1] is self
            _open[:] = [s for s in _open if s is not self]
            _current = functools.reduce(lambda t, s: s._apply(t), _open, KernelTuning())
        if not innermost and exc_type is None:
            raise RuntimeError("tuning: blocks must nest, but a block opened inside this one is still open "
                               "(overrides from two threads at once?)")
        return False


def tuning(*families: object, **overrides: object) -> _Scope:
    """A block in which the kernels run with other tuning (tests and benchmarks only; [Note: kernel tuning]).

    Args:
        *families: whole family instances (``GroupedGemmTuning(...)``, ...), each replacing its family.
        **overrides: a family's name (``grouped_gemm``, ``grouped_gemm_fp8``, ``quantize``,
            ``token_layout``) with a dict of its fields to change (or an instance).

    Returns:
        A context manager; entering it returns the ``KernelTuning`` in force inside.

    Raises:
        ValueError: an unknown family or knob (naming the valid ones), or a value its dataclass refuses;
            checked here, before the block opens.
    """
    scope = _Scope(_overrides(families, overrides))
    scope._apply(_current)  # validates now: a bad knob fails at the call, not at the block's entry
    return scope
