"""Tests for the FP8 grouped GEMMs (``distwgrad.kernels.grouped_gemm_fp8``) against the in-package oracle
(``distwgrad.testing.reference_fp8``: dequantize to fp32, one fp32 matmul per group).

CPU: the kernels run under ``TRITON_INTERPRET=1`` in a child process (this file is also its script:
``python tests/test_grouped_gemm_fp8_kernels.py CASE``), as in tests/test_grouped_gemm_kernels.py. The
interpreter's own fp8 ``tl.dot`` mis-decodes e5m2 subnormals, so the kernels upcast fp8 to fp32 there
(case interpreter_fp8_dot checks that path on every finite fp8 value, case e5m2_subnormals that the
kernels take it); it truncates fp32 -> bf16 stores, which the bound's bf16 output rounding (2^-7) covers.

Every comparison uses [Note: fp8 grouped gemm error bound] (elementwise, in float64: twice gamma_n times
sum |a||b|, plus the output rounding; on GPUs also the Hopper accumulation term). Fresh fprop/dgrad/wgrad
outputs are NaN-poisoned first, so an unwritten tile fails, and rows at or past ``offs_E[-1]`` must stay
NaN. Shapes: T <= 300 and K, N <= 160, so 128-blocks and partial blocks both occur; splits are random
(about a third empty) or fixed so that a group starts in the middle of a 128-token tile. Inputs vary in
magnitude by up to 2^+-4 between 32x32 patches, so a wrong tile or block scale is visible. Recipes:
per-tensor (e4m3 x and w, e5m2 gradients, one scale per expert weight) and blockwise (e4m3, 1x128 and
128x128 power-of-two scales; also 1x32/32x32 with exact fp32 scales).

``test_bench_*`` run qa/bench/kernels.py fp8's grouped GEMM benchmark (--help, and end to end in the interpreter:
rows, FLOPs, ratios). Elsewhere: the problems and checks these share (``grouped_gemm_fp8_cases.py``), the
sm_90a builds without a GPU (``test_grouped_gemm_fp8_builds.py``), the launchers' dispatch with stubbed
kernels (``test_grouped_gemm_fp8_gluon_dispatch.py``) and the GPU tests (``test_grouped_gemm_fp8_gpu.py``,
``-m gpu``: the checks at bf16-sourced realistic shapes, printing the worst error/bound ratios).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from distwgrad.kernels import tuning
from grouped_gemm_fp8_cases import (
    E4M3,
    E5M2,
    SHAPE_ODD,
    SHAPE_TMA,
    _cfg,
    _check_chunk_order,
    _kernels,
    _problem,
    _quantized,
    _rough,
    _rounded,
    _run_ragged,
    _run_wgrad,
    _weight_form,
)

from distwgrad.testing import sweep
from distwgrad.testing.interpreter import run_interpreted
from distwgrad.testing.stubs import StubKernel

_HERE = os.path.abspath(__file__)
_ROOT = os.path.dirname(os.path.dirname(_HERE))
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")




# ---- interpreter cases (run in the child process) -------------------------------------------------


def _ragged_cases(recipe: str):
    T, E, K, N = SHAPE_TMA
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(E, N, generator=gen)
    fixed = _problem(T, E, K, N, recipe, splits=[0, 100, 20, 168])       # groups 2, 3 start mid-tile; 2 ends in it
    rand = _problem(T, E, K, N, recipe, seed=2)
    for op in ("fprop", "dgrad"):
        b = bias.bfloat16() if op == "fprop" else None
        _run_ragged(op, fixed, bias=b, form="list", use_tma=True)
        _run_ragged(op, rand, out_dtype=torch.float32, form="stacked", use_tma=False)
        _run_ragged(op, fixed, out_dtype=torch.float16, form="kn", use_tma=True)   # the other B layout
        odd = _problem(*SHAPE_ODD, recipe, seed=3)
        _run_ragged(op, odd, bias=bias[:3, :SHAPE_ODD[3]] if op == "fprop" else None)


def _case_ragged_per_tensor():
    _ragged_cases("per_tensor")


def _case_no_split_accumulator():
    """SPLIT_ACC=False builds and computes the same products (the interpreter's dot is exact fp32 either
    way: this pins the plumbing, the GPU tests the precision); blockwise refuses it by name."""
    pb = _problem(*SHAPE_TMA, "per_tensor_fast", splits=[0, 100, 20, 168])
    for op in ("fprop", "dgrad"):
        _run_ragged(op, pb, use_tma=True, form="stacked")
    _run_wgrad(pb, "acc", use_tma=True)
    _run_wgrad(pb, "fresh", use_tma=False)
    k, bw = _quantized(), _problem(*SHAPE_TMA, "blockwise")
    with pytest.raises(ValueError, match="split_accumulator=False applies to per-tensor scaling only"):
        k.kernel_grouped_fprop_fp8(bw.x_q, bw.wq, bw.offs, split_accumulator=False)
    with pytest.raises(TypeError, match="split_accumulator must be a bool"):
        k.kernel_grouped_dgrad_fp8(pb.dy_q, pb.wq, pb.offs, split_accumulator=0)


def _case_ragged_blockwise():
    _ragged_cases("blockwise")
    pb = _problem(200, 3, 96, 80, "blockwise32", seed=4)  # more blocks than fit in 160 at L=128
    _run_ragged("fprop", pb, out_dtype=torch.float32)
    _run_ragged("dgrad", pb, out_dtype=torch.float32)
    # Tiles wider than a weight block: the column scales of one tile come from two blocks.
    wide = _problem(*SHAPE_TMA, "blockwise", splits=[0, 100, 20, 168])
    _run_ragged("fprop", wide, out_dtype=torch.float32, config=_cfg(block_m=16, block_n=256))
    _run_ragged("dgrad", wide, out_dtype=torch.float32, config=_cfg(block_m=16, block_n=256), use_tma=True)


def _wgrad_cases(recipe: str):
    fixed = _problem(*SHAPE_TMA, recipe, splits=[0, 100, 20, 168])  # [0, 100), [100, 120), [120, 288): mid-tile starts
    for use_tma, low in ((True, torch.bfloat16), (False, torch.float16)):
        _run_wgrad(fixed, "fresh", use_tma=use_tma, out_dtype=low)
        _run_wgrad(fixed, "acc", use_tma=use_tma, config=_cfg(add_mode="atomic"))
    _run_wgrad(fixed, "acc_list", use_tma=True)
    rand = _problem(*SHAPE_TMA, recipe, seed=5)
    _run_wgrad(rand, "acc", use_tma=True)
    _run_wgrad(rand, "acc_list", use_tma=False, config=_cfg(add_mode="atomic"))
    odd = _problem(*SHAPE_ODD, recipe, splits=[150, 0, 150])      # group 2 starts mid-tile [128, 256)
    _run_wgrad(odd, "fresh")
    _run_wgrad(odd, "acc_list")


def _case_wgrad_per_tensor():
    _wgrad_cases("per_tensor")


def _case_wgrad_blockwise():
    _wgrad_cases("blockwise")
    pb = _problem(200, 3, 96, 80, "blockwise32", splits=[40, 0, 160])
    _run_wgrad(pb, "fresh")
    _run_wgrad(pb, "acc", config=_cfg(block_m=64, block_n=16))


def _case_wgrad_tma_edges():
    """The wgrad kernel's TMA path (masked head and tail chunks around the unmasked ones, [Note: fp8 wgrad
    edges]) gives the oracle's result: mid-tile group starts, an empty group, a group inside one chunk, one
    spanning several, offsets past T. Each recipe and problem accumulating; of the fresh outputs a fixed sample of
    two in CI (the same loads, another epilogue), all with --full."""
    fresh = set(sweep.sample([(r, i) for r in ("per_tensor", "blockwise") for i in range(3)], 2))
    for recipe in ("per_tensor", "blockwise"):
        probs = [_problem(*SHAPE_TMA, recipe, splits=[0, 100, 20, 168]), _problem(*SHAPE_TMA, recipe, seed=7),
                 _problem(*SHAPE_TMA, recipe, offs=torch.tensor([10, 10, 200, 400], dtype=torch.int32))]
        for i, pb in enumerate(probs):
            if (recipe, i) in fresh:
                _run_wgrad(pb, "fresh", use_tma=True)
            _run_wgrad(pb, "acc", use_tma=True, config=_cfg(add_mode="atomic") if i else None)


def _case_wgrad_chunks():
    """[Note: fp8 wgrad chunks]: both per-tensor paths (pointer loads; TMA with the masked first and last
    chunks around the unmasked ones) add a group's chunks on the same grid in the same order, and so give
    the same bits on a random problem too."""
    _check_chunk_order("cpu", use_tma=True)
    _check_chunk_order("cpu", use_tma=False)
    pb = _problem(*SHAPE_TMA, "per_tensor", offs=torch.tensor([37, 37, 181, 288], dtype=torch.int32))
    for mode in ("fresh", "acc"):
        assert torch.equal(_run_wgrad(pb, mode, use_tma=True), _run_wgrad(pb, mode, use_tma=False)), \
            f"wgrad {mode}: TMA and pointer loads differ"


def _case_edges():
    k = _kernels()
    T, E, K, N = SHAPE_TMA
    for recipe in ("per_tensor", "blockwise"):
        # clamped offsets (past T) and a last offset short of T (the rows after it stay unwritten)
        pb = _problem(T, E, K, N, recipe, offs=torch.tensor([10, 10, 200, T + 50], dtype=torch.int32))
        _run_ragged("fprop", pb, out_dtype=torch.float32)
        _run_wgrad(pb, "fresh")
        short = _problem(T, E, K, N, recipe, offs=torch.tensor([50, 120, 120, 200], dtype=torch.int32))
        _run_ragged("dgrad", short, out_dtype=torch.float32, use_tma=True)
        one = _problem(64, 1, K, N, recipe, splits=[64])
        _run_ragged("fprop", one, use_tma=True)
        _run_wgrad(one, "acc")
        # no tokens at all; and tokens but every group empty
        for pb in (_problem(0, E, K, N, recipe, splits=[0] * E), _problem(T, E, K, N, recipe, splits=[0] * E)):
            raw = (pb.dy_qt.data, pb.dy_qt.scale_inv, pb.x_qt.data, pb.x_qt.scale_inv, pb.offs, pb.block)
            assert bool((k._wgrad(*raw) == 0).all())
            m = torch.randn(E, N, K)
            assert torch.equal(k._wgrad(*raw, m.clone()), m)
            w = _quantized()._weights("f", pb.wq, pb.block)
            y = k._fprop(pb.x_q.data, pb.x_q.scale_inv, *w, pb.offs, None, pb.block, torch.float32)
            assert y.shape == (pb.T, N)
    # strided activation data (row stride K + 16): pointer path, and TMA refused by name
    pb = _problem(T, E, K, N, "blockwise", seed=6)
    wide = torch.zeros(T, K + 16, dtype=pb.x_q.data.dtype)
    wide[:, 3:3 + K] = pb.x_q.data
    pb.x_q = dataclasses.replace(pb.x_q, data=wide[:, 3:3 + K])
    _run_ragged("fprop", pb, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="TMA was requested"):
        _run_ragged("fprop", pb, out_dtype=torch.float32, use_tma=True)


def _case_nan_propagation():
    """A non-finite input poisons its scaling unit (NaN scale, see distwgrad.fp8.quantize); outputs that
    use the unit are NaN exactly where the oracle's are, and an empty group next to it stays zero."""
    T, E, K, N = SHAPE_TMA
    gen = torch.Generator().manual_seed(7)
    x, dy = _rough(T, K, gen), _rough(T, N, gen)
    w = torch.stack([_rough(N, K, gen) for _ in range(E)])
    x[5, 130] = float("inf")        # tile (row 5, K block 1)
    w[1, 140, 3] = float("nan")     # expert 1, block (nb 1, kb 0)
    dy[200, 7] = float("inf")       # token tile [128, 256) of out-feature 7 (wgrad), row 200 (dgrad)
    splits = [100, 0, 100, 88]      # group 1 is empty at token 100, inside tile [0, 128)
    for recipe in ("blockwise", "per_tensor"):
        pb = _problem(T, E, K, N, recipe, splits=splits, src=(x, w, dy))
        y = _run_ragged("fprop", pb, out_dtype=torch.float32, use_tma=True)
        dx = _run_ragged("dgrad", pb, out_dtype=torch.float32)
        dw = _run_wgrad(pb, "fresh", use_tma=True)
        assert bool(y.isnan().any() & dx.isnan().any() & dw.isnan().any())
        assert bool((dw[1] == 0).all()), "an empty group must stay zero next to a NaN tile"
        if recipe == "blockwise":
            assert bool(y[5].isnan().all()) and not bool(y[6].isnan().any())


