"""FP8 quantization: recipe validation, reference properties, Triton kernels bit-exact vs the reference.

The reference (``distwgrad.fp8.quantize``) is checked against its documented properties; the kernels
(``distwgrad.kernels.quantize``) against the reference, bit for bit (NaN compares as NaN, whatever
its sign or payload).

Interpreter tests: ``TRITON_INTERPRET=1`` must be set before Triton compiles anything, and other test
modules in the same (xdist) process may import Triton without it. So each ``interpret`` test runs this
file as a script in a fresh subprocess with the variable set (``python tests/test_fp8_quantize.py
CASE``); the case functions below are shared with the GPU tests, which run them on CUDA in-process.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from distwgrad.kernels import tuning

from distwgrad.fp8 import (
    BlockwiseScaling,
    PerTensorScaling,
    Quantized,
    compute_amax,
    compute_scale,
    current_recipe,
    dequantize,
    fp8_autocast,
    fp8_format,
    fp8_matmul_reference,
    quantize_blockwise,
    quantize_per_tensor,
    quantize_rowwise_and_columnwise,
    roundtrip_error_bound,
    transpose_quantized,
)
from distwgrad.testing import sweep
from distwgrad.testing.stubs import StubKernel

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8S = (E4M3, E5M2)
REPO = Path(__file__).resolve().parents[1]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two fp8 or fp32 tensors, where any NaN equals any NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = torch.uint8 if a.element_size() == 1 else torch.int32
    nan = a.float().isnan() & b.float().isnan()
    return bool(((a.view(view) == b.view(view)) | nan).all())


def assert_same(k: Quantized, r: Quantized, what: str = "") -> None:
    assert k.block == r.block and tuple(k.shape) == tuple(r.shape) and k.orig_dtype == r.orig_dtype, what
    assert k.data.is_contiguous(), what
    assert bits_equal(k.data.cpu(), r.data.cpu()), f"fp8 data differs {what}"
    assert bits_equal(k.scale_inv.cpu(), r.scale_inv.cpu()), f"scale_inv differs {what}"


def wide_range(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random values spanning ~6 decades across columns (exercises per-block scales and subnormals)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if len(shape) == 2:
        x = x * torch.logspace(-3, 3, shape[1])
    return x.to(dtype)


# ----------------------------------------------------------------------------------------------------
# Recipes
# ----------------------------------------------------------------------------------------------------

def test_recipe_defaults():
    r = PerTensorScaling()
    assert (r.fwd_dtype, r.grad_dtype, r.margin) == (E4M3, E5M2, 0)
    assert r.dtype_for(grad=True) == E5M2 and r.dtype_for(grad=False) == E4M3
    b = BlockwiseScaling()
    assert (b.act_block, b.weight_block, b.dtype, b.power_of_two) == ((1, 128), (128, 128), E4M3, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.dtype = E5M2  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, match", [
    (dict(fwd_dtype=torch.bfloat16), "fwd_dtype.*bfloat16"),
    (dict(grad_dtype=torch.float8_e4m3fnuz), "grad_dtype.*e4m3fnuz"),
    (dict(margin=-1), "margin.*-1"),
    (dict(margin=17), "margin.*17"),
    (dict(margin=1.0), "margin.*1.0"),
    (dict(margin=True), "margin.*True"),
])
def test_per_tensor_recipe_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PerTensorScaling(**kwargs)


def test_split_accumulator_per_gemm():
    """Every GEMM splits by default; a per-tensor recipe may turn it off per GEMM (TransformerEngine's
    MMParams); blockwise always splits; bad values and names are refused by name."""
    from distwgrad.fp8 import MMParams, split_accumulator
    assert all(split_accumulator(PerTensorScaling(), g) for g in ("fprop", "dgrad", "wgrad"))
    assert all(split_accumulator(BlockwiseScaling(), g) for g in ("fprop", "dgrad", "wgrad"))
    te_like = PerTensorScaling(fp8_gemm_fprop=MMParams(use_split_accumulator=False))
    assert [split_accumulator(te_like, g) for g in ("fprop", "dgrad", "wgrad")] == [False, True, True]
    with pytest.raises(ValueError, match="fp8_gemm_dgrad must be an MMParams, got False"):
        PerTensorScaling(fp8_gemm_dgrad=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="use_split_accumulator must be a bool, got 0"):
        MMParams(0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gemm must be one of .* got 'bwd'"):
        split_accumulator(te_like, "bwd")
    with pytest.raises(TypeError, match="got None"):
        split_accumulator(None, "fprop")  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs, match", [
    (dict(act_block=(2, 128)), r"act_block.*\(2, 128\)"),
    (dict(act_block=(1, 8)), r"act_block.*\(1, 8\)"),
    (dict(act_block=(1, 100)), r"act_block.*\(1, 100\)"),
    (dict(act_block=[1, 128]), r"act_block.*\[1, 128\]"),
    (dict(weight_block=(128, 64)), r"square.*\(128, 64\)"),
    (dict(weight_block=(96, 96)), r"weight_block.*\(96, 96\)"),
    (dict(weight_block=(8, 8)), r"weight_block.*\(8, 8\)"),
    (dict(dtype=torch.float16), "dtype.*float16"),
    (dict(power_of_two=1), "power_of_two.*1"),
])
def test_blockwise_recipe_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockwiseScaling(**kwargs)


def test_fp8_format_rejects():
    with pytest.raises(ValueError, match="bfloat16"):
        fp8_format(torch.bfloat16)
    assert fp8_format(E4M3).max == 448.0 and fp8_format(E5M2).max == 57344.0
    for fmt in map(fp8_format, FP8S):
        assert torch.finfo(fmt.dtype).max == fmt.max
        assert torch.finfo(fmt.dtype).smallest_normal == 2.0**fmt.min_normal_exp


def test_fp8_autocast_nests_restores_and_is_per_thread():
    a, b = PerTensorScaling(), BlockwiseScaling()
    assert current_recipe() is None
    with fp8_autocast(a) as active:
        assert active is a and current_recipe() is a
        with fp8_autocast(None):
            assert current_recipe() is None
        with pytest.raises(RuntimeError):
            with fp8_autocast(b):
                assert current_recipe() is b
                raise RuntimeError("boom")
        assert current_recipe() is a
        seen = []
        t = threading.Thread(target=lambda: seen.append(current_recipe()))
        t.start()
        t.join()
        assert seen == [None]
    assert current_recipe() is None
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        with fp8_autocast(torch.float8_e4m3fn):  # type: ignore[arg-type]
            pass


# ----------------------------------------------------------------------------------------------------
# Reference: scale arithmetic
# ----------------------------------------------------------------------------------------------------

def test_compute_scale_values():
    t = lambda *v: torch.tensor(v, dtype=torch.float32)
    s = compute_scale(t(448.0, 0.0, 3.0, 1e-45, math.inf, math.nan), E4M3)
    assert s[0] == 1 and s[1] == 1
    assert s[2] == torch.tensor(448.0) / torch.tensor(3.0)  # one fp32 division
    assert s[3] == torch.finfo(torch.float32).max  # 448 / 1e-45 overflows: clamped
    assert s[4].isnan() and s[5].isnan()
    p = compute_scale(t(3.0, 1e-45, 448.0, 449.0, 0.0), E4M3, power_of_two=True)
    assert p.tolist() == [128.0, 2.0**127, 1.0, 0.5, 1.0]
    assert compute_scale(t(7.0), E5M2, margin=2).item() == torch.tensor(57344.0 / 4) / torch.tensor(7.0)
    big = compute_scale(t(3.0e38), E4M3, margin=16)
    assert big.item() == 2.0**-126  # clamped to the smallest normal: 1/scale stays finite


def test_compute_amax():
    assert compute_amax(torch.tensor([-3.0, 2.0])).item() == 3.0
    assert compute_amax(torch.tensor([1.0, math.nan])).item() == math.inf
    assert compute_amax(torch.tensor([1.0, -math.inf])).item() == math.inf
    assert compute_amax(torch.zeros(0)).item() == 0.0
    assert compute_amax(torch.tensor([1.5], dtype=torch.bfloat16)).dtype == torch.float32


# ----------------------------------------------------------------------------------------------------
# Reference: round trip, saturation, zeros, non-finite values
# ----------------------------------------------------------------------------------------------------

QUANTIZERS = {
    "per_tensor": lambda x, f8: quantize_per_tensor(x, f8),
    "per_tensor_margin3": lambda x, f8: quantize_per_tensor(x, f8, margin=3),
    "1x128": lambda x, f8: quantize_blockwise(x, (1, 128), f8),
    "128x128": lambda x, f8: quantize_blockwise(x, (128, 128), f8),
    "128x128_fp32_scales": lambda x, f8: quantize_blockwise(x, (128, 128), f8, power_of_two=False),
    "3x5": lambda x, f8: quantize_blockwise(x, (3, 5), f8, power_of_two=False),
}


@pytest.mark.parametrize("f8", FP8S, ids=str)
@pytest.mark.parametrize("name", list(QUANTIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_roundtrip_error_within_fp8_rounding(name, f8, dtype):
    fmt = fp8_format(f8)
    x = wide_range((130, 300), dtype)
    q = QUANTIZERS[name](x, f8)
    err = (x.double() - dequantize(q, dtype=torch.float32).double()).abs()
    assert bool((err <= roundtrip_error_bound(x, q)).all())
    # The bound is tight, not vacuous: the worst relative error of normal-range values is close to it.
    s_inv = q.scale_inv.double() if q.block is None else q.scale_inv.double().repeat_interleave(
        q.block[0], 0)[:130].repeat_interleave(q.block[1], 1)[:, :300]
    normal = x.double().abs() >= 2.0**fmt.min_normal_exp * s_inv
    rel = (err[normal] / x.double().abs()[normal]).max().item()
    assert 2.0 ** -(fmt.mantissa_bits + 2) < rel <= 2.0 ** -(fmt.mantissa_bits + 1) * (1 + 2**-19)
    # The largest magnitude of each unit lands near fp8_max (>= fp8_max / 2 with power-of-two scales).
    assert q.data.float().abs().max().item() <= fmt.max * 2.0 ** -(3 if "margin3" in name else 0)
    assert q.data.float().abs().max().item() >= fmt.max * 2.0 ** -(4 if "margin3" in name else 1)


@pytest.mark.parametrize("f8", FP8S, ids=str)
def test_saturation_with_a_small_given_amax(f8):
    fmax = fp8_format(f8).max
    x = torch.tensor([-100.0, -10.0, -1.0, 0.0, 1.0, 10.0, 100.0])
    q = quantize_per_tensor(x, f8, amax=10.0)
    middle = quantize_per_tensor(x[2:5], f8, amax=10.0).data.float().tolist()
    assert q.data.float().tolist() == [-fmax, -fmax, *middle, fmax, fmax]
    assert bool(q.data.float().isfinite().all())
    # A NaN / inf ELEMENT under a caller-given finite amax: NaN stays NaN, inf saturates (no poisoning).
    q = quantize_per_tensor(torch.tensor([math.nan, math.inf, -math.inf, 1.0]), f8, amax=2.0)
    got = q.data.float()
    assert got[0].isnan() and got[1:3].tolist() == [fmax, -fmax] and got[3] == fmax / 2


@pytest.mark.parametrize("f8", FP8S, ids=str)
def test_zeros_stay_zero(f8):
    z = torch.tensor([0.0, -0.0, 0.0, -0.0])
    q = quantize_per_tensor(z, f8)
    assert q.data.view(torch.uint8).tolist() == [0x00, 0x80, 0x00, 0x80] and q.scale_inv.item() == 1.0
    x = wide_range((256, 256), torch.float32)
    x[:128, 128:] = 0.0
    qb = quantize_blockwise(x, (128, 128), f8)
    assert qb.scale_inv[0, 1].item() == 1.0 and bool((qb.data[:128, 128:].float() == 0).all())
    assert bool((dequantize(qb)[:128, 128:] == 0).all())


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("f8", FP8S, ids=str)
def test_nonfinite_poisons_its_scaling_unit(f8, bad):
    x = wide_range((256, 256), torch.float32)
    y = x.clone()
    y[5, 200] = bad
    q = quantize_per_tensor(y, f8)
    assert bool(q.data.float().isnan().all()) and q.scale_inv.isnan()
    assert bool(dequantize(q).isnan().all())
    qb, ref = quantize_blockwise(y, (128, 128), f8), quantize_blockwise(x, (128, 128), f8)
    assert bool(qb.data[:128, 128:].float().isnan().all()) and qb.scale_inv[0, 1].isnan()
    keep = torch.ones(2, 2, dtype=torch.bool)
    keep[0, 1] = False
    assert torch.equal(qb.scale_inv[keep], ref.scale_inv[keep])
    mask = keep.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(qb.data.view(torch.uint8)[mask], ref.data.view(torch.uint8)[mask])
    qr = quantize_blockwise(y, (1, 128), f8)  # only the tile (row 5, columns 128..255)
    assert bool(qr.data[5, 128:].float().isnan().all()) and int(qr.scale_inv.isnan().sum()) == 1
    assert int(qr.data.float().isnan().sum()) == 128


# ----------------------------------------------------------------------------------------------------
# Reference: blocks, edge blocks, transposes
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block", [(1, 128), (128, 128), (32, 64), (3, 5)])
@pytest.mark.parametrize("shape", [(130, 200), (128, 256), (1, 1), (5, 129)])
def test_each_block_is_quantized_alone(shape, block):
    """A block's bits depend on its own valid elements only: the edge blocks' padding never counts."""
    x = wide_range(shape, torch.bfloat16, seed=1)
    q = quantize_blockwise(x, block, E4M3)
    gm, gn = -(-shape[0] // block[0]), -(-shape[1] // block[1])
    assert tuple(q.scale_inv.shape) == (gm, gn) and tuple(q.data.shape) == shape
    for i in sorted({0, gm - 1}):
        for j in sorted({0, gn - 1}):
            sl = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            alone = quantize_blockwise(x[sl].contiguous(), block, E4M3)
            assert bits_equal(q.data[sl], alone.data)
            assert bits_equal(q.scale_inv[i:i + 1, j:j + 1], alone.scale_inv)
            scale = compute_scale(x[sl].float().abs().amax(), E4M3, power_of_two=True)
            assert bits_equal(q.scale_inv[i, j], torch.ones(()) / scale)


@pytest.mark.parametrize("power_of_two", [True, False])
@pytest.mark.parametrize("f8", FP8S, ids=str)
@pytest.mark.parametrize("shape", [(256, 384), (300, 200)])
def test_square_block_weight_transpose_is_exact(shape, f8, power_of_two):
    """Transposing the fp8 data and the scale grid IS the quantization of W^T: no re-quantization."""
    w = wide_range(shape, torch.bfloat16, seed=2)
    q = quantize_blockwise(w, (128, 128), f8, power_of_two=power_of_two)
    qt = transpose_quantized(q)
    assert_same(qt, quantize_blockwise(w.t().contiguous(), (128, 128), f8, power_of_two=power_of_two))
    assert torch.equal(dequantize(qt), dequantize(q).t())
    p = quantize_per_tensor(w, f8)
    assert_same(transpose_quantized(p), quantize_per_tensor(w.t(), f8))


def test_sharded_weight_quantizes_like_the_full_weight():
    """Per-tensor: with the MAX of the shards' amaxes (what an all-reduce gives) uneven dim-0 shards
    quantize to exactly the rows of the full quantization. Blockwise: the same holds when shard
    boundaries fall on block boundaries; zero rows padding the last shard do not change any scale."""
    w = wide_range((1000, 384), torch.bfloat16, seed=5)
    shards = torch.split(w, [260, 260, 260, 220])  # uneven, not 128-aligned
    amax = torch.stack([compute_amax(s) for s in shards]).amax()  # all_reduce(MAX) stand-in
    for f8 in FP8S:
        full = quantize_per_tensor(w, f8)
        parts = [quantize_per_tensor(s, f8, amax=amax) for s in shards]
        assert torch.equal(torch.cat([p.data.view(torch.uint8) for p in parts]), full.data.view(torch.uint8))
        assert all(torch.equal(p.scale_inv, full.scale_inv) for p in parts)
    full = quantize_blockwise(w, (128, 128), E4M3)
    padded = torch.cat([w, w.new_zeros(1024 - 1000, 384)])  # 4 ranks x 256 rows, 128-aligned
    parts = [quantize_blockwise(s, (128, 128), E4M3) for s in torch.split(padded, 256)]
    data = torch.cat([p.data.view(torch.uint8) for p in parts])[:1000]
    assert torch.equal(data, full.data.view(torch.uint8))
    assert torch.equal(torch.cat([p.scale_inv for p in parts]), full.scale_inv)


def test_power_of_two_scales_requantize_losslessly():
    """With power-of-two scales, dequantized values (even in bf16) re-quantize to the same values."""
    w = wide_range((300, 260), torch.bfloat16, seed=3)
    for f8 in FP8S:
        q = quantize_blockwise(w, (128, 128), f8)
        assert bool((torch.log2(q.scale_inv) == torch.log2(q.scale_inv).round()).all())
        d = dequantize(q)  # bf16: 4 significant bits of fp8 times a power of two are exact
        assert torch.equal(d.float(), dequantize(q, dtype=torch.float32))
        again = quantize_blockwise(d, (128, 128), f8)
        assert torch.equal(dequantize(again, dtype=torch.float32), dequantize(q, dtype=torch.float32))


@pytest.mark.parametrize("shape", [(130, 300), (256, 128), (1, 5)])
def test_rowwise_and_columnwise_reference(shape):
    x = wide_range(shape, torch.bfloat16, seed=4)
    M, N = shape
    q, qt = quantize_rowwise_and_columnwise(x, BlockwiseScaling())
    assert tuple(q.scale_inv.shape) == (M, -(-N // 128)) and tuple(qt.scale_inv.shape) == (N, -(-M // 128))
    assert qt.shape == (N, M) and qt.block == (1, 128) and qt.data.is_contiguous()
    assert_same(qt, quantize_blockwise(x.t().contiguous(), (1, 128), E4M3))
    p, pt = quantize_rowwise_and_columnwise(x, PerTensorScaling(), grad=True)
    assert p.data.dtype == E5M2 and torch.equal(pt.data.view(torch.uint8), p.data.t().view(torch.uint8))
    assert_same(pt, quantize_per_tensor(x.t(), E5M2))


def test_reference_input_checks():
    with pytest.raises(ValueError, match="float64"):
        quantize_per_tensor(torch.zeros(3, dtype=torch.float64), E4M3)
    with pytest.raises(ValueError, match="int32"):
        quantize_per_tensor(torch.zeros(3, dtype=torch.int32), E4M3)
    with pytest.raises(ValueError, match=r"2-D.*\(2, 3, 4\)"):
        quantize_blockwise(torch.zeros(2, 3, 4), (1, 128), E4M3)
    with pytest.raises(ValueError, match="block"):
        quantize_blockwise(torch.zeros(2, 3), (0, 128), E4M3)
    with pytest.raises(ValueError, match="one value"):
        quantize_per_tensor(torch.zeros(3), E4M3, amax=torch.ones(2))
    with pytest.raises(ValueError, match="float16"):
        quantize_per_tensor(torch.zeros(3), torch.float16)
    q = quantize_blockwise(torch.ones(4, 4), (2, 2), E4M3)
    with pytest.raises(ValueError, match="scale_inv has shape"):
        Quantized(q.data, q.scale_inv[:1], (2, 2), torch.float32, q.shape)
    with pytest.raises(ValueError, match="fp8_matmul_reference"):
        fp8_matmul_reference(q, quantize_per_tensor(torch.ones(3, 2), E4M3), torch.float32)


def test_empty_tensors():
    for shape in [(0, 5), (5, 0)]:
        q = quantize_blockwise(torch.zeros(shape), (1, 128), E4M3)
        assert q.data.shape == shape and dequantize(q).shape == shape
    assert quantize_per_tensor(torch.zeros(0), E5M2).scale_inv.item() == 1.0


# ----------------------------------------------------------------------------------------------------
# Kernel cases: run under TRITON_INTERPRET=1 (subprocess, tiny shapes) and on CUDA (big shapes)
# ----------------------------------------------------------------------------------------------------

def _kernels():
    from distwgrad.kernels import quantize as kq
    return kq


def _on(x: torch.Tensor, device: str) -> torch.Tensor:
    return x.to(device)


def case_rounding(device: str, big: bool) -> None:
    """Every fp8 value, every midpoint and its neighbours, subnormals, signed zeros, saturation, NaN:
    with amax = fp8_max the scale is exactly 1, so this tests the kernel's RNE cast value by value."""
    kq = _kernels()
    parts = []
    for f8 in FP8S:
        grid = torch.arange(256, dtype=torch.uint8).view(f8).float()
        grid = grid[grid.isfinite()].unique()
        mid = (grid[1:] + grid[:-1]) / 2
        parts += [grid, mid, torch.nextafter(mid, grid[1:]), torch.nextafter(mid, grid[:-1])]
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1e-45, 500.0, -1e5, 3e38,
                            math.inf, -math.inf, math.nan])
    x = torch.cat([*parts, special, torch.randn(3000) * 100, torch.randn(1000) * 1e-3])
    x = torch.cat([x, -x])
    for f8 in FP8S:
        amax = torch.tensor([fp8_format(f8).max])
        k = kq.quantize_per_tensor(_on(x, device), f8, amax=_on(amax, device))
        assert_same(k, quantize_per_tensor(x, f8, amax=amax), f"rounding {f8}")


