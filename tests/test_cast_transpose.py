"""``kernels/cast_transpose.py`` ([Note: per-tensor cast and transpose]): the per-tensor cast of x and its
transposed copy from one read of x, bit-identical to the two kernels it replaces (``quantize_per_tensor``,
then ``transpose`` or ``transpose_aligned``) and to the torch reference (``distwgrad.fp8.quantize``'s
``quantize_per_tensor``, ``transpose_quantized``, ``align_token_groups``); on CPU under
``TRITON_INTERPRET=1`` (a child process) and on the GPU. fp32 inputs round in software (the Note says why):
``_check_wide_rows`` holds them at the shape where the hardware conversion went wrong."""

from __future__ import annotations

import math
import os

import pytest
import torch
from test_token_layout import CASES as LAYOUT_CASES

from distwgrad.testing import sweep

_HERE = os.path.abspath(__file__)

# (T, R, end offsets): the cases of tests/test_token_layout.py (empty groups, unrouted tokens after the last
# group, every token in one group, no tokens, R off the block, 256 groups), decreasing offsets (a group
# that starts before the previous one ends: its tokens lie in two places; tokens 500.. in none; held to
# transpose_aligned, the torch reference takes sorted offsets only), and no groups
CASES = [*LAYOUT_CASES, (700, 48, [300, 100, 500]), (300, 32, [])]


def _inputs(T: int, R: int, gen: torch.Generator) -> list[tuple[torch.Tensor, int]]:
    """(x, margin): random bf16, fp16 and fp32; special values (NaN and inf: the padding stays zero, the
    scale NaN); all zeros (amax 0)."""
    x = torch.randn(T, R, generator=gen) * 3
    special = x.clone()
    if special.numel() > 2:
        special.view(-1)[1], special.view(-1)[-1] = math.nan, -math.inf
    return [(x.bfloat16(), 0), (x.half(), 1), (x, 0), (special.bfloat16(), 0), (torch.zeros(T, R), 0)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu().reshape(-1).view(torch.uint8),
                                                                     b.cpu().reshape(-1).view(torch.uint8))


def _check_cases(device: str) -> None:
    from distwgrad.kernels import quantize as kq
    from distwgrad.kernels import token_layout as kt
    from distwgrad.kernels.cast_transpose import cast_transpose_per_tensor

    from distwgrad.fp8 import quantize as ref
    from distwgrad.ops.grouped_gemm_fp8 import align_token_groups
    gen = torch.Generator().manual_seed(0)
    dtypes = [torch.float8_e4m3fn, torch.float8_e5m2]
    # every case's random bf16 input (three alignments); of the other inputs a fixed sample of 4 in CI,
    # all with --full
    others = set(sweep.sample([(i, j) for i in range(len(CASES)) for j in range(1, 5)], 4))
    for i, (T, R, offs) in enumerate(CASES):
        for j, (x, margin) in enumerate(_inputs(T, R, gen)):
            if j and (i, j) not in others:
                continue
            dtype = dtypes[(i + j) % 2]
            xd = x.to(device)
            data, s_inv = kq.quantize_per_tensor(xd, dtype, margin=margin)  # the two-kernel path
            want = ref.quantize_per_tensor(x, dtype, margin=margin)  # the torch reference
            assert _same(data, want.data) or x.isnan().any(), (T, R, x.dtype)  # NaN bytes: unspecified
            got = cast_transpose_per_tensor(xd, dtype, margin=margin)
            assert got[3] is None and _same(got[0], data) and _same(got[1], s_inv), (T, R, x.dtype)
            assert _same(got[2], kt.transpose(data)), (T, R, x.dtype)
            if not x.isnan().any():
                assert _same(got[2], ref.transpose_quantized(want).data), (T, R, x.dtype)
            offs_E = torch.tensor(offs, dtype=torch.int32)
            for align in (128, 64, 16) if j == 0 else (128,):  # 64, 16: a program's places span several groups
                got = cast_transpose_per_tensor(xd, dtype, margin=margin, offs_E=offs_E.to(device), align=align)
                data_t, ends = kt.transpose_aligned(data, offs_E.to(device), align)
                assert _same(got[0], data) and _same(got[1], s_inv), (T, R, offs, align, x.dtype)
                assert _same(got[2], data_t) and torch.equal(got[3].cpu(), ends.cpu()), (T, R, offs, align)
                if not x.isnan().any() and offs == sorted(offs):  # the reference takes sorted offsets
                    aligned, ref_ends = align_token_groups(ref.transpose_quantized(want), offs_E, align)
                    assert _same(got[2], aligned.data) and torch.equal(got[3].cpu(), ref_ends), (T, R, offs)