def _case_interpreter_fp8_dot():
    """What the kernels rely on in the interpreter: fp8 loads, the fp8 -> fp32 cast and an fp32 ``tl.dot``
    are exact for every finite fp8 value (each meets 1.0 in a one-hot product: one nonzero term per
    output, exact in fp32). The interpreter's own fp8 ``tl.dot`` decodes through fp16 and gets e5m2
    subnormals wrong (2^-16 -> 0; triton 3.9), hence the kernels' UPCAST there; e4m3 is exact."""
    import triton
    import triton.language as tl

    @triton.jit
    def dot_kernel(a_ptr, b_ptr, o_ptr, UPCAST: tl.constexpr):
        m, kk = tl.arange(0, 16), tl.arange(0, 256)
        a = tl.load(a_ptr + m[:, None] * 256 + kk[None, :])
        b = tl.load(b_ptr + kk[:, None] * 16 + m[None, :])
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        tl.store(o_ptr + m[:, None] * 16 + m[None, :], tl.dot(a, b))

    for da, db, upcast in ((E4M3, E4M3, True), (E5M2, E5M2, True), (E5M2, E4M3, True), (E4M3, E4M3, False)):
        vals = torch.arange(256, dtype=torch.uint8).view(da).float()
        vals = torch.where(vals.isfinite(), vals, 0.0)
        a = torch.zeros(16, 256)
        a[torch.arange(256) // 16, torch.arange(256)] = vals             # row i holds values 16i..16i+15
        b = torch.zeros(256, 16)
        b[torch.arange(256), torch.arange(256) % 16] = 1.0               # column j picks value 16i + j
        out = torch.empty(16, 16)
        dot_kernel[(1,)](a.to(da), b.to(db), out, UPCAST=upcast)
        assert torch.equal(out.flatten(), vals), f"interpreter dot {da} x {db} upcast={upcast} is not exact"


def _case_e5m2_subnormals():
    """Gradients whose e5m2 values are mostly subnormal (tiny entries next to one large one)."""
    T, E, K, N = SHAPE_TMA
    gen = torch.Generator().manual_seed(10)
    x, w = _rough(T, K, gen), torch.stack([_rough(N, K, gen) for _ in range(E)])
    dy = torch.randn(T, N, generator=gen) * 1e-9
    dy[0, 0] = 1.0
    pb = _problem(T, E, K, N, "per_tensor", src=(x, w, dy), splits=[0, 100, 20, 168])
    sub = pb.dy_q.data.float().abs()
    assert float(((sub > 0) & (sub < 2.0**-14)).float().mean()) > 0.5
    _run_ragged("dgrad", pb, out_dtype=torch.float32, use_tma=True)
    _run_wgrad(pb, "fresh", use_tma=True)


def _case_gluon_fallback():
    """A Triton whose Gluon cannot build the promoting fprop / dgrad kernel: one warning, then the Triton
    kernel (checked against the oracle), no further attempt; ``gluon=True`` then fails by name."""

    from distwgrad.kernels.gluon import grouped_gemm_fp8 as kg
    from triton.compiler.errors import CompilationError
    k = _kernels()

    class _Unbuildable(CompilationError):
        def __init__(self):
            Exception.__init__(self, "no such Gluon API")
            self.message = "no such Gluon API"

    calls = []

    def launch(grid, *a, **kw):
        calls.append(1)
        raise _Unbuildable()
    saved = k._gluon_ragged, kg.ragged_kernel, kg.descriptor, dict(k._GLUON_FAILED)
    k._gluon_ragged = lambda *a: True
    k._GLUON_FAILED.clear()
    kg.ragged_kernel = StubKernel(launch)
    kg.descriptor = lambda t, block_shape: None
    shallow = dict(ragged_gluon_min_depth_per_tensor=0, ragged_gluon_min_depth_blockwise=0)  # the test's too
    try:
        T, E, K, N = SHAPE_TMA
        pb = _problem(T, E, K, N, "per_tensor", seed=5)
        with warnings.catch_warnings(record=True) as caught, tuning(grouped_gemm_fp8=shallow):
            warnings.simplefilter("always")
            for op in ("fprop", "dgrad", "fprop"):
                _run_ragged(op, pb, form="kn" if op == "dgrad" else "stacked", use_tma=True)
        assert len(calls) == 1 and "no such Gluon API" in k._GLUON_FAILED.get("ragged", ""), k._GLUON_FAILED
        assert sum("does not build" in str(w.message) for w in caught) == 1, [str(w.message) for w in caught]
        try:
            _run_ragged("fprop", pb, form="stacked", use_tma=True, gluon=True)
        except RuntimeError as exc:
            assert "gluon=True, but the Gluon kernel does not build here" in str(exc), exc
        else:
            raise AssertionError("gluon=True after a failed build must raise")
    finally:
        k._gluon_ragged, kg.ragged_kernel, kg.descriptor, failed = saved
        k._GLUON_FAILED.clear()
        k._GLUON_FAILED.update(failed)


def _case_custom_ops():
    """Public API through torch.library: opcheck (schema, fake, autograd registration) and compile."""
    _kernels()  # the custom ops registered
    k = _quantized()
    for recipe in sweep.sample(("per_tensor", "per_tensor_fast", "blockwise"), 2):  # --full: per_tensor_fast too
        pb = _problem(64, 2, 128, 64, recipe, seed=8)  # whole tiles: ragged tiles are the other cases
        sp = () if recipe != "per_tensor_fast" else (False,)  # the schema's default is True
        (w, w_s), b = _weight_form(pb, "stacked"), torch.randn(2, 64)
        x, xs, dy, dys = pb.x_q.data, pb.x_q.scale_inv, pb.dy_q.data, pb.dy_q.scale_inv
        raw_t = (pb.dy_qt.data, pb.dy_qt.scale_inv, pb.x_qt.data, pb.x_qt.scale_inv, pb.offs, pb.block)
        m = torch.randn(2, 64, 128)
        ops = torch.ops.distwgrad
        # Not "test_schema": its SchemaCheckMode compares the inputs before and after with arithmetic that
        # torch does not implement for CPU float8 ("mul_cpu_reduced_float"); mutation and aliasing are
        # covered by the fake-tensor and AOT-dispatch checks, and by the compile comparison below.
        check = lambda op, args: torch.library.opcheck(op, args, test_utils=_OPCHECK_UTILS)
        check(ops.grouped_fprop_fp8.default, (x, xs, w, w_s, pb.offs, b, pb.block, torch.float32, *sp))
        check(ops.grouped_dgrad_fp8.default, (dy, dys, w, w_s, pb.offs, pb.block, torch.bfloat16, *sp))
        check(ops.grouped_wgrad_fp8.default, (*raw_t, torch.float32, *sp))
        check(ops.grouped_wgrad_fp8.default, (*raw_t, torch.bfloat16, *sp))
        check(ops.grouped_wgrad_fp8_accumulate.default, (*raw_t, m.clone(), *sp))
        check(ops.grouped_wgrad_fp8_accumulate_list.default, (*raw_t, list(m.clone()), *sp))

        def step(acc, bufs, pb=pb, b=b):
            y = k.kernel_grouped_fprop_fp8(pb.x_q, pb.wq, pb.offs, b, split_accumulator=pb.split["fprop"])
            dx = k.kernel_grouped_dgrad_fp8(pb.dy_q, pb.wq, pb.offs, torch.float32, split_accumulator=pb.split["dgrad"])
            kw = dict(split_accumulator=pb.split["wgrad"])
            k.kernel_grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, pb.offs, out=acc, **kw)
            k.kernel_grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, pb.offs, out=bufs, **kw)
            return (y, dx, k.kernel_grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, pb.offs, **kw),
                    k.kernel_grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, pb.offs, out_dtype=torch.bfloat16, **kw))

        eager = step(m.clone(), list(m.clone()))
        acc, bufs = m.clone(), list(m.clone())
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(acc, bufs)
        for a, c in zip(eager, compiled):
            torch.testing.assert_close(c, a, rtol=0, atol=0, equal_nan=True)  # same kernels, same inputs
        assert eager[3].dtype == torch.bfloat16 and torch.equal(eager[3], _rounded(eager[2], torch.bfloat16))
        ref_acc = k.kernel_grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, pb.offs, out=m.clone())
        torch.testing.assert_close(acc, ref_acc, rtol=0, atol=0)
        torch.testing.assert_close(torch.stack(bufs), ref_acc, rtol=0, atol=0)


_OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")

_INTERPRETER_CASES = {
    "ragged_per_tensor": _case_ragged_per_tensor,
    "ragged_blockwise": _case_ragged_blockwise,
    "wgrad_per_tensor": _case_wgrad_per_tensor,
    "wgrad_blockwise": _case_wgrad_blockwise,
    "no_split_accumulator": _case_no_split_accumulator,
    "edges": _case_edges,
    "wgrad_tma_edges": _case_wgrad_tma_edges,
    "wgrad_chunks": _case_wgrad_chunks,
    "nan_propagation": _case_nan_propagation,
    "custom_ops": _case_custom_ops,
    "gluon_fallback": _case_gluon_fallback,
    "interpreter_fp8_dot": _case_interpreter_fp8_dot,
    "e5m2_subnormals": _case_e5m2_subnormals,
}


def _child_env() -> dict:
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


@pytest.mark.interpret
@pytest.mark.parametrize("case", sorted(_INTERPRETER_CASES))
def test_interpreter(case):
    pytest.importorskip("triton")
    run_interpreted(_HERE, case, timeout=300)


# ---- the benchmark's bookkeeping -------------------------------------------------------------------


_BENCH = os.path.join(_ROOT, "qa", "bench", "kernels.py")


def test_bench_help():
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, _BENCH, "fp8", "--help"],
                          env=_child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--gemm-shapes" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.interpret