def case_per_tensor(device: str, big: bool) -> None:
    kq = _kernels()
    shapes = [(4096, 8192 + 3), (5,)] if big else [(0,), (1,), (9000,), (7, 33)]
    grid = [(d, f8, s) for d in (torch.float32, torch.float16, torch.bfloat16) for f8 in FP8S for s in shapes]
    for dtype, f8, shape in sweep.sample(grid, 8, seed=0):  # --full: all 24 (12 on the GPU)
        x = wide_range(shape, dtype, seed=len(shape))
        for margin in (0, 3):
            k = kq.quantize_per_tensor(_on(x, device), f8, margin=margin)
            r = quantize_per_tensor(x, f8, margin=margin)
            assert_same(k, r, f"{dtype} {f8} {shape} {margin}")
        for amax in (0.0, 0.5, 1e6):
            a = torch.tensor([amax])
            k = kq.quantize_per_tensor(_on(x, device), f8, amax=_on(a, device))
            assert_same(k, quantize_per_tensor(x, f8, amax=a), f"{dtype} {f8} {shape} amax={amax}")
    x = wide_range((9000,), torch.bfloat16)
    with tuning(quantize=dict(amax_max_programs=2, per_tensor_block=1024)):  # several grid-stride steps a program
        k = kq.quantize_per_tensor(_on(x, device), E4M3)
    assert_same(k, quantize_per_tensor(x, E4M3), "grid-stride")


