"""Kernels on any thread ([Note: a current context on any thread] in kernels/_context.py), on a GPU.

Each case runs in a fresh interpreter, so the thread it launches from has never had a CUDA context bound:
1. every kernel family called first from a new Python thread (the main thread initialised CUDA through
   torch only), compared bit for bit with the same call on the main thread;
2. a GroupedLinear backward on the autograd engine's worker thread after every allocation it makes was
   served from the caching allocator's cache (the allocator makes no runtime call that would bind a
   context on that thread, so the kernels' own launch is the thread's first CUDA work).
The CPU test checks the guard is a no-op without CUDA.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from distwgrad.kernels._context import ensure_context

_FRESH_THREAD = textwrap.dedent("""
    import threading, torch
    from distwgrad.ops import grouped_gemm as gg
    from distwgrad.ops import grouped_gemm_fp8 as gg8
    from distwgrad.fp8 import PerTensorScaling
    torch.manual_seed(0)
    E, T, K, N = 4, 1024, 256, 512
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / 16
    dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([256, 512, 768, 1024], dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    def run():
        out = [gg.grouped_fprop(x, w, offs), gg.grouped_dgrad(dy, w, offs), gg.grouped_wgrad(dy, x, offs)]
        acc = torch.zeros(E, N, K, device="cuda", dtype=torch.float32)
        out.append(gg.grouped_wgrad(dy, x, offs, out=acc))
        x_q, _ = gg8.quantize_operand(x, PerTensorScaling(), grad=False)
        out.append(x_q.data.view(torch.uint8))
        torch.cuda.synchronize()
        return out
    got = {}
    def worker():
        try:
            got["out"] = run()
        except BaseException as exc:
            got["err"] = repr(exc)
    t = threading.Thread(target=worker); t.start(); t.join()
    assert "err" not in got, got.get("err")
    main = run()
    for a, b in zip(got["out"], main):
        assert torch.equal(a, b)
    print("OK")
""")

_AUTOGRAD_THREAD = textwrap.dedent("""
    import torch
    from distwgrad.nn import GroupedLinear
    torch.manual_seed(0)
    E, T, K, N = 8, 4096, 1024, 2048
    layer = GroupedLinear(E, K, N, bias=False, single_grouped_weight=True, params_dtype=torch.bfloat16,
                          device="cuda")
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    splits = [T // E] * E
    def step():
        y = layer(x, splits)
        y.float().square().mean().backward()
        torch.cuda.synchronize()
    step()                                   # warms the caching allocator on the main thread
    x.grad = None; layer.weight.grad = None  # the blocks go back to the cache, not to the driver
    before = torch.cuda.memory_stats()["segment.all.allocated"]  # cudaMalloc calls so far
    step()                                   # backward on the autograd worker, served from the cache
    assert torch.cuda.memory_stats()["segment.all.allocated"] == before, "an allocation missed the cache"
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()
    print("OK")
""")


def _run(script: str) -> None:
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("script", [_FRESH_THREAD, _AUTOGRAD_THREAD], ids=["fresh_thread", "autograd_thread"])
def test_kernels_on_a_thread_without_context(script):
    _run(script)


def test_guard_is_a_no_op_on_cpu():
    ensure_context(torch.device("cpu"))  # nothing to bind, nothing raised
