"""FP8 quantization kernels (``distwgrad.kernels.quantize``, through ``distwgrad.ops.quantize``, which wraps
their tensors in ``Quantized``) against the reference, bit for bit (NaN compares as NaN, whatever its sign
or payload).

Interpreter tests: ``TRITON_INTERPRET=1`` must be set before Triton compiles anything, and other test
modules in the same (xdist) process may import Triton without it. So each ``interpret`` test runs this
file as a script in a fresh subprocess with the variable set (``python tests/test_fp8_quantize_kernels.py
CASE``); the case functions below are shared with the GPU tests, which run them on CUDA in-process.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from distwgrad.kernels import tuning
from fp8_quantize_cases import E4M3, E5M2, FP8S, assert_same, bits_equal, wide_range

from distwgrad.fp8 import (
    BlockwiseScaling,
    PerTensorScaling,
    fp8_format,
    quantize_blockwise,
    quantize_per_tensor,
    quantize_rowwise_and_columnwise,
)
from distwgrad.testing import sweep
from distwgrad.testing.interpreter import run_interpreted
from distwgrad.testing.stubs import StubKernel

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------------
# Kernel cases: run under TRITON_INTERPRET=1 (subprocess, tiny shapes) and on CUDA (big shapes)
# ----------------------------------------------------------------------------------------------------

def _kernels():
    from distwgrad.kernels import quantize as kq
    return kq


def _quantizers():
    """The kernels on the runtime's types: the same arguments as the reference, ``Quantized`` out."""
    from distwgrad.ops import quantize as q8
    return q8


def _on(x: torch.Tensor, device: str) -> torch.Tensor:
    return x.to(device)


def case_rounding(device: str, big: bool) -> None:
    """Every fp8 value, every midpoint and its neighbours, subnormals, signed zeros, saturation, NaN:
    with amax = fp8_max the scale is exactly 1, so this tests the kernel's RNE cast value by value."""
    q8 = _quantizers()
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
        k = q8.quantize_per_tensor(_on(x, device), f8, amax=_on(amax, device))
        assert_same(k, quantize_per_tensor(x, f8, amax=amax), f"rounding {f8}")


def case_per_tensor(device: str, big: bool) -> None:
    q8 = _quantizers()
    shapes = [(4096, 8192 + 3), (5,)] if big else [(0,), (1,), (9000,), (7, 33)]
    grid = [(d, f8, s) for d in (torch.float32, torch.float16, torch.bfloat16) for f8 in FP8S for s in shapes]
    for dtype, f8, shape in sweep.sample(grid, 8, seed=0):  # --full: all 24 (12 on the GPU)
        x = wide_range(shape, dtype, seed=len(shape))
        for margin in (0, 3):
            k = q8.quantize_per_tensor(_on(x, device), f8, margin=margin)
            r = quantize_per_tensor(x, f8, margin=margin)
            assert_same(k, r, f"{dtype} {f8} {shape} {margin}")
        for amax in (0.0, 0.5, 1e6):
            a = torch.tensor([amax])
            k = q8.quantize_per_tensor(_on(x, device), f8, amax=_on(a, device))
            assert_same(k, quantize_per_tensor(x, f8, amax=a), f"{dtype} {f8} {shape} amax={amax}")
    x = wide_range((9000,), torch.bfloat16)
    with tuning(quantize=dict(amax_max_programs=2, per_tensor_block=1024)):  # several grid-stride steps a program
        k = q8.quantize_per_tensor(_on(x, device), E4M3)
    assert_same(k, quantize_per_tensor(x, E4M3), "grid-stride")