def case_nonfinite(device: str, big: bool) -> None:
    kq = _kernels()
    shape = (1024, 2048) if big else (64, 96)
    for bad in (math.nan, math.inf, -math.inf):
        x = wide_range(shape, torch.bfloat16)
        x[3, 40] = bad
        x[:32, 64:] = 0.0
        for f8 in FP8S:
            assert_same(kq.quantize_per_tensor(_on(x, device), f8), quantize_per_tensor(x, f8), f"{bad}")
            for block in ((32, 32), (1, 32), (16, 64)):
                k = kq.quantize_blockwise(_on(x, device), block, f8)
                assert_same(k, quantize_blockwise(x, block, f8), f"{bad} {block}")
            rec = BlockwiseScaling(act_block=(1, 32), weight_block=(32, 32), dtype=f8)
            for k, r in zip(kq.quantize_rowwise_and_columnwise(_on(x, device), rec),
                            quantize_rowwise_and_columnwise(x, rec), strict=True):
                assert_same(k, r, f"{bad} rowcol")


def case_blockwise(device: str, big: bool) -> None:
    kq = _kernels()
    if big:
        grid = [(torch.bfloat16, shape) for shape in [(4096 + 65, 7168 + 3), (8192, 4096)]]
        blocks = [(1, 128), (128, 128)]
    else:  # every dtype on one ragged shape; the shape sweep in bf16 (the interpreter is slow)
        grid = [(dtype, (33, 65)) for dtype in (torch.float32, torch.float16)]
        grid += [(torch.bfloat16, shape) for shape in [(1, 1), (70, 100), (32, 64), (33, 65)]]
        blocks = [(1, 32), (32, 32), (16, 64)]
    for dtype, shape in grid:
        x = wide_range(shape, dtype, seed=shape[0])
        for f8 in FP8S:
            for block in blocks:
                for pow2 in (True, False):
                    k = kq.quantize_blockwise(_on(x, device), block, f8, power_of_two=pow2)
                    r = quantize_blockwise(x, block, f8, power_of_two=pow2)
                    assert_same(k, r, f"{dtype} {shape} {f8} {block} pow2={pow2}")
    x = wide_range((70, 100), torch.bfloat16)
    for tile_m in (4, 64):  # 1xL row tiles: many programs along M, or one partial one
        with tuning(quantize=dict(rows_tile_m=tile_m)):
            k = kq.quantize_blockwise(_on(x, device), (1, 32), E4M3)
        assert_same(k, quantize_blockwise(x, (1, 32), E4M3), f"rows_tile_m={tile_m}")


