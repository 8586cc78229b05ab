"""``kernels/token_layout.py`` ([Note: aligned token groups]): the per-tensor x^T written with each token
group on the 128-token grid, bit-identical to the torch reference ``align_token_groups`` (of the plain
transposed copy), and the plain transpose, bit-identical to ``transpose_quantized``; on CPU under
``TRITON_INTERPRET=1`` (a child process) and on the GPU."""

from __future__ import annotations

import os

import pytest
import torch

_HERE = os.path.abspath(__file__)

# (T, R, end offsets): empty groups, a group inside one chunk, groups on the grid, unrouted tokens after
# the last group, every token in the last group, no tokens, R off the 64-row block, 256 groups
CASES = [
    (700, 48, [100, 100, 350, 600, 650]),
    (700, 200, [0, 0, 0, 0, 700]),
    (300, 64, [128, 256, 300]),
    (5, 16, [1, 2, 3, 4, 5]),
    (0, 16, [0, 0]),
    (129, 72, [129]),
    (1000, 40, sorted(torch.randint(0, 1001, (256,), generator=torch.Generator().manual_seed(3)).tolist())),
]


def _check_cases(device: str) -> None:
    from distwgrad.kernels.token_layout import transpose_aligned

    from distwgrad.fp8.quantize import quantize_per_tensor, transpose_quantized
    from distwgrad.ops.grouped_gemm_fp8 import align_token_groups, wgrad_offsets
    gen = torch.Generator().manual_seed(0)
    from distwgrad.kernels.token_layout import transpose
    for (T, R, offs), dtype in zip(CASES, [torch.float8_e4m3fn, torch.float8_e5m2] * len(CASES)):
        q = quantize_per_tensor(torch.randn(T, R, generator=gen), dtype)
        plain = transpose(q.data.to(device))  # the plain layout (what the per-tensor recipe runs otherwise)
        assert plain.dtype == dtype and torch.equal(plain.cpu().view(torch.uint8),
                                                    transpose_quantized(q).data.view(torch.uint8)), (T, R)
        offs_E = torch.tensor(offs, dtype=torch.int32)
        ref, ref_ends = align_token_groups(transpose_quantized(q), offs_E)
        got, ends = transpose_aligned(q.data.to(device), offs_E.to(device))
        assert got.dtype == dtype and tuple(got.shape) == tuple(ref.data.shape), (got.shape, ref.data.shape)
        assert torch.equal(got.cpu().view(torch.uint8), ref.data.view(torch.uint8)), (T, R, offs)
        assert torch.equal(ends.cpu(), ref_ends) and torch.equal(wgrad_offsets(offs_E, T), ref_ends)
        # a grid finer than the kernel's 128 columns per program: a program's columns span several groups
        # (each column finds its own; on the 128 grid a program finds its one group once)
        for align in (64, 16):
            ref, ref_ends = align_token_groups(transpose_quantized(q), offs_E, align)
            got, ends = transpose_aligned(q.data.to(device), offs_E.to(device), align)
            assert torch.equal(got.cpu().view(torch.uint8), ref.data.view(torch.uint8)), (T, R, offs, align)
            assert torch.equal(ends.cpu(), ref_ends), (T, R, offs, align)


def _layout_kernel_matches_torch(device: str) -> None:
    """The layout kernel (one launch) gives ``_layout_torch``'s values, whatever the offsets: unsorted,
    negative or past T, int32 or int64, one group, none, 1000 groups."""
    from distwgrad.kernels import token_layout as kt
    gen = torch.Generator().manual_seed(5)
    cases = [([100, 50, 350, -3, 900], 700), ([7], 7), ([], 10), ([0, 0, 5], 0),
             (torch.randint(-20, 1100, (1000,), generator=gen).tolist(), 1000)]
    for (offs, T), dtype in zip(cases, [torch.int32, torch.int64] * len(cases)):
        for align in (16, 128):
            offs_E = torch.tensor(offs, dtype=dtype)
            assert kt._on_kernel(offs_E.to(device))
            got, want = kt._layout_kernel_call(offs_E.to(device), T, align), kt._layout_torch(offs_E, T, align)
            assert all(g.dtype == torch.int32 and torch.equal(g.cpu(), w) for g, w in zip(got, want)), (offs, T, align)


