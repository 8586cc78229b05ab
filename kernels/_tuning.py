"""The kernels' tuning: one frozen dataclass per kernel family, read by the kernels at each call, overridden
only inside a ``with tuning(...)`` block.

[Note: kernel tuning]
Each family's dataclass holds the knobs its launchers read (blocks, ring depths, warps, where a Gluon kernel takes
over, switches forcing the Triton fallback); defaults are the tuned values (docs/benchmarks/LOG.md), and a
launcher's choice is a pure function of shape and dtype. Nothing else in ``kernels/`` chooses tuning or paths,
and nothing sets attributes on kernel modules: tests write ``with tuning(grouped_gemm_fp8=dict(wgrad_gluon=False)):``
(fields of one family) or ``with tuning(QuantizeTuning(rows_tile_m=16)):`` (a whole family). An override ends
with its block, exception or not; nested blocks start from the enclosing one's values. Overrides are
process-wide, not a context variable, so that backward on the autograd engine's device threads sees them;
blocks must nest, and overriding from two threads at once is unsupported (it raises where it can tell).
``tests/test_kernel_tuning.py`` freezes the set of knobs.
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
    """Validate ``obj``'s fields against ``rules`` {field: (predicate, what it must be)}; bools must be bools."""
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

    ``wide_tail_max_tokens``: fprop/dgrad run wide tail tiles up to this many tokens per group on average ([Note:
    wide tail tiles]); beyond, the wide loop slows every full tile."""

    wide_tail_max_tokens: int = 160

    def __post_init__(self) -> None:
        _check_fields(self, {
            "wide_tail_max_tokens": (lambda v: _is_int(v) and v >= 0, "an int >= 0"),
        })


@dataclasses.dataclass(frozen=True)
class GroupedGemmFp8Tuning:
    """The FP8 grouped GEMMs (``kernels/grouped_gemm_fp8.py``; tile configs: ``_grouped_gemm_fp8_configs``).

    ``ragged_gluon``: promoting fprop / dgrad run in the Gluon kernel ([Note: promotion under the next MMA]) where it
    applies and the contraction is ``ragged_gluon_min_depth_*`` deep or more (768: the shallowest measured, where it
    won every run); ``ragged_gluon_block_m``: rows per program (one warpgroup per 64). ``wgrad_gluon`` /
    ``wgrad_gluon_blockwise``: the per-tensor split-accumulator / blockwise wgrad in the Gluon kernel ([Note: fp8
    wgrad under the next MMA]). Ring depths (``*_stages*``, 32 KB a stage): a fresh 16-bit wgrad has room for one
    more ([Note: a 16-bit handoff]), a blockwise one for at most 4 ([Note: blockwise wgrad scales]).
    ``wgrad_gluon_epilogue_warps``: 2 ([Note: an epilogue partition]) or 0. ``wgrad_gluon_add_mode``: "atomic"
    (fp32 reductions, deterministic: one addend per element) or "load" (load-add-store). False forces the Triton
    kernel. ``linear_cublas``: a Linear's GEMMs (per tensor, and blockwise where ``scaled_mm.blockwise_ok``) on
    cuBLASLt ([Note: a Linear's fp8 GEMMs on cuBLASLt] in ``distwgrad/ops/scaled_mm.py``); False keeps them in
    these kernels."""

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
    linear_cublas: bool = True

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
        """Whether a promoting fprop / dgrad of contraction ``depth`` (``block`` 0: per-tensor) goes to Gluon."""
        return self.ragged_gluon and depth >= (self.ragged_gluon_min_depth_blockwise if block
                                               else self.ragged_gluon_min_depth_per_tensor)

    def wgrad_stages(self, fresh_16bit: bool) -> int:
        """The Gluon wgrad's ring depth (a fresh 16-bit output has room for more)."""
        return self.wgrad_gluon_stages_16 if fresh_16bit else self.wgrad_gluon_stages


@dataclasses.dataclass(frozen=True)
class QuantizeTuning:
    """The FP8 quantize kernels (``kernels/quantize.py``, ``kernels/weights_fp8.py``). Every value moves only
    speed: each element's arithmetic is the same for any tiling (``--quant-sweep``; docs/benchmarks/LOG.md).

    ``per_tensor_block`` (elements per program and amax step) / ``_warps``; ``amax_max_programs``: the amax grid cap,
    bounding atomics on one address; ``blocks_warps``: 128x128 blocks; ``rows_tile_m`` / ``rows_warps``: 1x128 rows;
    ``rowcol_warps`` / ``rowcol_maxnreg`` (None: no cap): the rows + columns Triton kernel; ``rowcol_gluon``: its Gluon
    kernel where it applies ([Note: rows and columns without a transpose]); ``weights_tile``: the weight cast's tile."""

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
    """The FP8 x^T transposes (``kernels/token_layout.py``): ``block_t`` token columns and ``block_r`` rows per
    program; an alignment that is a multiple of ``block_t`` lets a program find its group once."""

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
    """``base``'s family ``family`` with ``value`` applied: a whole instance, or a dict of fields."""
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
    """One ``tuning(...)`` block: in force are the defaults with every open block's overrides, outermost first."""

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
        **overrides: a family's name (``grouped_gemm``, ``grouped_gemm_fp8``, ``quantize``, ``token_layout``) with a
            dict of the fields to change (or an instance).

    Returns:
        A context manager; entering it returns the ``KernelTuning`` in force inside.

    Raises:
        ValueError: an unknown family or knob, or a value its dataclass refuses, at the call."""
    scope = _Scope(_overrides(families, overrides))
    scope._apply(_current)  # validates now: a bad knob fails at the call, not at the block's entry
    return scope