def case_rowcol(device: str, big: bool) -> None:
    kq = _kernels()
    shapes = [(8192 + 7, 4096 + 65), (4096, 7168)] if big else [(1, 1), (40, 70), (64, 32), (65, 33)]
    L = 128 if big else 32
    for shape in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            # The reference runs where the kernel does: it is device-independent
            # (test_reference_is_device_independent), and on the CPU the big shapes take minutes.
            x = _on(wide_range(shape, dtype, seed=shape[1]), device)
            for f8 in FP8S:
                for pow2 in (True, False):
                    rec = BlockwiseScaling(act_block=(1, L), weight_block=(L, L), dtype=f8, power_of_two=pow2)
                    ref = quantize_rowwise_and_columnwise(x, rec)
                    got = kq.quantize_rowwise_and_columnwise(x, rec)
                    for k, r in zip(got, ref, strict=True):
                        assert_same(k, r, f"{shape} {dtype} {f8} pow2={pow2}")
            rec = PerTensorScaling(margin=1)
            for k, r in zip(kq.quantize_rowwise_and_columnwise(x, rec, grad=True),
                            quantize_rowwise_and_columnwise(x, rec, grad=True), strict=True):
                assert_same(k, r, f"{shape} per-tensor")


def _amax_grid() -> torch.Tensor:
    """fp32 amaxes at every exponent (subnormals too), with the mantissas around each fp8 format's max
    mantissa (where fl(fp8_max / amax) changes exponent), plus 0, +inf, NaN and random values."""
    mant = torch.tensor([0, 1, 0x3FFFFF, 0x400000, 0x400001, 0x5FFFFF, 0x600000, 0x600001, 0x7FFFFF])
    bits = ((torch.arange(0, 255) << 23)[:, None] + mant).flatten()
    bits = torch.cat([bits, torch.randint(0, 0x7F800000, (512,), generator=torch.Generator().manual_seed(3)),
                      torch.tensor([0x7F800000, 0x7FC00000])])
    return bits.to(torch.int32).view(torch.float32)