def _case_interpreter() -> None:
    _check_cases("cpu")
    _layout_kernel_matches_torch("cpu")
    from distwgrad.kernels import token_layout as kt
    q = torch.zeros(64, 32, dtype=torch.float8_e4m3fn)
    offs = torch.tensor([20, 64], dtype=torch.int32)
    ends, table = kt.aligned_offsets(offs, 64, 128)
    torch.library.opcheck(torch.ops.distwgrad.fp8_transpose_aligned.default, (q, ends, table, 128),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(torch.ops.distwgrad.fp8_transpose.default, (q,),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    with pytest.raises(ValueError, match=r"transpose: data must be a contiguous float8"):
        kt.transpose(q.t())
    for bad, match in (((q.float(), offs), "contiguous float8 \\[T, R\\] tensor, got torch.float32"),
                       ((q.t(), offs), "strides \\(1, 32\\)"),
                       ((q, offs.long()), "offs_E must be int32 \\[E\\] on cpu, got torch.int64"),
                       ((q, offs, 100), "align must be a positive multiple of 16, got 100")):
        with pytest.raises(ValueError, match=match):
            kt.transpose_aligned(*bad)


def test_layout_computed_once_per_routing():
    """[Note: one layout per routing]: the same offsets tensor gets the same layout tensors back; another
    (T, align) its own; an in-place write to the offsets, or a compiled trace, computes afresh."""
    pytest.importorskip("triton")
    from distwgrad.kernels import token_layout as kt

    from distwgrad.fp8.quantize import quantize_per_tensor, transpose_quantized
    from distwgrad.ops.grouped_gemm_fp8 import align_token_groups

    def reference(offs, T, align):
        q = quantize_per_tensor(torch.zeros(T, 16), torch.float8_e4m3fn)
        return align_token_groups(transpose_quantized(q), offs.clone(), align)[1]

    offs = torch.tensor([100, 100, 350, 600, 650], dtype=torch.int32)
    first = kt.aligned_offsets(offs, 700, 128)
    assert kt.aligned_offsets(offs, 700, 128) is first
    other = kt.aligned_offsets(offs, 700, 64)
    assert other is not first and torch.equal(other[0], reference(offs, 700, 64))
    assert kt.aligned_offsets(offs, 700, 128) is first  # both kept
    offs[1] = 300  # an in-place write: the layouts of the old values are dropped
    again = kt.aligned_offsets(offs, 700, 128)
    assert again is not first and torch.equal(again[0], reference(offs, 700, 128))
    assert not torch.equal(again[0], first[0])
    again[0].add_(1)  # a caller writes into the returned ends: the next call does not hand them out
    fresh = kt.aligned_offsets(offs, 700, 128)
    assert fresh[0] is not again[0] and torch.equal(fresh[0], reference(offs, 700, 128))
    again = fresh
    ends, table = kt.aligned_offsets(offs.clone(), 700, 128)  # another tensor: its own layout, the same values
    assert torch.equal(ends, again[0]) and torch.equal(table, again[1])
    seen = []
    traced = torch.compile(lambda o: kt.aligned_offsets(o, 700, 128)[0] + 0,
                           backend=lambda gm, _: seen.append(gm) or gm)
    assert torch.equal(traced(offs), again[0]) and seen, "the layout's ops are traced into the graph"
    assert not kt._on_kernel(offs) or os.environ.get("TRITON_INTERPRET") == "1"  # the CPU: torch's operations


@pytest.mark.interpret
def test_transpose_aligned_interpreted():
    pytest.importorskip("triton")
    from distwgrad.testing.interpreter import run_interpreted
    run_interpreted(_HERE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_transpose_aligned_gpu():
    _check_cases("cuda")
    _layout_kernel_matches_torch("cuda")


if __name__ == "__main__":  # child of test_transpose_aligned_interpreted
    _case_interpreter()
    print("ok")