def case_nonfinite(device: str, big: bool) -> None:
    q8 = _quantizers()
    shape = (1024, 2048) if big else (64, 96)
    for bad in (math.nan, math.inf, -math.inf):
        x = wide_range(shape, torch.bfloat16)
        x[3, 40] = bad
        x[:32, 64:] = 0.0
        for f8 in FP8S:
            assert_same(q8.quantize_per_tensor(_on(x, device), f8), quantize_per_tensor(x, f8), f"{bad}")
            for block in ((32, 32), (1, 32), (16, 64)):
                k = q8.quantize_blockwise(_on(x, device), block, f8)
                assert_same(k, quantize_blockwise(x, block, f8), f"{bad} {block}")
            rec = BlockwiseScaling(act_block=(1, 32), weight_block=(32, 32), dtype=f8)
            for k, r in zip(q8.quantize_rowwise_and_columnwise(_on(x, device), rec),
                            quantize_rowwise_and_columnwise(x, rec), strict=True):
                assert_same(k, r, f"{bad} rowcol")


def case_blockwise(device: str, big: bool) -> None:
    q8 = _quantizers()
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
                    k = q8.quantize_blockwise(_on(x, device), block, f8, power_of_two=pow2)
                    r = quantize_blockwise(x, block, f8, power_of_two=pow2)
                    assert_same(k, r, f"{dtype} {shape} {f8} {block} pow2={pow2}")
    x = wide_range((70, 100), torch.bfloat16)
    for tile_m in (4, 64):  # 1xL row tiles: many programs along M, or one partial one
        with tuning(quantize=dict(rows_tile_m=tile_m)):
            k = q8.quantize_blockwise(_on(x, device), (1, 32), E4M3)
        assert_same(k, quantize_blockwise(x, (1, 32), E4M3), f"rows_tile_m={tile_m}")