def case_pow2_scales(device: str, big: bool) -> None:
    """Power-of-two scales come from exponent arithmetic, not division ([Note: power-of-two scales
    without division]): every amax of ``_amax_grid`` (one per 1x32 row tile, one per column of x^T)
    gives the reference's scale and scale_inv bits, in each kernel that takes blockwise scales."""
    kq = _kernels()
    amax = _amax_grid()
    x = amax[:, None] * torch.linspace(1.0, -0.25, 32)  # each row's amax is its first element
    x = torch.cat([x, torch.zeros(-x.shape[0] % 32, 32)])  # whole 32x32 blocks
    xd = _on(x, device)
    for f8 in FP8S:
        for block in ((1, 32), (32, 32)):
            assert_same(kq.quantize_blockwise(xd, block, f8), quantize_blockwise(x, block, f8), f"{f8} {block}")
        rec = BlockwiseScaling(act_block=(1, 32), weight_block=(32, 32), dtype=f8)
        xt = _on(x.t().contiguous(), device)  # x's rows are the column tiles here
        got = kq.quantize_rowwise_and_columnwise(xt, rec)
        for k, r in zip(got, quantize_rowwise_and_columnwise(x.t().contiguous(), rec), strict=True):
            assert_same(k, r, f"{f8} rowcol")


