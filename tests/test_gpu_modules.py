"""The module paths on CUDA (bf16, Triton grouped GEMM), run by qa/L2_gpu/run.sh on a GPU machine.

Tolerance: bf16 GEMMs with fp32 accumulation are compared against an fp64 reference; our error must stay
within 2x the error of the plain bf16 torch computation of the same product (the reference's own
rounding), plus a floor of one bf16 ulp at the output's magnitude for outputs near zero.
"""

from __future__ import annotations

import pytest
import torch

import distwgrad
from distwgrad.nn import GroupedLinear, Linear

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _close_to_fp64(ours, torch_bf16, exact):
    err = (ours.double() - exact).abs().max().item()
    ref_err = (torch_bf16.double() - exact).abs().max().item()
    floor = torch.finfo(torch.bfloat16).eps * exact.abs().max().item()
    assert err <= 2 * ref_err + floor, (err, ref_err, floor)


def _experts(layer):
    return [getattr(layer, f"weight{e}") for e in range(layer.num_gemms)]


@pytest.mark.parametrize("delay", [False, True])
def test_linear_tied_deferred_bf16(delay):
    torch.manual_seed(0)
    a = Linear(512, 512, bias=True, params_dtype=torch.bfloat16, device="cuda", delay_wgrad_compute=delay)
    b = Linear(512, 512, bias=True, params_dtype=torch.bfloat16, device="cuda", delay_wgrad_compute=delay)
    b.weight, b.bias = a.weight, a.bias
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    w64, b64 = a.weight.detach().double().requires_grad_(), a.bias.detach().double().requires_grad_()
    for microbatch in x.chunk(2):
        b(a(microbatch)).float().square().mean().backward()
        a.backward_dw()
        b.backward_dw()
        h = torch.nn.functional.linear(microbatch.double(), w64, b64)
        torch.nn.functional.linear(h, w64, b64).square().mean().backward()
    ref = torch.nn.Linear(512, 512, device="cuda", dtype=torch.bfloat16)
    ref.weight.data.copy_(a.weight.detach())
    ref.bias.data.copy_(a.bias.detach())
    for microbatch in x.chunk(2):
        ref(ref(microbatch)).float().square().mean().backward()
    _close_to_fp64(a.weight.grad, ref.weight.grad, w64.grad)
    _close_to_fp64(a.bias.grad, ref.bias.grad, b64.grad)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("fuse", [False, True])
def test_grouped_linear_bf16_triton_no_host_sync(packed, fuse):
    torch.manual_seed(0)
    E, K, N = 8, 256, 384
    layer = GroupedLinear(E, K, N, bias=True, params_dtype=torch.bfloat16, device="cuda",
                          single_grouped_weight=packed, delay_wgrad_compute=True, fuse_wgrad_accumulation=fuse)
    splits = torch.tensor([0, 300, 1, 77, 512, 0, 130, 4], device="cuda")
    T = int(splits.sum())
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync on the splits raises
    try:
        y = layer(x, splits)
        dy = torch.randn_like(y)
        y.backward(dy)
        layer.backward_dw()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ws = list(layer.weight.detach().unbind(0)) if packed else [w.detach() for w in _experts(layer)]
    ends = splits.cumsum(0).tolist()
    starts = [0] + ends[:-1]
    for e, (s, t) in enumerate(zip(starts, ends)):
        xe, dye, we = x.detach()[s:t], dy[s:t], ws[e]
        if t > s:  # an empty group has no rows of y or dx (its wgrad must still be zeros, below)
            exact_y = xe.double() @ we.double().t()
            bias_e = (layer.bias[e] if packed else getattr(layer, f"bias{e}")).detach()
            _close_to_fp64(y.detach()[s:t] - bias_e, xe @ we.t(), exact_y)
            _close_to_fp64(x.grad[s:t], dye @ we, dye.double() @ we.double())
        if fuse:
            got = (layer.weight.main_grad[e] if packed else _experts(layer)[e].main_grad)
        else:
            got = (layer.weight.grad[e] if packed else _experts(layer)[e].grad)
        _close_to_fp64(got, dye.t() @ xe, dye.double().t() @ xe.double())


def test_sharded_weight_single_rank_cuda():
    w = distwgrad.ShardedWeight.from_full(torch.randn(64, 32, device="cuda"))
    lin = Linear(32, 64, bias=False, weight=w, delay_wgrad_compute=True)
    x = torch.randn(16, 32, device="cuda")
    lin(x).sum().backward()
    lin.backward_dw()
    assert distwgrad.finalize_model_grads([lin]) == 1
    torch.testing.assert_close(w.grad, torch.ones(16, 64, device="cuda").t() @ x, rtol=1e-3, atol=1e-3)
    assert w.main_grad.dtype == torch.float32


def test_cuda_graph_capture_of_deferred_add_is_refused():
    torch.manual_seed(0)
    lin = Linear(64, 64, bias=False, device="cuda", delay_wgrad_compute=True)
    x = torch.randn(32, 64, device="cuda")
    lin(x).sum().backward()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA graph is capturing"):
        with torch.cuda.graph(graph):
            lin.backward_dw()


@pytest.mark.parametrize("main_dtype", [torch.float32, torch.bfloat16])
def test_grouped_linear_fused_into_any_main_grad_dtype(main_dtype):
    """The kernels fuse the add into fp32 ``main_grad``; a bf16 one gets the fresh product added. Both
    hold old + the expert's wgrad (compared with a per-expert fp64 product)."""
    torch.manual_seed(0)
    E, K, N, splits = 4, 128, 192, [100, 0, 37, 119]
    layer = GroupedLinear(E, K, N, bias=False, params_dtype=torch.bfloat16, device="cuda",
                          fuse_wgrad_accumulation=True)
    old = [torch.randn(N, K, device="cuda").to(main_dtype) for _ in range(E)]
    for w, o in zip(_experts(layer), old):
        w.main_grad = o.clone()
    x = torch.randn(sum(splits), K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(sum(splits), N, device="cuda", dtype=torch.bfloat16)
    layer(x, splits).backward(dy)
    s = 0
    for w, o, m in zip(_experts(layer), old, splits):
        want = o.double() + dy[s:s + m].double().t() @ x[s:s + m].double()
        got = w.main_grad
        assert got.dtype == main_dtype
        tol = (2 ** -7 if main_dtype == torch.bfloat16 else 2 ** -14) * want.abs().max().item()  # output rounding
        assert (got.double() - want).abs().max().item() <= tol, main_dtype
        s += m


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wgrad_mm_accumulates_in_place_in_fp32(dtype):
    """``wgrad_mm`` into an fp32 buffer: one GEMM whose epilogue adds into the buffer (no fp32 product
    written and read back), as close to fp64 as the two-step ``out + mm(out_dtype=fp32)``."""
    from distwgrad.ops.gemm import wgrad_mm

    torch.manual_seed(0)
    dy, x = (torch.randn(4096, n, device="cuda", dtype=dtype) for n in (384, 640))
    out = torch.randn(384, 640, device="cuda") * 8
    before = out.clone()
    exact = before.double() + dy.double().t() @ x.double()
    two_step = before + torch.mm(dy.t(), x, out_dtype=torch.float32)
    ptr = out.data_ptr()
    assert wgrad_mm(dy, x, out) is out and out.data_ptr() == ptr
    err = (out.double() - exact).abs().max().item()
    ref_err = (two_step.double() - exact).abs().max().item()
    floor = torch.finfo(torch.float32).eps * exact.abs().max().item()
    assert err <= 2 * ref_err + floor, (err, ref_err, floor)
