"""Which FP8 kernel the launchers pick and what they launch it with, off the GPU: the Gluon kernels' stand-ins
(``distwgrad.testing.stubs``) record the dispatch, the grid and the launch options; a Gluon kernel that does
not build falls back once to the Triton kernel; ``gluon=True`` where it cannot run names why.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from distwgrad.kernels import current
from grouped_gemm_fp8_cases import E4M3, _cfg, _kernels

from distwgrad.testing.stubs import StubKernel, record_ragged_dispatch


def _pretend_hopper(monkeypatch, k):
    """Makes kernel module ``k`` see a compiled (not interpreted) run on a GPU of capability ``cap[0]``
    (Hopper until a test changes it); returns (a CUDA-tensor stand-in, cap)."""
    from types import SimpleNamespace
    monkeypatch.setattr(k, "_interpreting", lambda: False)
    cap = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap[0])
    return SimpleNamespace(is_cuda=True, device="cuda:0"), cap


def test_gluon_kernel_only_where_it_applies(monkeypatch):
    """``_gluon_ragged``: Hopper only (wgmma), promoting accumulations only (no-split keeps the Triton
    kernel's wide tile), 128 blocks, B K-inner and stacked; never in the interpreter or off CUDA."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from distwgrad.kernels.gluon import grouped_gemm_fp8 as kg
    k = _kernels()
    a, cap = _pretend_hopper(monkeypatch, k)
    w = torch.empty(4, 256, 512)                       # [E, N, K]
    b = w.transpose(1, 2)                              # fprop's B: [E, K, N], K inner, a [E * N, K] view
    assert k._gluon_ragged(a, b, 0, True, True) == kg.AVAILABLE
    assert k._gluon_ragged(a, b, 128, True, True) == kg.AVAILABLE
    assert not k._gluon_ragged(a, b, 0, False, True)                     # no split: the Triton kernel
    assert not k._gluon_ragged(a, b, 32, True, True)                     # 32-blocks
    assert not k._gluon_ragged(a, b, 0, True, False)                     # no TMA or B N-inner
    assert k._gluon_ragged(a, torch.empty(4, 256, 640)[:, :, :512].transpose(1, 2), 0, True, True) == kg.AVAILABLE
    assert not k._gluon_ragged(a, torch.empty(4, 300, 512)[:, :256].transpose(1, 2), 0, True, True)  # gaps
    assert not k._gluon_ragged(SimpleNamespace(is_cuda=False, device="cpu"), b, 0, True, True)
    cap[0] = (10, 0)
    assert not k._gluon_ragged(a, b, 0, True, True)                      # Blackwell: no wgmma
    monkeypatch.setattr(k, "_interpreting", lambda: True)
    cap[0] = (9, 0)
    assert not k._gluon_ragged(a, b, 0, True, True)


@pytest.mark.parametrize("block,K,T,gluon,expected", [
    (0, 512, 2048, None, "triton"), (0, 768, 2048, None, "gluon"), (0, 4096, 256, None, "gluon"),
    (128, 512, 2048, None, "triton"), (128, 768, 2048, None, "gluon"), (128, 2048, 256, None, "gluon"),
    (0, 7168, 2048, False, "triton"), (0, 512, 256, True, "gluon"),
])
def test_gluon_dispatch_by_contraction_depth(monkeypatch, block, K, T, gluon, expected):
    """``GroupedGemmFp8Tuning.ragged_gluon_min_depth_*``: where the Gluon kernel can run, the default dispatch
    gives it the contractions it measured faster on (from 768 deep, both recipes); ``gluon=`` overrides."""
    pytest.importorskip("triton")
    k = _kernels()
    taken = record_ragged_dispatch(monkeypatch, k, "_fp8_ragged_kernel")
    monkeypatch.setattr(k, "_GLUON_FAILED", {})
    E, N = 2, 256
    a = torch.zeros(T, K, dtype=E4M3)
    b = torch.zeros(E, N, K, dtype=E4M3).transpose(1, 2)
    scales = (torch.ones(T, K // 128), torch.ones(E, K // 128, N // 128)) if block else (torch.ones(()), torch.ones(E))
    offs = torch.tensor([T // 2, T], dtype=torch.int32)
    out = torch.empty(T, N, dtype=torch.bfloat16)
    k._launch_ragged(a, scales[0], b, scales[1], offs, None, out, block=block, op="grouped_fprop_fp8", config=None,
                     use_tma=True, gluon=gluon)
    assert taken == [expected]


@pytest.mark.parametrize("T,grid", [
    (4096, 132),                 # (32 + 2) * 8 = 272 tiles at most: one program per SM
    (256, (2 + 2) * 8),          # fewer tiles than SMs: one program per tile
])
def test_gluon_launch_grid(monkeypatch, T, grid):
    """``_launch_gluon_ragged``: the persistent kernel gets min(bound on the tiles, SMs) programs (the
    offsets stay on the device, so the host bounds the tiles by cdiv(T, 128) + E row tiles per column)."""
    pytest.importorskip("triton")
    from distwgrad.kernels.gluon import grouped_gemm_fp8 as kg
    if not kg.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    k = _kernels()
    launched = []
    monkeypatch.setattr(kg, "ragged_kernel", StubKernel(lambda g, *a, **kw: launched.append((g, kw))))
    monkeypatch.setattr(kg, "descriptor", lambda t, block: None)
    monkeypatch.setattr(k, "_num_sms", lambda device: 132)
    monkeypatch.setattr(k, "_GLUON_FAILED", {})
    E, K, N = 2, 256, 1024
    a = torch.zeros(T, K, dtype=E4M3)
    b = torch.zeros(E, N, K, dtype=E4M3).transpose(1, 2)
    offs = torch.tensor([T // 2, T], dtype=torch.int32)
    out = torch.empty(T, N, dtype=torch.bfloat16)
    assert k._launch_gluon_ragged(a, torch.ones(()), b, torch.ones(E), offs, None, out, 0, (0, 0), (1, 0, 0), (0, 0))
    (g, kw), = launched
    assert g == (grid,)
    t = current().grouped_gemm_fp8
    assert kw["NUM_STAGES"] == t.ragged_gluon_stages == 4 and kw["num_warps"] == t.ragged_gluon_block_m // 16 == 8


def _wgrad_operands(T=256, E=2, K=128, N=256, block=0):
    """fp8 dy^T [N, T], x^T [K, T], their scales and offsets for dispatch tests (no launch)."""
    dy_t, x_t = torch.zeros(N, T, dtype=E4M3), torch.zeros(K, T, dtype=E4M3)
    scales = ((torch.ones(N, T // 128), torch.ones(K, T // 128)) if block else (torch.ones(()), torch.ones(())))
    return dy_t, scales[0], x_t, scales[1], torch.tensor([T // 2, T], dtype=torch.int32)


def test_gluon_wgrad_only_where_it_applies(monkeypatch, kernel_tuning):
    """``_gluon_wgrad``: Hopper only, per-tensor with the split accumulator or blockwise 1x128 tiles
    (``wgrad_gluon_blockwise``), TMA-aligned operands; never in the interpreter or off CUDA."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from distwgrad.kernels.gluon import grouped_wgrad_fp8 as kw
    k = _kernels()
    a, cap = _pretend_hopper(monkeypatch, k)
    assert k._gluon_wgrad(a, 0, True, True) == kw.AVAILABLE
    assert k._gluon_wgrad(a, 128, True, True) == kw.AVAILABLE   # blockwise ([Note: blockwise wgrad scales])
    assert k._gluon_wgrad(a, 128, False, True) == kw.AVAILABLE  # (blockwise always promotes)
    assert not k._gluon_wgrad(a, 64, True, True)       # 1x64 tiles: not the kernel's chunk
    assert not k._gluon_wgrad(a, 0, False, True)       # no split accumulator
    assert not k._gluon_wgrad(a, 0, True, False)       # not TMA-aligned
    assert not k._gluon_wgrad(SimpleNamespace(is_cuda=False, device="cpu"), 0, True, True)
    cap[0] = (10, 0)
    assert not k._gluon_wgrad(a, 0, True, True)        # Blackwell: no wgmma
    cap[0] = (9, 0)
    monkeypatch.setattr(k, "_interpreting", lambda: True)
    assert not k._gluon_wgrad(a, 0, True, True)
    monkeypatch.setattr(k, "_interpreting", lambda: False)
    from distwgrad.kernels import gluon as kg
    with monkeypatch.context() as m:
        m.setattr(kg, "async_load", None)
        assert not k._gluon_wgrad(a, 128, True, True)  # a Triton without Gluon's cp.async
        assert k._gluon_wgrad(a, 0, True, True) == kw.AVAILABLE
    kernel_tuning(grouped_gemm_fp8=dict(wgrad_gluon_blockwise=False))
    assert not k._gluon_wgrad(a, 128, True, True)      # switched off: the Triton kernel


@pytest.mark.parametrize("gluon,config,use_tma,block,expected", [
    (None, None, None, 0, "gluon"), (False, None, None, 0, "triton"), (None, "cfg", None, 0, "triton"),
    (None, None, False, 0, "triton"), (None, None, None, 128, "gluon"), (None, None, None, 64, "triton"),
    (True, None, None, 0, "gluon"),
])
def test_gluon_wgrad_dispatch(monkeypatch, gluon, config, use_tma, block, expected):
    """``_launch_wgrad``: where the Gluon wgrad can run, the default takes it (``wgrad_gluon``) unless a
    config is given, TMA is refused, or ``gluon=False``; 1x128 blockwise tiles too, other blocks stay on the
    Triton kernel."""
    pytest.importorskip("triton")
    k = _kernels()
    taken = []
    monkeypatch.setattr(k, "_gluon_wgrad", lambda a, blk, split, tma: blk in (0, 128) and split and tma)
    monkeypatch.setattr(k, "_launch_gluon_wgrad", lambda *a: taken.append("gluon") or True)
    monkeypatch.setattr(k, "_wgrad_fp8_kernel", StubKernel(lambda grid, *a, **kw: taken.append("triton")))
    monkeypatch.setattr(k, "_resolve_tma", lambda requested, eligible, device, op: False)
    dy_t, dy_s, x_t, x_s, offs = _wgrad_operands(block=block)
    out = torch.zeros(2, dy_t.shape[0], x_t.shape[0])
    cfg = _cfg() if config else None
    k._launch_wgrad(dy_t, dy_s, x_t, x_s, offs, out, block=block, accumulate=True, table=None, config=cfg,
                    use_tma=use_tma, gluon=gluon)
    assert taken == [expected]


def test_gluon_wgrad_required_but_unavailable_names_why(monkeypatch):
    """``gluon=True`` where the kernel cannot run: a ValueError that names the recipe, the split accumulator,
    the alignment and the device; one that cannot build: a RuntimeError with the build error."""
    pytest.importorskip("triton")
    k = _kernels()
    dy_t, dy_s, x_t, x_s, offs = _wgrad_operands()
    out = torch.zeros(2, dy_t.shape[0], x_t.shape[0])
    with pytest.raises(ValueError, match=r"gluon=True needs a Hopper GPU.*block=0, split_accumulator=True, "
                                         r"aligned=True, device=cpu"):
        k._launch_wgrad(dy_t, dy_s, x_t, x_s, offs, out, block=0, accumulate=False, table=None, config=None,
                        use_tma=None, gluon=True)
    monkeypatch.setattr(k, "_gluon_wgrad", lambda *a: True)
    monkeypatch.setattr(k, "_GLUON_FAILED", {"wgrad": "CompilationError: no such op"})
    with pytest.raises(RuntimeError, match=r"does not build here: CompilationError: no such op"):
        k._launch_wgrad(dy_t, dy_s, x_t, x_s, offs, out, block=0, accumulate=False, table=None, config=None,
                        use_tma=None, gluon=True)


def test_gluon_wgrad_build_failure_falls_back_once(monkeypatch):
    """A Triton whose Gluon cannot build the wgrad kernel: one RuntimeWarning naming the error, then the
    Triton kernel, and no second attempt."""
    pytest.importorskip("triton")
    from distwgrad.kernels.gluon import grouped_wgrad_fp8_launch as kl
    from triton.compiler.errors import CompilationError
    k = _kernels()
    calls, taken = [], []

    def failing_launch(*a, **kws):
        calls.append(1)
        raise CompilationError("src", None, "no such op")
    monkeypatch.setattr(kl, "launch", failing_launch)
    monkeypatch.setattr(k, "_gluon_wgrad", lambda *a: True)
    monkeypatch.setattr(k, "_num_sms", lambda device: 132)
    monkeypatch.setattr(k, "_GLUON_FAILED", {})
    monkeypatch.setattr(k, "_wgrad_fp8_kernel", StubKernel(lambda grid, *a, **kws: taken.append("triton")))
    dy_t, dy_s, x_t, x_s, offs = _wgrad_operands()
    out = torch.zeros(2, dy_t.shape[0], x_t.shape[0])
    launch = lambda: k._launch_wgrad(dy_t, dy_s, x_t, x_s, offs, out, block=0, accumulate=True, table=None,  # noqa: E731
                                     config=None, use_tma=None)
    with pytest.warns(RuntimeWarning, match=r"(?s)Gluon FP8 wgrad kernel does not build .*no such op"):
        launch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launch()                      # no second attempt, no second warning
    assert calls == [1] and taken == ["triton", "triton"]


@pytest.mark.parametrize("accumulate,table,tiles,grid", [(False, False, 2 * 2 * 1, 4), (True, True, 2 * 2 * 1, 4),
                                                         (True, False, None, 132)])
def test_gluon_wgrad_launch(monkeypatch, accumulate, table, tiles, grid):
    """``grouped_wgrad_fp8_launch.launch``: min(tiles, SMs) programs; the module's launch choices
    (``GroupedGemmFp8Tuning.wgrad_gluon_*``) and the output form reach the kernel."""
    pytest.importorskip("triton")
    from distwgrad.kernels.gluon import grouped_wgrad_fp8 as kw
    if not kw.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    k = _kernels()
    launched = []
    monkeypatch.setattr(kw, "wgrad_kernel", StubKernel(lambda g, *a, **kws: launched.append((g, a, kws))))
    monkeypatch.setattr(kw, "descriptor", lambda t, block: None)
    monkeypatch.setattr(k, "_num_sms", lambda device: 132)
    monkeypatch.setattr(k, "_GLUON_FAILED", {})
    N, K = (256, 128) if tiles else (4096, 4096)
    dy_t, dy_s, x_t, x_s, offs = _wgrad_operands(N=N, K=K)
    out = torch.zeros(2, N, K)
    tbl = torch.zeros(2, dtype=torch.int64) if table else None
    assert k._launch_gluon_wgrad(dy_t, dy_s, x_t, x_s, offs, out[0] if table else out, accumulate, tbl)
    (g, args, kws), = launched
    assert g == (grid,)
    assert kws["ADD_MODE"] == (3 if accumulate else 0) and kws["PTR_TABLE"] is table
    t = current().grouped_gemm_fp8
    assert kws["NUM_STAGES"] == t.wgrad_gluon_stages and kws["num_warps"] == 8
    assert kws["EPI_WARPS"] == (t.wgrad_gluon_epilogue_warps if kw._WS_PAIRS else 0)
    _, _, _, groups, output, _, tracing = args  # a_desc, b_desc, T, then the kernel's argument tuples
    assert kws["TRACE"] is False and tracing[1] == 0  # untraced: no trace buffer, nothing of it built
    assert groups[0] is offs and output[0] is (tbl if table else out)
    assert output[1:4] == ((0, K, 1) if table else (N * K, K, 1))
    assert output[4] is offs and kws["FIRST"] is False  # no flag: a placeholder pointer the kernel never reads


def test_gluon_blockwise_wgrad_launch(monkeypatch):
    """[Note: blockwise wgrad scales]: ``launch(..., block=128)`` hands the kernel dy^T's scales as they are and
    x^T's columns-contiguous ([chunks, K rounded up to 128], zeros past K), with their strides; any other
    block is refused, naming it."""
    pytest.importorskip("triton")
    from distwgrad.kernels.gluon import grouped_wgrad_fp8 as kw
    from distwgrad.kernels.gluon import grouped_wgrad_fp8_launch as kl
    if not kw.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    launched = []
    monkeypatch.setattr(kw, "wgrad_kernel", StubKernel(lambda g, *a, **kws: launched.append((g, a, kws))))
    monkeypatch.setattr(kw, "descriptor", lambda t, block: None)
    dy_t, dy_s, x_t, x_s, offs = _wgrad_operands(T=384, N=256, K=200, block=128)
    x_s = torch.arange(200 * 3, dtype=torch.float32).reshape(200, 3)
    out = torch.zeros(2, 256, 200)
    kl.launch(dy_t, dy_s, x_t, x_s, offs, out, None, add_mode=3, stages=4, epilogue_warps=2, num_sms=8, block=128)
    (g, args, kws), = launched
    scales = args[5]
    assert kws["BLOCKWISE"] is True and scales[0] is dy_s
    cols = scales[1]
    assert cols.shape == (3, 256) and torch.equal(cols[:, :200], x_s.t()) and not cols[:, 200:].any()
    assert scales[2:] == (3, 1, 1, 256)  # dy^T's (row, chunk) strides, x^T's (column, chunk) strides
    with pytest.raises(ValueError, match="chunk is 128 tokens; blockwise scales of 1x64 tiles"):
        kl.launch(dy_t, dy_s, x_t, x_s, offs, out, None, add_mode=3, stages=4, epilogue_warps=2, num_sms=8, block=64)


def test_gluon_wgrad_trace_launch(monkeypatch):
    """[Note: tracing the MMA warps' tile phases]: ``launch(..., trace=)`` hands the kernel the buffer and
    its tiles per program, and refuses a buffer of another shape, naming both."""
    pytest.importorskip("triton")
    from distwgrad.kernels.gluon import grouped_wgrad_fp8 as kw
    from distwgrad.kernels.gluon import grouped_wgrad_fp8_launch as kl
    if not kw.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    launched = []
    monkeypatch.setattr(kw, "wgrad_kernel", StubKernel(lambda g, *a, **kws: launched.append((g, a, kws))))
    monkeypatch.setattr(kw, "descriptor", lambda t, block: None)
    dy_t, dy_s, x_t, x_s, offs = _wgrad_operands(N=384, K=256)
    out = torch.zeros(2, 384, 256)
    tiles = 2 * 3 * 2
    assert kl.trace_shape(tiles, 5) == (5, 3, 5)  # 12 tiles over 5 programs: at most 3 each
    common = dict(add_mode=0, stages=4, epilogue_warps=2, num_sms=5)
    trace = torch.zeros(5, 3, 5, dtype=torch.int64)
    kl.launch(dy_t, dy_s, x_t, x_s, offs, out, None, trace=trace, **common)
    (g, args, kws), = launched
    assert g == (5,) and args[6][0] is trace and args[6][1] == 3 and kws["TRACE"] is True
    with pytest.raises(ValueError, match=r"trace must be shaped \(5, 3, 5\), got \(5, 2, 5\)"):
        kl.launch(dy_t, dy_s, x_t, x_s, offs, out, None, trace=torch.zeros(5, 2, 5, dtype=torch.int64), **common)
    with pytest.raises(ValueError, match="add_mode -1 writes nothing"):  # a dry run is traced only
        kl.launch(dy_t, dy_s, x_t, x_s, offs, out, None, **{**common, "add_mode": -1})
    assert kws["ZERO_EDGES"] is True
    for add_mode in (0, 3):  # skipping the zeroing would add other groups' tokens: a dry run's diagnostic only
        with pytest.raises(ValueError, match=f"zero_edges=False .* got add_mode {add_mode}"):
            kl.launch(dy_t, dy_s, x_t, x_s, offs, out, None, trace=trace, zero_edges=False,
                      **{**common, "add_mode": add_mode})
    kl.launch(dy_t, dy_s, x_t, x_s, offs, out, None, trace=trace, zero_edges=False, **{**common, "add_mode": -1})
    assert launched[-1][2]["ZERO_EDGES"] is False and launched[-1][2]["ADD_MODE"] == -1


def test_a_descriptor_takes_the_default_layout_made_once():
    """``gluon.descriptor``: the default swizzled layout of its tiles and dtype, one object for each (made once: it
    is most of a descriptor's host time)."""
    pytest.importorskip("triton")
    from distwgrad.kernels import gluon as kg
    if not kg.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    t = torch.zeros(256, 128, dtype=torch.float8_e4m3fn)
    for x, gl_dtype in ((t, kg.gl.float8e4nv), (t.view(torch.float8_e5m2), kg.gl.float8e5)):
        for block in ((128, 64), (128, 128), (64, 32)):
            d = kg.descriptor(x, block)
            assert d.base is x and list(d.shape) == [256, 128] and list(d.strides) == [128, 1]
            assert list(d.block_shape) == list(block)
            assert d.layout == kg.gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)
            assert kg.descriptor(x[64:], block).layout is d.layout
