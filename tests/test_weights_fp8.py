"""``kernels/weights_fp8.py`` ([Note: a group of weights in two launches]): a group of weights quantized per
tensor in two launches, as views of one stacked buffer, holds the bits of quantizing each weight alone
(``distwgrad.fp8.weights.quantize_weight``, the torch reference), in both layouts. The kernels run on CPU
under ``TRITON_INTERPRET=1`` (a child process) and on the GPU."""

from __future__ import annotations

import os

import pytest
import torch

_HERE = os.path.abspath(__file__)


def _weights(E: int, N: int, K: int, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(E * N + K)
    ws = [torch.randn(N, K, generator=gen) * 4.0 ** (e % 5 - 2) for e in range(E)]
    ws[1].zero_()                                   # amax 0: scale 1
    ws[2][0, 0] = float("nan")                      # NaN scale for that expert alone
    if E > 3:
        ws[3][N - 1, K - 1] = float("inf")
    return [w.to(device, dtype) for w in ws]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, any NaN equal to any NaN (the NaN sign is not specified;
    tests/test_fp8_quantize_kernels.py)."""
    a, b = a.cpu(), b.cpu()
    view = torch.uint8 if a.element_size() == 1 else torch.int32
    return bool(((a.view(view) == b.view(view)) | (a.float().isnan() & b.float().isnan())).all())


def _check(device: str) -> None:
    from distwgrad.fp8.recipe import PerTensorScaling
    from distwgrad.fp8.weights import quantize_weight
    from distwgrad.ops.quantize import quantize_weights_per_tensor
    for E, N, K, dtype, fp8, margin in ((5, 48, 80, torch.float32, torch.float8_e4m3fn, 0),
                                        (4, 130, 66, torch.bfloat16, torch.float8_e5m2, 2)):
        ws = _weights(E, N, K, dtype, device)
        recipe = PerTensorScaling(fwd_dtype=fp8, margin=margin)
        ref = [quantize_weight(w.cpu(), recipe)[0] for w in ws]
        for transpose in (False, True):
            experts = quantize_weights_per_tensor(ws, fp8, margin=margin, transpose=transpose)
            assert experts.data.shape == (E, N, K) and (experts.data.stride(1) == 1) is transpose  # dgrad's layout
            assert experts.data.is_contiguous() is not transpose and experts.amax.shape == (E,)
            for e, (g, r) in enumerate(zip(experts.unbind(), ref)):
                assert g.data.shape == (N, K) and g.scale_inv.shape == () and g.orig_dtype == dtype
                assert _same(g.data, r.data) and _same(g.scale_inv, r.scale_inv), (E, e, transpose)
        # the same weights 4 bytes off 16-byte alignment (views into one buffer): the kernels' unaligned
        # loads ([Note: aligned table entries]), the bits the same
        from distwgrad.kernels.weights_fp8 import _aligned
        buf = torch.empty(E * N * K + 2, dtype=dtype, device=device)
        off = 4 // buf.element_size()
        shifted = [buf[off + e * N * K:off + (e + 1) * N * K].view(N, K).copy_(w) for e, w in enumerate(ws)]
        assert _aligned(tuple(w.data_ptr() for w in ws)) and not _aligned(tuple(w.data_ptr() for w in shifted))
        for transpose in (False, True):
            got = quantize_weights_per_tensor(shifted, fp8, margin=margin, transpose=transpose)
            for e, (g, r) in enumerate(zip(got.unbind(), ref)):
                assert _same(g.data, r.data) and _same(g.scale_inv, r.scale_inv), ("unaligned", E, e, transpose)
        # the same weights packed into one [E, N, K] tensor with one amax, quantized from the tensor itself
        # (quantize_packed_per_tensor): the bits of the table-driven launch given that amax per expert
        from distwgrad.kernels.weights_fp8 import quantize_packed_per_tensor
        packed_all = torch.stack(ws)
        one = torch.tensor([3.0], device=device)
        for transpose in (False, True):
            want = quantize_weights_per_tensor(list(packed_all.unbind(0)), fp8, margin=margin, transpose=transpose,
                                               amax=one.expand(E).contiguous())
            data, s_inv = quantize_packed_per_tensor(packed_all, fp8, one, margin=margin, transpose=transpose)
            assert data.shape == (E, N, K) and (data.stride(1) == 1) is transpose
            assert _same(data, want.data) and _same(s_inv, want.scale_inv), ("packed", E, transpose)
        # a packed [E, N, K] parameter: its experts share one amax, as quantize_weight gives them
        packed = torch.stack([w for w in ws if bool(torch.isfinite(w).all())])  # one amax: the largest expert's
        ref = quantize_weight(packed.cpu(), recipe)
        got = quantize_weights_per_tensor(list(packed.unbind(0)), fp8, margin=margin, shared=[0] * packed.shape[0])
        for g, r in zip(got.unbind(), ref):
            assert _same(g.data, r.data) and _same(g.scale_inv, r.scale_inv)


def _module_reuses_forward_amax() -> None:
    """GroupedLinear (kernel route) takes its experts' amaxes once per step: backward re-quantizes from
    forward's, unless a weight changed in between (then it takes them again)."""
    from distwgrad.kernels import weights_fp8 as kw

    from distwgrad.fp8 import PerTensorScaling, fp8_autocast
    from distwgrad.nn import GroupedLinear
    calls, real = [], kw._group_amax  # (what group_amax and quantize_weights_per_tensor launch through)
    kw._group_amax = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        torch.manual_seed(0)
        mod = GroupedLinear(3, 32, 16, bias=False)
        x = torch.randn(40, 32, requires_grad=True)
        for change in (False, True):
            calls.clear()
            with fp8_autocast(PerTensorScaling()):
                y = mod(x, [10, 14, 16])
            if change:
                with torch.no_grad():
                    mod.weight1.mul_(2.0)
            y.sum().backward()
            assert len(calls) == (2 if change else 1), (change, calls)
    finally:
        kw._group_amax = real


def _sharded_experts_match_quantize_weight(device: str = "cpu") -> None:
    """A packed ShardedWeight's experts as one QuantizedExperts (one launch, the GEMM's layout) carry the
    bits of quantizing each expert with the weight's amax (``quantize_weight``), forward and dgrad layouts."""
    from distwgrad import ShardedWeight
    from distwgrad.fp8 import PerTensorScaling
    from distwgrad.fp8.weights import _sharded_experts, global_amax, quantize_weight

    torch.manual_seed(0)
    w = ShardedWeight.from_full(torch.randn(3, 32, 16, device=device), param_dtype=torch.bfloat16)
    recipe = PerTensorScaling()
    ref = quantize_weight(w.detach(), recipe, amax=global_amax(w))
    forward = _sharded_experts(w, recipe, backward=False)
    for backward, amax in ((False, None), (True, None), (True, forward.amax)):  # backward reuses forward's amax
        q = _sharded_experts(w, recipe, backward=backward, amax=amax)
        assert q.data.shape == (3, 32, 16) and (q.data.stride(1) == 1) == backward
        for e, r in enumerate(ref):
            assert torch.equal(q.data[e].view(torch.uint8), r.data.view(torch.uint8)), (backward, e)
            assert torch.equal(q.scale_inv[e], r.scale_inv.reshape(())), (backward, e)
    # the given amax is the one used: 4x the amax is 4x the scale_inv (powers of two scale exactly)
    assert torch.equal(_sharded_experts(w, recipe, backward=True, amax=forward.amax * 4).scale_inv,
                       forward.scale_inv * 4)


def _blockwise_experts(device: str) -> None:
    """A packed weight's experts quantized blockwise in one launch (``quantize_experts_blockwise``), in the
    forward layout and stored transposed (dgrad's), hold the bits of quantizing each expert alone with the
    kernel (and the torch reference), whatever the block grid's edge; the module route
    (``materialize_quantized_group(..., stacked=True)``) hands them over so for a packed ShardedWeight of one
    rank and a plain packed parameter, and keeps the per-expert path for a packed weight whose rows straddle
    blocks."""
    from distwgrad.kernels.quantize import quantize_blockwise as kernel_blockwise

    from distwgrad import ShardedWeight
    from distwgrad.fp8 import BlockwiseScaling, PerTensorScaling, QuantizedExperts, quantize_blockwise
    from distwgrad.fp8.weights import materialize_quantized, materialize_quantized_group
    from distwgrad.ops.quantize import quantize_experts_blockwise
    for E, N, K, B, dtype, fp8 in ((3, 64, 80, 32, torch.float32, torch.float8_e4m3fn),
                                   (3, 128, 136, 128, torch.bfloat16, torch.float8_e5m2)):
        w = torch.stack(_weights(E, N, K, dtype, device))  # a zero expert, a NaN, an inf
        recipe = BlockwiseScaling(weight_block=(B, B), dtype=fp8)
        for transpose in (False, True):
            got = quantize_experts_blockwise(w, recipe, transpose=transpose)
            assert isinstance(got, QuantizedExperts) and got.block == (B, B) and got.data.shape == (E, N, K)
            assert (got.data.stride(1) == 1) is transpose and got.scale_inv.shape == (E, N // B, -(-K // B))
            for e in range(E):
                data, s_inv = kernel_blockwise(w[e], (B, B), fp8)
                ref = quantize_blockwise(w[e].cpu(), (B, B), fp8)
                assert _same(got.data[e], data) and _same(got.scale_inv[e], s_inv), (E, e, transpose)
                assert _same(got.data[e], ref.data) and _same(got.scale_inv[e], ref.scale_inv), (E, e, transpose)
    recipe = BlockwiseScaling(weight_block=(32, 32))
    torch.manual_seed(0)
    full = torch.randn(3, 64, 48, device=device)
    for w in (ShardedWeight.from_full(full.clone(), param_dtype=torch.bfloat16), torch.nn.Parameter(full.clone())):
        ref = materialize_quantized(w, recipe, backward=False)
        for backward in (False, True):
            q = materialize_quantized_group([w], recipe, backward=backward, stacked=True)
            assert isinstance(q, QuantizedExperts) and (q.data.stride(1) == 1) is backward
            assert all(_same(g.data, r.data) and _same(g.scale_inv, r.scale_inv) for g, r in zip(q.unbind(), ref))
    # a Linear's matrix ShardedWeight of one rank, both recipes: handed over in dgrad's layout, same bits
    for r in (recipe, PerTensorScaling()):
        w = ShardedWeight.from_full(full[0].clone(), param_dtype=torch.bfloat16)
        ref = materialize_quantized(w, r, backward=True)
        q = materialize_quantized_group([w], r, backward=True, stacked=True)
        assert isinstance(q, QuantizedExperts) and q.data.shape == (1, 64, 48) and q.data.stride(1) == 1, r
        assert _same(q.data[0], ref[0].data) and _same(q.scale_inv[0], ref[0].scale_inv), r
    odd = torch.nn.Parameter(torch.randn(3, 40, 48, device=device))  # 40 rows: a block would hold two experts
    assert isinstance(materialize_quantized_group([odd], recipe, backward=False, stacked=True), list)
    with pytest.raises(ValueError, match=r"N a multiple of a square block's side, got shape \(3, 40, 48\) and "
                                         r"block \(32, 32\)"):
        quantize_experts_blockwise(odd.detach(), recipe)


def _case_interpreter() -> None:
    _check("cpu")
    _blockwise_experts("cpu")
    _module_reuses_forward_amax()
    _sharded_experts_match_quantize_weight()
    from distwgrad.ops.quantize import quantize_weights_per_tensor
    with pytest.raises(ValueError, match=r"weights\[1\] is torch.float32 \(4, 8\) on cpu, weights\[0\] torch.float32 "
                                         r"\(4, 4\)"):
        quantize_weights_per_tensor([torch.ones(4, 4), torch.ones(4, 8)], torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="no weights"):
        quantize_weights_per_tensor([], torch.float8_e4m3fn)
    # a later weight that fails the group's one pass gets the full checks, which name what is wrong
    with pytest.raises(ValueError, match=r"contiguous input, got shape \(4, 4\) with strides \(1, 4\)"):
        quantize_weights_per_tensor([torch.ones(4, 4), torch.ones(4, 4).t()], torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"weights\[2\] is torch.float16 \(4, 4\) on cpu, weights\[0\] torch.float32"):
        quantize_weights_per_tensor([torch.ones(4, 4)] * 2 + [torch.ones(4, 4, dtype=torch.float16)],
                                    torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"take .*got torch.int32"):
        quantize_weights_per_tensor([torch.ones(4, 4), torch.ones(4, 4, dtype=torch.int32)], torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="expected a torch.Tensor, got list"):
        quantize_weights_per_tensor([torch.ones(4, 4), [[1.0] * 4] * 4], torch.float8_e4m3fn)


@pytest.mark.interpret
def test_quantize_weights_interpreted():
    pytest.importorskip("triton")
    from distwgrad.testing.interpreter import run_interpreted
    run_interpreted(_HERE, kernels_on_cpu=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quantize_weights_gpu():
    _check("cuda")
    _blockwise_experts("cuda")
    _sharded_experts_match_quantize_weight("cuda")


if __name__ == "__main__":  # child of test_quantize_weights_interpreted
    _case_interpreter()
    print("ok")


def test_quantized_experts():
    """``QuantizedExperts`` (the stacked per-tensor weights a GroupedLinear hands its GEMMs): checked on
    construction; its emulation values are each expert's ``dequantize``; dgrad reads an N-contiguous stack
    in place and copies any other into that layout; its experts unbind into ``Quantized`` views."""
    from distwgrad.fp8 import PerTensorScaling, QuantizedExperts, dequantize, quantize_per_tensor
    from distwgrad.fp8.emulate import dequantize_weights
    from distwgrad.ops import grouped_gemm_fp8 as gg8
    gen = torch.Generator().manual_seed(0)
    qs = [quantize_per_tensor(torch.randn(6, 10, generator=gen) * (e + 1), torch.float8_e4m3fn) for e in range(3)]
    data, scales = torch.stack([q.data for q in qs]), torch.stack([q.scale_inv for q in qs])
    experts = QuantizedExperts(data, scales, torch.float32)
    assert len(experts) == 3
    assert torch.equal(gg8._emulated_weights(experts), dequantize_weights(qs, packed=True))
    for q, u in zip(qs, experts.unbind()):
        assert torch.equal(dequantize(u), dequantize(q))
    n_major = QuantizedExperts(data.transpose(1, 2).contiguous().transpose(1, 2), scales, torch.float32)
    got, s = gg8._contraction_contiguous(n_major)
    assert got.data_ptr() == n_major.data.data_ptr() and s is scales        # read in place
    got, _ = gg8._contraction_contiguous(experts)
    assert got.stride(1) == 1 and torch.equal(got.float(), data.float())     # copied into dgrad's layout
    act, _ = gg8.quantize_operand(torch.randn(4, 10), PerTensorScaling(), grad=False)
    assert gg8.fp8_kernels_accept([act], experts) is gg8.gg.kernels_available(act.data)
    with pytest.raises(ValueError, match=r"data \(3, 6, 10\) with block None needs scale_inv \[3\], got \(2,\)"):
        QuantizedExperts(data, scales[:2], torch.float32)
    with pytest.raises(ValueError, match=r"with block \(4, 4\) needs scale_inv \[3, 2, 3\], got \(3,\)"):
        QuantizedExperts(data, scales, torch.float32, None, (4, 4))
    with pytest.raises(ValueError, match=r"block must be None or a square \(B, B\), got \(4, 8\)"):
        QuantizedExperts(data, scales, torch.float32, None, (4, 8))
    with pytest.raises(ValueError, match=r"data must be \[E, N, K\], got \(6, 10\)"):
        QuantizedExperts(data[0], scales, torch.float32)
    with pytest.raises(ValueError, match="scale_inv must be float32"):
        QuantizedExperts(data, scales.double(), torch.float32)