def case_rowcol_gluon(device: str, big: bool) -> None:
    """The Gluon rows + columns kernel ([Note: rows and columns without a transpose]): the reference's bits
    on whole and partial tiles, both formats, bf16 and fp32 input, amaxes at every exponent along rows and
    along columns, and non-finite values. Where it does not apply (CPU, the
    interpreter, M off its row grid) the Triton kernel answers, which this case then checks instead."""
    kq = _kernels()
    grid = _amax_grid()
    grid = grid[: grid.numel() // 8 * 8] if big else grid[::24][:64]
    g = grid[:, None] * torch.linspace(1.0, -0.25, 128)     # each row's amax: its first element
    gt = torch.cat([g.t(), g.t()], 1)                       # the same amaxes down the columns
    odd = wide_range((8192 + 8, 4096 + 65) if big else (40, 136), torch.bfloat16, seed=11)
    odd[3, 5], odd[17, 130] = float("nan"), float("inf")   # one NaN row/column tile, one inf
    xs = [g, gt, odd, wide_range((4096, 7168) if big else (64, 256), torch.float32, seed=12)]
    with tuning(quantize=dict(rowcol_gluon=True)):
        for x in xs:
            xd = _on(x, device)
            for f8 in FP8S:
                rec = BlockwiseScaling(dtype=f8)  # 1x128, power-of-two scales: the kernel's case
                got = kq.quantize_rowwise_and_columnwise(xd, rec)
                ref = quantize_rowwise_and_columnwise(xd, rec)
                for k, r in zip(got, ref, strict=True):
                    assert_same(k, r, f"{tuple(x.shape)} {x.dtype} {f8}")


def case_gluon_fallback(device: str, big: bool) -> None:
    """A Triton whose Gluon cannot build the rows + columns kernel: one warning, then the Triton kernel,
    the reference's bits, and no further attempt."""
    import warnings

    from distwgrad.kernels import _quantize_rowcol_gluon as kg
    from triton.compiler.errors import CompilationError
    kq = _kernels()

    class _Unbuildable(CompilationError):
        def __init__(self):
            Exception.__init__(self, "no such Gluon API")
            self.message = "no such Gluon API"

    calls = []

    def launch(grid, *a, **k):
        calls.append(1)
        raise _Unbuildable()
    saved = kq._gluon_rowcol, kg.rowcol_kernel, kq._GLUON_FAILED
    kq._gluon_rowcol, kq._GLUON_FAILED = (lambda *a: True), None
    kg.rowcol_kernel = StubKernel(launch)
    try:
        x = _on(wide_range((64, 256), torch.bfloat16, seed=13), device)
        rec = BlockwiseScaling(act_block=(1, 128), weight_block=(128, 128))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                for k, r in zip(kq.quantize_rowwise_and_columnwise(x, rec), quantize_rowwise_and_columnwise(x, rec),
                                strict=True):
                    assert_same(k, r, "Triton fallback")
        assert len(calls) == 1 and "no such Gluon API" in (kq._GLUON_FAILED or "")
        assert sum("does not build" in str(w.message) for w in caught) == 1, [str(w.message) for w in caught]
    finally:
        kq._gluon_rowcol, kg.rowcol_kernel, kq._GLUON_FAILED = saved


def case_sweep(device: str, big: bool) -> None:
    """Every candidate tuning of the benchmark's sweep (``SWEEP``, ``qa/bench/fp8.py --quant-sweep``) on
    a shape that is no multiple of any tile: same bits as the reference, op by op. CI takes each op's first
    and last candidate (``sweep.sample``); ``--full`` takes all 19."""
    kq = _kernels()
    ops = {
        "per_tensor": lambda m, x: (m.quantize_per_tensor(x, E4M3),),
        "blockwise_1x128": lambda m, x: (m.quantize_blockwise(x, (1, 128), E4M3),),
        "blockwise_128x128": lambda m, x: (m.quantize_blockwise(x, (128, 128), E5M2),),
        "rowcol_1x128": lambda m, x: m.quantize_rowwise_and_columnwise(x, BlockwiseScaling(power_of_two=False)),
    }
    assert set(kq.SWEEP) == set(ops), sorted(kq.SWEEP)
    reference = SimpleNamespace(quantize_per_tensor=quantize_per_tensor, quantize_blockwise=quantize_blockwise,
                                quantize_rowwise_and_columnwise=quantize_rowwise_and_columnwise)
    x = _on(wide_range((4096 + 65, 2048 + 3) if big else (130, 200), torch.bfloat16, seed=7), device)
    for op, candidates in kq.SWEEP.items():
        ref = ops[op](reference, x)  # on the kernel's device, as in case_rowcol
        for cand in sweep.sample(candidates, 2):
            with tuning(quantize=cand):
                got = ops[op](kq, x)
            for k, r in zip(got, ref, strict=True):
                assert_same(k, r, f"{op} {cand}")


def case_checks(device: str, big: bool) -> None:
    kq = _kernels()
    x = torch.ones(8, 32, device=device)
    for fn, match in [
        (lambda: kq.quantize_per_tensor(x.t(), E4M3), "contiguous"),
        (lambda: kq.quantize_per_tensor(x.double(), E4M3), "float64"),
        (lambda: kq.quantize_per_tensor(x, torch.int8), "int8"),
        (lambda: kq.quantize_per_tensor(x, E4M3, amax=x[0, :1].half()), "amax"),
        (lambda: kq.quantize_blockwise(x[None], (1, 16), E4M3), r"2-D.*\(1, 8, 32\)"),
        (lambda: kq.quantize_blockwise(x, (1, 24), E4M3), "powers of two"),
        (lambda: kq.quantize_blockwise(x[:, ::2], (1, 16), E4M3), "strides"),
    ]:
        with pytest.raises(ValueError, match=match):
            fn()


def case_opcheck(device: str, big: bool) -> None:
    """Schemas, fake impls (shapes / dtypes under FakeTensorMode) and dispatch of the custom ops."""
    _kernels()
    x = wide_range((33, 40), torch.bfloat16).to(device)
    ops = torch.ops.distwgrad
    torch.library.opcheck(ops.fp8_quantize_per_tensor, (x, None, E4M3, 0))
    torch.library.opcheck(ops.fp8_quantize_per_tensor, (x, torch.ones(1, device=device), E5M2, 1))
    torch.library.opcheck(ops.fp8_quantize_blockwise, (x, 1, 16, E4M3, True))
    torch.library.opcheck(ops.fp8_quantize_blockwise, (x, 16, 16, E5M2, False))
    torch.library.opcheck(ops.fp8_quantize_rowwise_and_columnwise, (x, 16, E4M3, True))
    # [Note: custom op bypass]: eager calls run the implementation directly (same bits as the op); fake
    # tensors, the profiler and torch.compile see the op
    from distwgrad.kernels._dispatch import direct_call_ok
    from torch._subclasses.fake_tensor import FakeTensorMode
    kq = _kernels()
    assert direct_call_ok((x,))
    direct = kq.quantize_blockwise(x, (1, 16), E4M3)
    data, s_inv = ops.fp8_quantize_blockwise(x, 1, 16, E4M3, True)
    assert bits_equal(direct.data.cpu(), data.cpu()) and bits_equal(direct.scale_inv.cpu(), s_inv.cpu())
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        assert not direct_call_ok((fx,))
        q = kq.quantize_blockwise(fx, (1, 16), E4M3)
        assert q.data.shape == x.shape and q.scale_inv.shape == (33, 3)
    with torch.profiler.profile() as prof:
        assert not direct_call_ok((x,))
        kq.quantize_rowwise_and_columnwise(x, BlockwiseScaling(act_block=(1, 16), weight_block=(16, 16)))
    assert any(e.name == "distwgrad::fp8_quantize_rowwise_and_columnwise" for e in prof.events())
    compiled = torch.compile(lambda t: kq.quantize_blockwise(t, (1, 16), E4M3).data, fullgraph=True,
                             backend="aot_eager")
    assert bits_equal(compiled(x).cpu(), direct.data.cpu())


KERNEL_CASES = {f.__name__[5:]: f for f in (case_rounding, case_per_tensor, case_nonfinite, case_blockwise,
                                             case_rowcol, case_rowcol_gluon, case_gluon_fallback, case_pow2_scales,
                                             case_sweep, case_checks, case_opcheck)}


@pytest.mark.interpret
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_bit_exact_interpreted(case):
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, __file__, case], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"interpreted case {case!r} failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"


