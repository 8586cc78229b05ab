"""``kernels._launch.launch`` ([Note: cached launches]): the compiled kernel it calls is the one Triton would pick,
with every parameter in the kernel's order; what it cannot key takes ``kernel[grid]``.

On the CPU a ``JITFunction`` whose ``[grid]`` hands back a recording stand-in for the compiled kernel shows the
call the launcher makes; on a GPU (``-m gpu``) real kernels: the compiled kernel against Triton's own choice
(``JITFunction.warmup``), and the bits against the uncached launch.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from distwgrad.kernels import _launch  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from distwgrad.testing.stubs import StubKernel  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _axpy(x_ptr, y_ptr, n, alpha, SCALE: tl.constexpr, BLOCK: tl.constexpr = 128):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(y_ptr + offs, mask=m) + alpha * SCALE * tl.load(x_ptr + offs, mask=m), mask=m)


class _Compiled:
    """Records each launcher call: (grid, stream, function, metadata, hooks, arguments)."""

    def __init__(self) -> None:
        self.function, self.packed_metadata, self.calls = "fn", "meta", []

    def run(self, gx, gy, gz, stream, function, packed, launch_metadata, enter, exit_, *args):
        self.calls.append(((gx, gy, gz), stream, function, packed, (launch_metadata, enter, exit_), args))


class _Recording(JITFunction):
    """A JITFunction whose first (uncached) launch compiles nothing and hands back a fresh ``_Compiled``."""

    def __init__(self, fn) -> None:
        super().__init__(fn)
        self.compiled: list[_Compiled] = []
        self.uncached: list[tuple] = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.uncached.append((grid, args, kwargs))
            self.compiled.append(_Compiled())
            return self.compiled[-1]
        return run


@pytest.fixture
def cpu_stream(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)


def test_a_key_seen_before_calls_the_compiled_kernel_with_every_parameter_in_order(cpu_stream):
    k = _Recording(_axpy)
    x, y = torch.zeros(64), torch.zeros(64)
    _launch.launch(k, (2,), x, y, 64, 0.5, SCALE=3, num_warps=4)
    assert len(k.uncached) == 1 and k.compiled[0].calls == []
    _launch.launch(k, (2,), x, y, 64, 0.25, SCALE=3, num_warps=4)  # a float's value is part of the key
    assert len(k.uncached) == 2
    _launch.launch(k, (5, 2), x, y, 64, 0.25, SCALE=3, num_warps=4)
    assert len(k.uncached) == 2
    # the grid padded to three, the current stream, no hooks, then x, y, n, alpha, SCALE and BLOCK's default
    assert k.compiled[1].calls == [((5, 2, 1), 1234, "fn", "meta", (None, None, None), (x, y, 64, 0.25, 3, 128))]


@pytest.mark.parametrize("change", ["alignment", "dtype", "int", "constexpr", "option", "keyword names"])
def test_what_triton_specializes_on_is_a_new_key(cpu_stream, change):
    k = _Recording(_axpy)
    x, y = torch.zeros(64), torch.zeros(64)
    base = dict(args=(x, y, 64, 0.5), kwargs=dict(SCALE=3, num_warps=4))
    other = {"alignment": dict(args=(x[1:], y, 64, 0.5)),  # 4 bytes off a 16-byte boundary
             "dtype": dict(args=(x.double(), y, 64, 0.5)),
             "int": dict(args=(x, y, 63, 0.5)),
             "constexpr": dict(kwargs=dict(SCALE=2, num_warps=4)),
             "option": dict(kwargs=dict(SCALE=3, num_warps=8)),
             "keyword names": dict(kwargs=dict(SCALE=3, BLOCK=128, num_warps=4))}[change]
    for call in (base, {**base, **other}, base, {**base, **other}):
        _launch.launch(k, (1,), *call["args"], **call["kwargs"])
    assert len(k.uncached) == 2, k.uncached
    assert [len(c.calls) for c in k.compiled] == [1, 1]


def test_a_kernel_compiled_on_one_device_is_not_launched_on_another(cpu_stream, monkeypatch):
    k = _Recording(_axpy)
    x, y = torch.zeros(64), torch.zeros(64)
    for device in (0, 1, 0, 1):
        monkeypatch.setattr(torch.cuda, "current_device", lambda d=device: d)
        _launch.launch(k, (1,), x, y, 64, 0.5, SCALE=3)
    assert len(k.uncached) == 2 and [len(c.calls) for c in k.compiled] == [1, 1]


def test_descriptors_are_keyed_by_their_fields():
    from triton.tools.tensor_descriptor import TensorDescriptor

    a = torch.zeros(64, 64)
    key = _launch._key((TensorDescriptor(a, [64, 64], [64, 1], [16, 16]),))
    assert key == _launch._key((TensorDescriptor(a.clone(), [64, 64], [64, 1], [16, 16]),))
    assert key != _launch._key((TensorDescriptor(a, [64, 64], [64, 1], [32, 16]),))
    assert key != _launch._key((TensorDescriptor(a.double(), [64, 64], [64, 1], [16, 16]),))


def test_a_tuple_is_keyed_by_its_elements():
    x = torch.zeros(64)
    key = _launch._key((1, (x, 16, 2)))
    assert key == _launch._key((1, (x.clone(), 16, 2)))
    assert key != _launch._key((1, (x, 17, 2)))  # an element's value
    assert key != _launch._key((1, (x[1:], 16, 2)))  # an element's alignment
    assert key != _launch._key((1, x, 16, 2))  # the same values unpacked
    assert key != _launch._key((1, (x, (16, 2))))  # nested otherwise
    assert _launch._key((1, (x, [16], 2))) is None


def test_what_cannot_be_keyed_takes_the_uncached_launch_every_time(cpu_stream):
    k = _Recording(_axpy)
    x, y = torch.zeros(64), torch.zeros(64)
    for _ in range(3):
        _launch.launch(k, (1,), x, y, [64], 0.5, SCALE=3)  # a list: no key
    assert len(k.uncached) == 3 and all(c.calls == [] for c in k.compiled)


def test_a_launch_hook_turns_the_cache_off(cpu_stream, monkeypatch):
    k = _Recording(_axpy)
    x, y = torch.zeros(64), torch.zeros(64)
    _launch.launch(k, (1,), x, y, 64, 0.5, SCALE=3)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: None)
    _launch.launch(k, (1,), x, y, 64, 0.5, SCALE=3)
    assert len(k.uncached) == 2 and k.compiled[0].calls == []


class _OtherForm(_Recording):
    """Hands back compiled kernels without ``packed_metadata``: another launcher form than the one ``launch`` calls."""

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            compiled = super(_OtherForm, self).__getitem__(grid)(*args, **kwargs)
            del compiled.packed_metadata
            return compiled
        return run


def test_a_compiled_kernel_of_another_form_is_not_kept(cpu_stream):
    k = _OtherForm(_axpy)
    x, y = torch.zeros(64), torch.zeros(64)
    for _ in range(2):
        _launch.launch(k, (1,), x, y, 64, 0.5, SCALE=3)
    assert len(k.uncached) == 2


def test_the_cache_of_a_kernel_is_bounded(cpu_stream, monkeypatch):
    monkeypatch.setattr(_launch, "_MAX_KEYS", 2)
    k = _Recording(_axpy)
    x, y = torch.zeros(64), torch.zeros(64)
    for n in (1, 2, 3, 3):
        _launch.launch(k, (1,), x, y, n, 0.5, SCALE=3)
    assert len(k.uncached) == 4  # n=3 came after the cap: never kept


def test_a_stand_in_kernel_gets_its_grid_and_arguments():
    seen = []
    _launch.launch(StubKernel(lambda grid, *a, **kw: seen.append((grid, a, kw))), (3, 1), 1, 2, B=3)
    assert seen == [((3, 1), (1, 2), {"B": 3})]


# ---- on a GPU: real kernels ----


@triton.jit
def _scaled_copy(x_ptr, y_ptr, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m) * SCALE, mask=m)


@pytest.mark.gpu
@gpu
def test_gpu_the_compiled_kernel_is_tritons_choice():
    """Views off a 16-byte boundary, ints equal to 1 and divisible by 16 or not, two dtypes: each launch through
    the cache runs the kernel ``JITFunction.warmup`` picks for its arguments, and writes what torch computes."""
    for dtype in (torch.float32, torch.bfloat16):
        buf = torch.randn(4200, device="cuda").to(dtype)
        for offset in (0, 1, 8):
            for n in (1, 16, 17, 4096):
                x = buf[offset:offset + n]
                y = torch.full_like(x, float("nan"))
                grid = (triton.cdiv(n, 1024),)
                for _ in range(2):  # the first compiles, the second is a cache hit
                    _launch.launch(_scaled_copy, grid, x, y, n, SCALE=2.0, BLOCK=1024, num_warps=4)
                torch.testing.assert_close(y, x * 2.0, rtol=0, atol=0)
                key = (torch.cuda.current_device(), _launch._key((x, y, n)), ("SCALE", "BLOCK", "num_warps"),
                       _launch._key((2.0, 1024, 4)))
                kept = _launch._CACHES[id(_scaled_copy)][1][key][0]
                assert kept is _scaled_copy.warmup(x, y, n, SCALE=2.0, BLOCK=1024, num_warps=4, grid=grid)


@pytest.mark.gpu
@gpu
def test_gpu_fp8_gemms_and_quantization_are_the_same_bits_uncached(monkeypatch):
    """The FP8 entry points (TMA descriptors, Gluon kernels on Hopper, constexpr dtypes) through the cache and
    through ``kernel[grid]`` every time."""
    from distwgrad.kernels.cast_transpose import cast_transpose_per_tensor
    from distwgrad.kernels.grouped_gemm_fp8 import grouped_fprop_fp8, grouped_wgrad_fp8

    torch.manual_seed(0)
    T, E, K, N = 2048, 4, 512, 768
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([500, 1024, 1600, 2048], device="cuda", dtype=torch.int32)

    def step():
        xq, xs, xt, _ = cast_transpose_per_tensor(x, torch.float8_e4m3fn)
        dq, ds, dt, _ = cast_transpose_per_tensor(dy, torch.float8_e5m2)
        wq, ws, _, _ = cast_transpose_per_tensor(w.reshape(E * N, K), torch.float8_e4m3fn)
        y = grouped_fprop_fp8(xq, xs, wq.view(E, N, K), ws.expand(E).contiguous(), offs, block=0)
        dw = grouped_wgrad_fp8(dt, ds, xt, xs, offs, block=0)
        return [t.view(torch.uint8) if t.dtype.itemsize == 1 else t for t in (xq, xt, dq, dt, y, dw)]

    cached = [step() for _ in range(2)][-1]
    monkeypatch.setattr(_launch, "_hooked", lambda: True)
    uncached = step()
    for a, b in zip(cached, uncached):
        assert torch.equal(a, b)