def _check_tilings(device: str) -> None:
    """Other tilings of the token layout (``TokenLayoutTuning``): programs of 256 places, which span groups on
    the 128 grid, and of 64 places by 32 features; the same bits."""
    from distwgrad.kernels import quantize as kq
    from distwgrad.kernels import token_layout as kt
    from distwgrad.kernels import tuning
    from distwgrad.kernels.cast_transpose import cast_transpose_per_tensor
    T, R, offs = CASES[0]
    x = (torch.randn(T, R, generator=torch.Generator().manual_seed(1)) * 3).bfloat16().to(device)
    offs_E = torch.tensor(offs, dtype=torch.int32, device=device)
    data, s_inv = kq.quantize_per_tensor(x, torch.float8_e4m3fn)
    for block_t, block_r in ((256, 64), (64, 32)):
        with tuning(token_layout=dict(block_t=block_t, block_r=block_r)):
            plain = cast_transpose_per_tensor(x, torch.float8_e4m3fn)
            aligned = cast_transpose_per_tensor(x, torch.float8_e4m3fn, offs_E=offs_E)
        assert _same(plain[0], data) and _same(plain[2], kt.transpose(data)), (block_t, block_r)
        assert _same(aligned[0], data) and _same(aligned[1], s_inv), (block_t, block_r)
        assert _same(aligned[2], kt.transpose_aligned(data, offs_E)[0]), (block_t, block_r)


def _check_wide_rows(device: str, rows: int = 1024) -> None:
    """``rows`` x 512: R a multiple of 16, which Triton specializes, so the loads are vectorized. With fp32 input
    the hardware conversion's transposed copy came out wrong at 1024 x 512 on an H200 (Triton 3.6); fp32 now
    rounds in software ([Note: per-tensor cast and transpose]). Both source dtypes, both formats, plain and
    aligned: the bits of the two kernels. The interpreter runs 128 rows (the same R and its vectorized path;
    the hardware conversion it guards against exists only on the GPU, which runs the full shape)."""
    from distwgrad.kernels import quantize as kq
    from distwgrad.kernels import token_layout as kt
    from distwgrad.kernels.cast_transpose import cast_transpose_per_tensor
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(2)).to(device)
    offs_E = torch.tensor([rows // 3, rows], dtype=torch.int32, device=device)
    for src in (torch.float32, torch.bfloat16):
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            xs = x.to(src)
            data, s_inv = kq.quantize_per_tensor(xs, dtype)
            plain = cast_transpose_per_tensor(xs, dtype)
            aligned = cast_transpose_per_tensor(xs, dtype, offs_E=offs_E)
            assert _same(plain[0], data) and _same(plain[1], s_inv), (src, dtype)
            assert _same(plain[2], kt.transpose(data)), (src, dtype)
            assert _same(aligned[0], data) and _same(aligned[2], kt.transpose_aligned(data, offs_E)[0]), (src, dtype)


def _case_interpreter() -> None:
    from distwgrad.kernels import cast_transpose as kc
    from distwgrad.kernels import token_layout as kt
    _check_cases("cpu")
    _check_tilings("cpu")
    _check_wide_rows("cpu", rows=128)
    x = torch.randn(64, 32).bfloat16()
    offs = torch.tensor([20, 64], dtype=torch.int32)
    ends, table = kt.aligned_offsets(offs, 64, 128)
    for args in ((x, ends, table, torch.float8_e4m3fn, 0, 128), (x, None, None, torch.float8_e5m2, 1, 128)):
        torch.library.opcheck(torch.ops.distwgrad.fp8_cast_transpose_per_tensor.default, args,
                              test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    f8 = torch.float8_e4m3fn
    for (bad, kwargs), match in (
            ((x.t(), {}), "need a contiguous input"),
            ((x[0], {}), r"x must be 2-D \[T, R\] \(tokens, features\), got shape \(32,\)"),
            ((x, {"offs_E": offs.long()}), r"cast_transpose_per_tensor: offs_E must be int32 \[E\] on cpu, got "
                                           "torch.int64"),
            ((x, {"offs_E": offs, "align": 100}), "align must be a positive multiple of 16, got 100")):
        with pytest.raises(ValueError, match=match):
            kc.cast_transpose_per_tensor(bad, f8, **kwargs)
    with pytest.raises(ValueError, match="write float8_e4m3fn or float8_e5m2, got torch.bfloat16"):
        kc.cast_transpose_per_tensor(x, torch.bfloat16)


@pytest.mark.interpret
def test_cast_transpose_interpreted():
    pytest.importorskip("triton")
    from distwgrad.testing.interpreter import run_interpreted
    run_interpreted(_HERE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cast_transpose_gpu():
    _check_cases("cuda")
    _check_tilings("cuda")
    _check_wide_rows("cuda")


if __name__ == "__main__":  # child of test_cast_transpose_interpreted
    _case_interpreter()
    print("ok")