def test_kernel_launchers_reject_cpu_tensors():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("CPU tensors are accepted under TRITON_INTERPRET=1")
    kq = _kernels()
    with pytest.raises(ValueError, match="CUDA"):
        kq.quantize_per_tensor(torch.ones(4), E4M3)


def test_gluon_rows_and_columns_only_where_it_is_exact(monkeypatch):
    """The Gluon kernel takes a call only under its preconditions (128 tile, power-of-two scales, M a
    multiple of 4: x^T is written in 4-byte words; sm_90+, not interpreted); anything else must reach the
    Triton kernel, never a Gluon launch on a shape it would write wrongly."""
    pytest.importorskip("triton")
    kq = _kernels()
    from distwgrad.kernels import _quantize_rowcol_gluon as kg
    monkeypatch.setattr(kq, "_interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda_like = lambda m: SimpleNamespace(is_cuda=True, shape=(m, 256), device="cuda:0")
    assert kq._gluon_rowcol(cuda_like(256), 128, True) == kg.AVAILABLE
    assert not kq._gluon_rowcol(cuda_like(258), 128, True)                   # M % 4 != 0
    assert not kq._gluon_rowcol(cuda_like(256), 64, True)                    # another tile
    assert not kq._gluon_rowcol(cuda_like(256), 128, False)                  # dividing scales
    assert not kq._gluon_rowcol(SimpleNamespace(is_cuda=False, shape=(256, 256)), 128, True)
    with tuning(quantize=dict(rowcol_gluon=False)):
        assert not kq._gluon_rowcol(cuda_like(256), 128, True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert not kq._gluon_rowcol(cuda_like(256), 128, True)                   # before Hopper


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_bit_exact_gpu(case):
    KERNEL_CASES[case]("cuda", big=case not in ("checks", "opcheck"))


@pytest.mark.gpu
@gpu
def test_reference_is_device_independent():
    x = wide_range((4096 + 65, 2048 + 3), torch.bfloat16)
    for f8 in FP8S:
        assert_same(quantize_per_tensor(x.cuda(), f8), quantize_per_tensor(x, f8))
        for block in ((1, 128), (128, 128)):
            assert_same(quantize_blockwise(x.cuda(), block, f8), quantize_blockwise(x, block, f8))
        for rec in (BlockwiseScaling(dtype=f8), BlockwiseScaling(dtype=f8, power_of_two=False),
                    PerTensorScaling(fwd_dtype=f8)):
            for k, r in zip(quantize_rowwise_and_columnwise(x.cuda(), rec),
                            quantize_rowwise_and_columnwise(x, rec), strict=True):
                assert_same(k, r, f"rowcol {rec}")


@pytest.mark.interpret
def test_host_cost_bench_smoke():
    """qa/bench/quantize_host.py runs (launches stubbed) and reports every entry point per call."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, str(REPO / "qa" / "bench" / "quantize_host.py"), "--calls", "5",
                           "--device", "cpu"], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("quantize_per_tensor", "quantize_blockwise 1x128", "through the custom op", "alone",
                 "quantize_rowwise_and_columnwise"):
        line = next(ln for ln in proc.stdout.splitlines() if name in ln)
        assert float(line.split()[-2]) > 0, line


def test_sm90_build_of_the_rows_and_columns_kernel():
    """qa/bench/quantize_sass.py builds the kernel for sm_90a (no GPU needed): no spills, and power-of-two
    scales ([Note: power-of-two scales without division]) issue fewer instructions per element than the
    scales that divide, which is their point."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(REPO / "qa" / "bench"))
    try:
        import quantize_sass
    finally:
        sys.path.remove(str(REPO / "qa" / "bench"))
    try:
        r = quantize_sass.main(["--only", "rowcol w8 maxnreg128 (default)", "rowcol w8 maxnreg128, divisions"])
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    pow2, div = r["rowcol w8 maxnreg128 (default)"], r["rowcol w8 maxnreg128, divisions"]
    assert pow2["spill_bytes"] == 0, pow2  # (the dividing build spills a little at this register cap)
    assert pow2["per_element"] < div["per_element"], (pow2["per_element"], div["per_element"])


def test_sm90_build_of_the_gluon_rows_and_columns_kernel():
    """[Note: rows and columns without a transpose]: the Gluon kernel builds for sm_90a without a single
    byte-wise shared-memory load, without spills, and issues fewer instructions per element than the
    Triton kernel."""
    pytest.importorskip("triton")
    from distwgrad.kernels import _quantize_rowcol_gluon as kg
    if not kg.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    sys.path.insert(0, str(REPO / "qa" / "bench"))
    try:
        import quantize_sass
    finally:
        sys.path.remove(str(REPO / "qa" / "bench"))
    names = ["rowcol w8 maxnreg128 (default)", "rowcol gluon"]
    try:
        r = quantize_sass.main(["--only", *names])
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    triton_k, ours = (r[n] for n in names)
    assert ours["ops"]["LDS.U8"] == 0 < triton_k["ops"]["LDS.U8"]
    assert ours["spill_bytes"] == 0, ours
    assert ours["per_element"] < triton_k["per_element"]


if __name__ == "__main__":
    # Interpreter entry point (see the module docstring): python tests/test_fp8_quantize.py CASE
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    import warnings

    warnings.simplefilter("ignore", RuntimeWarning)  # numpy's 1/0 and NaN warnings inside the interpreter
    KERNEL_CASES[sys.argv[1]]("cpu", big=False)
    print(f"ok {sys.argv[1]}")