def test_bench_grouped_gemm_smoke(tmp_path):
    """The benchmark end to end on a tiny shape in the interpreter: rows, FLOPs, ratio columns."""
    pytest.importorskip("triton")
    out = tmp_path / "rows.json"
    run_interpreted(_BENCH, "fp8", "--device", "cpu", "--shape", "64x64", "--benchmarks", "grouped_gemm",
                    "--gemm-shapes", "2,64,64,48", "--reps", "1", "--json", out, timeout=300)
    rows = [r for r in json.loads(out.read_text()) if r["op"].startswith("gg_")]
    impls = {(r["op"], r["impl"]) for r in rows}
    for op in ("fprop", "dgrad", "wgrad", "wgrad_accumulate"):
        for impl in ("bf16", "fp8_per_tensor", "fp8_blockwise"):
            assert (f"gg_{op}", impl) in impls
    assert ("gg_dgrad", "fp8_blockwise_wT") in impls
    bf16_ms = {r["op"]: r["ms"] for r in rows if r["impl"] == "bf16"}
    for r in rows:
        assert r["shape"] == "2,64,64,48"
        assert r["tflops"] == pytest.approx(2 * 64 * 48 * 64 / (r["ms"] * 1e-3) / 1e12, rel=1e-2)
        assert r["vs_bf16"] == pytest.approx(bf16_ms[r["op"]] / r["ms"], rel=1e-2)
        assert r["impl"] == "bf16" or r["worst"] <= 1