def case_rowcol(device: str, big: bool) -> None:
    q8 = _quantizers()
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
                    got = q8.quantize_rowwise_and_columnwise(x, rec)
                    for k, r in zip(got, ref, strict=True):
                        assert_same(k, r, f"{shape} {dtype} {f8} pow2={pow2}")
            rec = PerTensorScaling(margin=1)
            for k, r in zip(q8.quantize_rowwise_and_columnwise(x, rec, grad=True),
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
    q8 = _quantizers()
    amax = _amax_grid()
    x = amax[:, None] * torch.linspace(1.0, -0.25, 32)  # each row's amax is its first element
    x = torch.cat([x, torch.zeros(-x.shape[0] % 32, 32)])  # whole 32x32 blocks
    xd = _on(x, device)
    for f8 in FP8S:
        for block in ((1, 32), (32, 32)):
            assert_same(q8.quantize_blockwise(xd, block, f8), quantize_blockwise(x, block, f8), f"{f8} {block}")
        rec = BlockwiseScaling(act_block=(1, 32), weight_block=(32, 32), dtype=f8)
        xt = _on(x.t().contiguous(), device)  # x's rows are the column tiles here
        got = q8.quantize_rowwise_and_columnwise(xt, rec)
        for k, r in zip(got, quantize_rowwise_and_columnwise(x.t().contiguous(), rec), strict=True):
            assert_same(k, r, f"{f8} rowcol")


def case_rowcol_gluon(device: str, big: bool) -> None:
    """The Gluon rows + columns kernel ([Note: rows and columns without a transpose]): the reference's bits
    on whole and partial tiles, both formats, bf16 and fp32 input, amaxes at every exponent along rows and
    along columns, and non-finite values. Where it does not apply (CPU, the
    interpreter, M off its row grid) the Triton kernel answers, which this case then checks instead."""
    q8 = _quantizers()
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
                got = q8.quantize_rowwise_and_columnwise(xd, rec)
                ref = quantize_rowwise_and_columnwise(xd, rec)
                for k, r in zip(got, ref, strict=True):
                    assert_same(k, r, f"{tuple(x.shape)} {x.dtype} {f8}")


def case_gluon_fallback(device: str, big: bool) -> None:
    """A Triton whose Gluon cannot build the rows + columns kernel: one warning, then the Triton kernel,
    the reference's bits, and no further attempt."""
    import warnings

    from distwgrad.kernels.gluon import quantize_rowcol as kg
    from triton.compiler.errors import CompilationError
    kq, q8 = _kernels(), _quantizers()

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
                for k, r in zip(q8.quantize_rowwise_and_columnwise(x, rec), quantize_rowwise_and_columnwise(x, rec),
                                strict=True):
                    assert_same(k, r, "Triton fallback")
        assert len(calls) == 1 and "no such Gluon API" in (kq._GLUON_FAILED or "")
        assert sum("does not build" in str(w.message) for w in caught) == 1, [str(w.message) for w in caught]
    finally:
        kq._gluon_rowcol, kg.rowcol_kernel, kq._GLUON_FAILED = saved


def case_sweep(device: str, big: bool) -> None:
    """Every candidate tuning of the benchmark's sweep (``SWEEP``, ``qa/bench/kernels.py fp8 --quant-sweep``) on
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
                got = ops[op](_quantizers(), x)
            for k, r in zip(got, ref, strict=True):
                assert_same(k, r, f"{op} {cand}")


def case_checks(device: str, big: bool) -> None:
    q8 = _quantizers()
    x = torch.ones(8, 32, device=device)
    for fn, match in [
        (lambda: q8.quantize_per_tensor(x.t(), E4M3), "contiguous"),
        (lambda: q8.quantize_per_tensor(x.double(), E4M3), "float64"),
        (lambda: q8.quantize_per_tensor(x, torch.int8), "int8"),
        (lambda: q8.quantize_per_tensor(x, E4M3, amax=x[0, :1].half()), "amax"),
        (lambda: q8.quantize_blockwise(x[None], (1, 16), E4M3), r"2-D.*\(1, 8, 32\)"),
        (lambda: q8.quantize_blockwise(x, (1, 24), E4M3), "powers of two"),
        (lambda: q8.quantize_blockwise(x[:, ::2], (1, 16), E4M3), "strides"),
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
    q8 = _quantizers()
    assert direct_call_ok((x,))
    direct = q8.quantize_blockwise(x, (1, 16), E4M3)
    data, s_inv = ops.fp8_quantize_blockwise(x, 1, 16, E4M3, True)
    assert bits_equal(direct.data.cpu(), data.cpu()) and bits_equal(direct.scale_inv.cpu(), s_inv.cpu())
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        assert not direct_call_ok((fx,))
        q = q8.quantize_blockwise(fx, (1, 16), E4M3)
        assert q.data.shape == x.shape and q.scale_inv.shape == (33, 3)
    with torch.profiler.profile() as prof:
        assert not direct_call_ok((x,))
        q8.quantize_rowwise_and_columnwise(x, BlockwiseScaling(act_block=(1, 16), weight_block=(16, 16)))
    assert any(e.name == "distwgrad::fp8_quantize_rowwise_and_columnwise" for e in prof.events())
    compiled = torch.compile(lambda t: q8.quantize_blockwise(t, (1, 16), E4M3).data, fullgraph=True,
                             backend="aot_eager")
    assert bits_equal(compiled(x).cpu(), direct.data.cpu())


KERNEL_CASES = {f.__name__[5:]: f for f in (case_rounding, case_per_tensor, case_nonfinite, case_blockwise,
                                             case_rowcol, case_rowcol_gluon, case_gluon_fallback, case_pow2_scales,
                                             case_sweep, case_checks, case_opcheck)}


@pytest.mark.interpret
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_bit_exact_interpreted(case):
    run_interpreted(__file__, case, cwd=str(REPO), timeout=300)


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
    from distwgrad.kernels.gluon import quantize_rowcol as kg
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


if __name__ == "__main__":
    # Interpreter entry point (see the module docstring): python tests/test_fp8_quantize_kernels.py CASE
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    import warnings

    warnings.simplefilter("ignore", RuntimeWarning)  # numpy's 1/0 and NaN warnings inside the interpreter
    KERNEL_CASES[sys.argv[1]]("cpu", big=False)
    print(f"ok {sys.argv[1]}")
