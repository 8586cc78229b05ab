"""The torch route of the grouped-GEMM interface ([Note: fp32 on CUDA] in distwgrad/ops/grouped_gemm.py).

fp32 CUDA tensors take ``torch._grouped_mm``; the same functions run on CPU tensors here and are compared
with the in-package reference (a per-expert ``F.linear`` / ``mm`` loop). Both sum each output element over
the same K (or T) terms with fp32 products, but in different blockings, so they agree to a few fp32 ulps
of the sum's magnitude, not bit for bit: the bound is 8 ulps of ``K * max|a| * max|b|`` (``eps * K``
scaled), orders of magnitude below what a wrong group, a dropped bias or a missed accumulation gives (O(1)).
"""

from __future__ import annotations

import pytest
import torch

from distwgrad.ops import grouped_gemm as gg
from distwgrad.testing import reference

SPLITS = [[3, 0, 5, 2], [0, 0, 10, 0], [1, 1, 1, 7]]


def _bound(k: int, *operands: torch.Tensor) -> float:
    scale = 1.0
    for t in operands:
        scale *= float(t.abs().max()) if t.numel() else 0.0
    return 8 * torch.finfo(torch.float32).eps * k * max(scale, 1e-30)


def _problem(splits, k=16, n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(splits)
    x = torch.randn(t, k, generator=g)
    w = torch.randn(len(splits), n, k, generator=g)
    dy = torch.randn(t, n, generator=g)
    bias = torch.randn(len(splits), n, generator=g)
    offs = gg.splits_to_offsets(splits, len(splits), t, x.device)
    return x, w, dy, bias, offs


@pytest.mark.skipif(not gg._torch_grouped_mm(torch.float32, torch.device("cpu")),
                    reason="this torch build has no CPU torch._grouped_mm")
@pytest.mark.parametrize("splits", SPLITS)
def test_torch_route_matches_reference(splits):
    x, w, dy, bias, offs = _problem(splits)
    k, n = x.shape[1], w.shape[1]
    for b in (None, bias):
        y = gg._torch_fprop(x, w, offs, b)
        ref = reference.grouped_fprop(x, w, offs, b)
        assert (y - ref).abs().max() <= _bound(k, x, w) + (0 if b is None else _bound(1, b))
    assert (gg._torch_dgrad(dy, w, offs) - reference.grouped_dgrad(dy, w, offs)).abs().max() <= _bound(n, dy, w)
    fresh = gg._torch_wgrad(dy, x, offs, None)
    ref_w = reference.grouped_wgrad(dy, x, offs)
    assert (fresh - ref_w).abs().max() <= _bound(x.shape[0], dy, x)
    for e, s in enumerate(splits):  # an empty group's gradient is exactly zero
        if s == 0:
            assert torch.count_nonzero(fresh[e]) == 0
    start = torch.randn(w.shape, generator=torch.Generator().manual_seed(1))
    for out in (start.clone(), list(start.clone().unbind(0))):  # stacked and per-expert targets
        got = gg._torch_wgrad(dy, x, offs, out)
        got = torch.stack(got) if isinstance(got, list) else got
        add_ulps = 4 * torch.finfo(torch.float32).eps * float(start.abs().max())  # the one fp32 add
        assert (got - (start + ref_w)).abs().max() <= _bound(x.shape[0], dy, x) + add_ulps


def test_route_is_fp32_on_cuda_only():
    assert not gg.torch_route(torch.zeros(2, dtype=torch.float32))
    assert not gg.torch_route(torch.zeros(2, dtype=torch.bfloat16))
    meta = torch.zeros(2, dtype=torch.float32, device="meta")
    assert not gg.torch_route(meta)


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_one_routing_computes_its_offsets_once(device):
    """[Note: one routing, two GEMMs]: the same device ``m_splits`` again (fc2 after fc1) reuses its
    offsets; an in-place change, another tensor with the same values or (meta only: on CUDA its device
    assertion fires, as it must) another token count computes them afresh. The meta device runs the same
    code path as CUDA without a GPU."""
    dev = torch.device(device)
    m = torch.tensor([3, 0, 5], device=dev)
    first = gg.splits_to_offsets(m, 3, 8, dev)
    assert gg.splits_to_offsets(m, 3, 8, dev) is first
    assert gg.splits_to_offsets(m.clone(), 3, 8, dev) is not first
    again = gg.splits_to_offsets(m, 3, 8, dev)
    assert again is not first, "another tensor came between: the entry is the last one's"
    m.add_(0)  # an in-place change bumps the version counter
    changed = gg.splits_to_offsets(m, 3, 8, dev)
    assert changed is not again and gg.splits_to_offsets(m, 3, 8, dev) is changed
    if dev.type == "meta":  # on CUDA the wrong count would (rightly) fire the device assertion
        assert gg.splits_to_offsets(m, 3, 9, dev) is not changed
    else:
        assert torch.equal(changed.cpu(), torch.tensor([3, 3, 8], dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_capture_computes_its_own_offsets():
    """A CUDA graph replays the cumulative sum of its own ``m_splits``, never offsets an eager call left."""
    m = torch.tensor([3, 0, 5], device="cuda")
    eager = gg.splits_to_offsets(m, 3, 8, m.device)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        captured = gg.splits_to_offsets(m, 3, 8, m.device)
    assert captured is not eager
    m.copy_(torch.tensor([1, 6, 1], device="cuda"))
    graph.replay()
    assert torch.equal(captured.cpu(), torch.tensor([1, 7, 8], dtype=torch.int32))
