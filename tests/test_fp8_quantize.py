"""FP8 quantization: recipe validation and the reference's documented properties.

The reference (``distwgrad.fp8.quantize``) is the oracle of the Triton kernels, which
``test_fp8_quantize_kernels.py`` checks against it bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
import threading

import pytest
import torch
from fp8_quantize_cases import E4M3, E5M2, FP8S, assert_same, bits_equal, wide_range

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("poison", [None, math.nan, math.inf, -math.inf])
def test_compute_amax_is_the_max_of_abs_in_one_reduction(dtype, poison):
    """The one-pass amax (the infinity norm) against ``x.abs().amax()``, on a tensor of many reduction
    blocks with one non-finite value deep inside: equal bits, NaN as +inf."""
    x = (torch.randn(300, 517, generator=torch.Generator().manual_seed(3)) * 30).to(dtype)
    if poison is not None:
        x[211, 401] = poison
    want = x.abs().amax().float()
    want = torch.where(want.isnan(), math.inf, want)
    assert torch.equal(compute_amax(x), want)


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