@pytest.mark.interpret
def test_bench_gemm_sweep_smoke(tmp_path):
    """``--gemm-sweep`` times every candidate tile config, dgrad on the dispatcher's N-contiguous weight."""
    pytest.importorskip("triton")
    from distwgrad.kernels import _grouped_gemm_fp8_configs as CF
    out = tmp_path / "rows.json"
    run_interpreted(_BENCH, "fp8", "--device", "cpu", "--shape", "64x64", "--benchmarks", "grouped_gemm",
                    "--gemm-shapes", "2,64,64,48", "--reps", "1", "--gemm-sweep", "--gemm-ops", "wgrad", "dgrad",
                    "--json", out, timeout=300)
    impls = [r["impl"] for r in json.loads(out.read_text()) if "@" in r["impl"]]
    loads = [c for c in CF.WGRAD_CANDIDATES if c.add_mode == "load"]
    for recipe in ("per_tensor", "blockwise"):
        assert sum(i.startswith(f"fp8_{recipe}@") for i in impls) == len(loads)
        assert sum(i.startswith(f"fp8_{recipe}_wT@") for i in impls) == len(CF.RAGGED_CANDIDATES)


# ---- argument checks (no launch; run in-process) ---------------------------------------------------


def test_checks_name_the_bad_argument():
    pytest.importorskip("triton")
    k, q8 = _kernels(), _quantized()
    pb = _problem(64, 2, 160, 144, "blockwise", seed=9)
    pt = _problem(64, 2, 160, 144, "per_tensor", seed=9)
    offs, w = pb.offs, _weight_form(pb, "stacked")
    with pytest.raises(TypeError, match=r"x_q must be a distwgrad.fp8.quantize.Quantized, got Tensor"):
        q8.kernel_grouped_fprop_fp8(pb.x_q.data, pb.wq, offs)
    with pytest.raises(ValueError, match=r"w_qs\[0\] has block None"):
        q8.kernel_grouped_fprop_fp8(pb.x_q, pt.wq, offs)
    with pytest.raises(TypeError, match=r"w_qs must be a non-empty sequence"):
        q8.kernel_grouped_fprop_fp8(pb.x_q, w[0], offs)
    with pytest.raises(ValueError, match=r"w's scale_inv has shape \(2,\), expected \(2, 2, 2\)"):
        q8.kernel_grouped_fprop_fp8(pb.x_q, (w[0], torch.ones(2)), offs)
    with pytest.raises(TypeError, match=r"x must be float8_e4m3fn or float8_e5m2, got torch.float32"):
        k._fprop(pb.x_q.data.float(), pb.x_q.scale_inv, *w, offs, None, pb.block, torch.bfloat16)
    with pytest.raises(TypeError, match=r"w's scale_inv must be a float32 tensor"):
        q8.kernel_grouped_fprop_fp8(pb.x_q, (w[0], w[1].double()), offs)
    with pytest.raises(ValueError, match=r"x \(64, 160\) and w \(2, 160, 144\) disagree on the contraction"):
        q8.kernel_grouped_fprop_fp8(pb.x_q, (w[0].transpose(1, 2), w[1]), offs)
    with pytest.raises(TypeError, match=r"int32 end offsets, got torch.int64"):
        q8.kernel_grouped_fprop_fp8(pb.x_q, w, offs.long())
    with pytest.raises(ValueError, match=r"offs_E has 3 entries, expected one per group \(2\)"):
        q8.kernel_grouped_dgrad_fp8(pb.dy_q, w, torch.tensor([1, 2, 64], dtype=torch.int32))
    with pytest.raises(TypeError, match=r"out_dtype must be one of"):
        q8.kernel_grouped_fprop_fp8(pb.x_q, w, offs, out_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"bias_EN must be a bf16/fp16/fp32 \[E, N\] = \(2, 144\)"):
        q8.kernel_grouped_fprop_fp8(pb.x_q, w, offs, torch.randn(2, 143))
    with pytest.raises(ValueError, match=r"dy_q must be quantized per tensor or in 1xL tiles"):
        q8.kernel_grouped_dgrad_fp8(dataclasses.replace(pb.dy_q, block=(128, 128), scale_inv=torch.ones(1, 2)), w, offs)
    with pytest.raises(ValueError, match=r"scale block must be 0 \(per-tensor\) or a power of two >= 32"):
        q8.kernel_grouped_fprop_fp8(dataclasses.replace(pb.x_q, scale_inv=torch.ones(64, 10), block=(1, 16)), w, offs)
    with pytest.raises(ValueError, match=r"dy_qt and x_qt must share one recipe"):
        q8.kernel_grouped_wgrad_fp8(pb.dy_qt, pt.x_qt, offs)
    with pytest.raises(ValueError, match=r"disagree on T"):
        q8.kernel_grouped_wgrad_fp8(pb.dy_qt, pb.x_q, offs)
    with pytest.raises(TypeError, match=r"out must be float32"):
        q8.kernel_grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, offs, out=torch.zeros(2, 144, 160, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"out must be \[E, N, K\] = \(2, 144, 160\)"):
        q8.kernel_grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, offs, out=torch.zeros(2, 160, 144))
    with pytest.raises(ValueError, match=r"out has 1 buffers"):
        q8.kernel_grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, offs, out=[torch.zeros(144, 160)])
    with pytest.raises(ValueError, match=r"out_dtype=torch.bfloat16 is a fresh output's dtype; an out to add"):
        q8.kernel_grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, offs, out=torch.zeros(2, 144, 160), out_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"grouped_wgrad_fp8: out_dtype must be one of .*got torch.int32"):
        q8.kernel_grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, offs, out_dtype=torch.int32)
    shared = torch.zeros(144, 160)
    with pytest.raises(ValueError, match=r"share memory"):
        q8.kernel_grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, offs, out=[shared, shared])
    with pytest.raises(ValueError, match=r"groups overlap"):
        q8.kernel_grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, offs, out=torch.zeros(144, 160).expand(2, 144, 160))
    with pytest.raises(ValueError, match=r"fp8 configs need block_k >= 32, add_mode in"):
        k._config("grouped_fprop_fp8", _cfg(block_k=16), 0, False, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"fp8 configs need block_k >= 32, add_mode in"):
        k._config("grouped_wgrad_fp8", _cfg(add_mode="tma_add"), 128, True, torch.device("cpu"))  # bf16 only
    for tail, short in (("half_tail", "half"), ("wide_tail", "wide")):
        with pytest.raises(ValueError, match=rf"no half_tail or wide_tail \(bf16 fprop/dgrad only\), got "
                                             rf"32x32x32/g2/w1/s1/{short}"):
            k._config("grouped_fprop_fp8", _cfg(**{tail: True}), 0, False, torch.device("cpu"))
    if not _INTERPRETED:
        with pytest.raises(ValueError, match=r"need CUDA tensors \(or TRITON_INTERPRET=1\)"):
            q8.kernel_grouped_fprop_fp8(pb.x_q, w, offs)


def test_default_picks(monkeypatch):
    """The launchers' default configs are the tuned table's (the launcher names map onto pick's ops):
    accumulating wgrad sends fp32 atomics, per-tensor fprop/dgrad take 256-row tiles only for large groups."""
    pytest.importorskip("triton")
    k = _kernels()
    monkeypatch.setattr(k, "_interpreting", lambda: False)
    cpu = torch.device("cpu")
    acc = k._config("grouped_wgrad_fp8", None, 0, True, cpu)
    assert (acc.block_m, acc.block_n, acc.add_mode) == (64, 128, "atomic")
    assert k._config("grouped_wgrad_fp8", None, 128, False, cpu).add_mode == "load"
    assert k._config("grouped_fprop_fp8", None, 0, False, cpu, 4096.0).block_m == 256
    assert k._config("grouped_dgrad_fp8", None, 0, False, cpu, 128.0).block_m == 128
    assert k._config("grouped_fprop_fp8", None, 128, False, cpu, 4096.0).block_m == 128  # blockwise: spills
    fast = k._config("grouped_dgrad_fp8", None, 0, False, cpu, 4096.0, split_acc=False)  # one accumulator
    assert (fast.block_m, fast.block_n, fast.num_stages) == (128, 256, 3)
    from distwgrad.kernels import _grouped_gemm_fp8_configs as CF
    with pytest.raises(ValueError, match="op must be"):
        CF.pick("grouped_fprop_fp8", block=0, accumulate=False, smem_limit=None)




if __name__ == "__main__":  # child process of test_interpreter: TRITON_INTERPRET=1 is set
    assert _INTERPRETED, "run through pytest, or set TRITON_INTERPRET=1"
    _INTERPRETER_CASES[sys.argv[1]]()
    print(f"interpreter case {sys.argv[1]}: ok")
