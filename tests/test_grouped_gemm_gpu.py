"""The grouped GEMMs on a GPU (``-m gpu``): bf16 at realistic shapes against the oracle, half and wide tail
tiles bit for bit against full tiles, other dtypes, wgrad add modes, L2 prefetch, the Gluon wgrad (both
tails, NaN tokens past a group, Triton's allocator), E=256, CUDA graphs and compile.
"""

import dataclasses

import pytest
import torch
from distwgrad.kernels import current
from grouped_gemm_cases import _check, _check_all_ops, _inputs, _kernels, _poisoned, _random_offsets

from distwgrad.testing import reference as R

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T,E,K,N,use_tma", [
    (4096, 8, 1024, 1536, None),     # TMA on Hopper
    (4096, 8, 1024, 1536, False),    # masked pointer loads
    (8192, 64, 512, 384, None),      # ~128 tokens per expert: 64-row tiles
    (3000, 5, 1000, 1304, None),     # K, N off the tile grid; dgrad's reduction tail -> pointer path
    (2500, 6, 999, 515, None),       # rows not 16-byte aligned -> pointer path everywhere
])
def test_gpu_bf16(T, E, K, N, use_tma):
    _check_all_ops(T, E, K, N, torch.bfloat16, "cuda", seed=T + E, use_tma=use_tma)


def _tail_splits(head: list[int], T: int, E: int, seed: int) -> list[int]:
    """Tokens per group: ``head`` (group ends at chosen remainder classes), the rest of T spread at random."""
    gen = torch.Generator().manual_seed(seed)
    rest = torch.bincount(torch.randint(0, E - len(head), (T - sum(head),), generator=gen), minlength=E - len(head))
    return head + rest.tolist()


def _default_ragged_config(T, E, K, N):
    from distwgrad.kernels import _grouped_gemm_configs as C
    return C.pick_ragged(num_tokens=T, num_groups=E, n=N, k=K, elem_bytes=2,
                         smem_limit=torch.cuda.get_device_properties(0).shared_memory_per_block_optin)


def _check_tiles_agree(T, E, K, N, splits, cfg, full, what: str) -> None:
    """``cfg`` against the oracle (fprop with bias, dgrad), then bit for bit against ``full`` (every tile at
    full height: the same products in the same K order)."""
    k = _kernels()
    _check_all_ops(T, E, K, N, torch.bfloat16, "cuda", seed=T, ops=("fprop", "dgrad"), splits=splits, config=cfg)
    d = _inputs(T, E, K, N, torch.bfloat16, "cuda", seed=T)
    offs = torch.tensor(splits).cumsum(0).to(device="cuda", dtype=torch.int32)
    for op, a, cols, bias in (("fprop", d["x"], N, d["b"]), ("dgrad", d["dy"], K, None)):
        outs = [k._launch_ragged(a, d["w"], offs, bias, _poisoned((T, cols), a), w_trans=op == "fprop", config=c,
                                 use_tma=None) for c in (cfg, full)]
        differ = int((outs[0] != outs[1]).sum())
        assert differ == 0, f"{op}: {differ} elements differ between {what} and full-height tiles"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T,E,K,N", [
    (16384, 128, 2048, 768),   # the E=128 MoE shape's ~128 tokens per group: every other group ends in a half tile
    (3000, 12, 1000, 1304),    # K, N off the tile grid: masked edges in both tile heights
])
def test_gpu_half_tail(T, E, K, N):
    """[Note: half tail tiles]: fprop (with bias) and dgrad of the default config (half tails on) against the
    oracle, and bit for bit against the same config with every tile at full height (the same products
    in the same K order). The splits put group ends at every remainder class of the 128-row tile: 1, 63,
    64 (half tiles), 65, 127, 128 (full ones), plus empty groups and random ones."""
    splits = _tail_splits([1, 63, 64, 65, 127, 128, 0, 128 + 64, 128 + 65], T, E, seed=E)
    cfg = _default_ragged_config(T, E, K, N)
    assert cfg.half_tail, cfg.short()
    cfg = dataclasses.replace(cfg, wide_tail=False)  # every half tile runs as one (with wide tails: groups <= 64)
    _check_tiles_agree(T, E, K, N, splits, cfg, dataclasses.replace(cfg, half_tail=False), "half")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T,E,K,N", [
    (16384, 128, 2048, 768),   # the E=128 MoE shape: every other group's remainder joins its tile
    (3000, 12, 1000, 1304),    # K, N off the tile grid: masked edges in all three tile heights
])
def test_gpu_wide_tail(T, E, K, N):
    """[Note: wide tail tiles]: fprop (with bias) and dgrad of the default config with wide tails on against
    the oracle, and bit for bit against the same config with every tile at full height (the same products
    in the same K order). The splits put group ends at every remainder class of the 128-row tile: one tile
    of 1, 64 (half) or 65, 128 rows; one wide tile of 129 or 192; two tiles (193 = 128 + 65); two with the
    last wide (320, 321), and an empty group; the rest random."""
    splits = _tail_splits([1, 64, 65, 128, 129, 192, 193, 0, 320, 321], T, E, seed=E + 1)
    cfg = _default_ragged_config(T, E, K, N)
    # the default where groups are small
    assert cfg.wide_tail == (T <= current().grouped_gemm.wide_tail_max_tokens * E), cfg.short()
    _check_tiles_agree(T, E, K, N, splits, dataclasses.replace(cfg, wide_tail=True),
                       dataclasses.replace(cfg, half_tail=False, wide_tail=False), "wide")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_other_dtypes(dtype):
    _check_all_ops(2048, 6, 256, 384, dtype, "cuda", seed=2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", ["load", "atomic", "tma_add"])
def test_gpu_wgrad_add_modes(mode):
    """Every way of adding into fp32 out, on the tile grid and off it (rows past N dropped per group)."""
    from distwgrad.kernels._grouped_gemm_configs import TileConfig
    cfg = TileConfig(128, 128, 32, num_warps=4, num_stages=4, add_mode=mode)
    for T, E, K, N in ((4096, 8, 1024, 1536), (3000, 5, 1000, 1304)):
        _check_all_ops(T, E, K, N, torch.bfloat16, "cuda", seed=T, config=cfg, ops=("wgrad_acc", "wgrad_acc_list"))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", ["load", "atomic", "tma_add", "atomic/ptr"])
def test_gpu_wgrad_l2_prefetch(mode):
    """[Note: L2 prefetch of the accumulated tile]: the same sums with the prefetch, on the tile grid and
    off it (the prefetch addresses clamp into the output); "atomic/ptr" is the small-group default."""
    from distwgrad.kernels._grouped_gemm_configs import TileConfig
    cfg = TileConfig(128, 128, 32, num_warps=4, num_stages=4, add_mode=mode.split("/")[0], tma="ptr" not in mode,
                     l2_prefetch=True)
    for T, E, K, N in ((4096, 8, 1024, 1536), (3000, 5, 1000, 1304), (300, 64, 256, 384)):
        _check_all_ops(T, E, K, N, torch.bfloat16, "cuda", seed=T, config=cfg, ops=("wgrad_acc", "wgrad_acc_list"))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T,E,K,N,splits", [
    (4096, 8, 1024, 1536, None),            # ~512 tokens per group
    (8192, 64, 512, 384, None),             # ~128 tokens per group: two chunks, the last often cut
    (3000, 5, 1000, 1304, None),            # T, K and N off the tile
    (1000, 1, 208, 144, None),              # one group
    (512, 5, 256, 256, [100, 0, 20, 264, 128]),  # groups inside one chunk, one ending on the chunk grid
    (256, 2, 128, 128, [0, 256]),           # the first group empty
])
@pytest.mark.parametrize("tail", ["tma", "zero"])
def test_gpu_gluon_wgrad(T, E, K, N, splits, tail, monkeypatch, kernel_tuning):
    """[Note: the bf16 wgrad in the fp8 kernel]: the Gluon wgrad (``wgrad_gluon``) accumulating bf16 and fp16
    products into a stacked fp32 output and into a list of strided buffers, against the oracle, with each
    group's tail zero-filled by TMA or zeroed by the MMA warps ([Note: a group's tail zero-filled by TMA]),
    chained ([Note: chained bf16 accumulation]); a fresh fp32 output (asked of the Gluon kernel: by default
    a fresh wgrad runs the Triton kernel) bit-equal to its add into zeros ([Note: a fresh first
    contribution]); every call ran in the Gluon kernel, and a fresh wgrad in dy's dtype in the Triton
    kernel."""
    from distwgrad.kernels.gluon import grouped_wgrad_fp8 as kw
    if not kw.AVAILABLE or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel runs on Hopper with a Triton that has Gluon")
    k = _kernels()
    kernel_tuning(grouped_gemm=dict(wgrad_gluon=True, wgrad_gluon_min_tokens=0, wgrad_gluon_tail=tail))
    calls = []
    real = k._launch_gluon_wgrad
    monkeypatch.setattr(k, "_launch_gluon_wgrad", lambda *a: calls.append(a[0].dtype) is None and real(*a))
    for dtype in (torch.bfloat16, torch.float16):
        _check_all_ops(T, E, K, N, dtype, "cuda", seed=T + K, splits=splits, exact_fresh=True, fresh_gluon=True,
                       ops=("wgrad", "wgrad_acc", "wgrad_acc_list", "wgrad_fp32"))
    assert len(calls) == 8 and "wgrad16" not in k._GLUON_FAILED, (calls, k._GLUON_FAILED)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tail", ["tma", "zero"])
def test_gpu_gluon_wgrad_tail_ignores_other_tokens(tail, kernel_tuning):
    """A group's last chunk reaches past its end into the next group's tokens or, after the last group,
    into unrouted rows: those must count as zeros, even where they are NaN ([Note: a group's tail
    zero-filled by TMA]). The unrouted rows of dy and x are NaN here; the sums must match the oracle over
    the routed rows alone."""
    from distwgrad.kernels.gluon import grouped_wgrad_fp8 as kw
    if not kw.AVAILABLE or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel runs on Hopper with a Triton that has Gluon")
    k = _kernels()
    kernel_tuning(grouped_gemm=dict(wgrad_gluon_tail=tail))
    T, K, N, splits = 1024, 272, 400, [100, 37, 0, 500, 64]  # routed: 701 of 1024 rows
    d = _inputs(T, len(splits), K, N, torch.bfloat16, "cuda", seed=7)
    offs = torch.tensor(splits).cumsum(0).to(device="cuda", dtype=torch.int32)
    end = sum(splits)
    dy, x, m = d["dy"].clone(), d["x"].clone(), d["m"]
    dy[end:], x[end:] = float("nan"), float("nan")
    out = m.clone()
    k._launch_wgrad(dy, x, offs, out, accumulate=True, table=None, config=None, use_tma=None, gluon=True)
    assert not out.isnan().any(), "an unrouted (NaN) token reached a sum"
    _check(f"gluon wgrad, tail {tail}", out, R.grouped_wgrad(dy[:end], x[:end], offs, out=m.clone()),
           m.double() + R.grouped_wgrad(dy[:end].double(), x[:end].double(), offs))


@pytest.mark.gpu
@gpu
def test_gpu_gluon_wgrad_group_descriptors_rewritten_after_their_loads(kernel_tuning):
    """Each program's per-group descriptors live in one scratch slot, rewritten whenever its tiles change group
    ([Note: a group's tail zero-filled by TMA]); a load still in flight through the old descriptor would read the
    new group's tokens. Here groups of about 64 tokens (one chunk) change at nearly every tile, over repeated
    accumulating calls, each against the oracle."""
    from distwgrad.kernels.gluon import grouped_wgrad_fp8 as kw
    if not kw.AVAILABLE or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel runs on Hopper with a Triton that has Gluon")
    k = _kernels()
    kernel_tuning(grouped_gemm=dict(wgrad_gluon=True, wgrad_gluon_min_tokens=0, wgrad_gluon_tail="tma"))
    T, E, K, N = 16384, 256, 512, 384
    for seed in range(8):
        d = _inputs(T, E, K, N, torch.bfloat16, "cuda", seed=seed)
        x, dy, offs, m = d["x"], d["dy"], d["offs"], d["m"]
        out = m.clone()
        k._launch_wgrad(dy, x, offs, out, accumulate=True, table=None, config=None, use_tma=None, gluon=True)
        _check(f"gluon wgrad, seed {seed}", out, R.grouped_wgrad(dy, x, offs, out=m.clone()),
               m.double() + R.grouped_wgrad(dy.double(), x.double(), offs))


@pytest.mark.gpu
@gpu
def test_gpu_gluon_wgrad_restores_the_callers_allocator(kernel_tuning):
    """The Gluon wgrad's scratch comes from torch for its own launch only: a caller's Triton allocator is
    neither called nor replaced ([Note: a group's tail zero-filled by TMA])."""
    from distwgrad.kernels.gluon import grouped_wgrad_fp8 as kw
    from triton.runtime import _allocation
    if not kw.AVAILABLE or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel runs on Hopper with a Triton that has Gluon")
    k = _kernels()
    kernel_tuning(grouped_gemm=dict(wgrad_gluon_tail="tma"))
    calls = []

    def mine(size, alignment, stream):
        calls.append(size)
        return torch.empty(size, dtype=torch.int8, device="cuda")
    token = _allocation._allocator.set(mine)
    try:
        d = _inputs(1024, 4, 256, 128, torch.bfloat16, "cuda", seed=3)
        out = d["m"].clone()
        k._launch_wgrad(d["dy"], d["x"], d["offs"], out, accumulate=True, table=None, config=None, use_tma=None,
                        gluon=True)
        assert _allocation._allocator.get() is mine and not calls, calls
    finally:
        _allocation._allocator.reset(token)
    _check("gluon wgrad", out, R.grouped_wgrad(d["dy"], d["x"], d["offs"], out=d["m"].clone()),
           d["m"].double() + R.grouped_wgrad(d["dy"].double(), d["x"].double(), d["offs"]))


@pytest.mark.gpu
@gpu
def test_gpu_e256():
    _check_all_ops(3000, 256, 64, 96, torch.bfloat16, "cuda", seed=256)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("wgrad", ["default", "triton", "gluon/tma", "gluon/zero"])
def test_gpu_cuda_graph_and_compile(wgrad, kernel_tuning):
    """Captured once, replayed with new routing (offsets on the device change, the graph does not); the
    accumulating wgrad as the default dispatch picks it (the Triton kernel), with the Triton kernel asked for,
    and through the Gluon kernel with either tail, whose per-group descriptors
    live in scratch allocated at capture ([Note: a group's tail zero-filled by TMA])."""
    k = _kernels()
    if wgrad == "triton":
        kernel_tuning(grouped_gemm=dict(wgrad_gluon=False))
    elif wgrad != "default":
        from distwgrad.kernels.gluon import grouped_wgrad_fp8 as kw
        if not kw.AVAILABLE or torch.cuda.get_device_capability()[0] != 9:
            pytest.skip("the Gluon kernel runs on Hopper with a Triton that has Gluon")
        kernel_tuning(grouped_gemm=dict(wgrad_gluon=True, wgrad_gluon_min_tokens=0,
                                        wgrad_gluon_tail=wgrad.split("/")[1]))
    T, E, K, N = 2048, 8, 256, 512
    d = _inputs(T, E, K, N, torch.bfloat16, "cuda", seed=4)
    x, w, dy, offs, m = d["x"], d["w"], d["dy"], d["offs"], d["m"]
    bufs = [m[e].clone() for e in range(E)]

    def step():
        return k.grouped_fprop(x, w, offs), k.grouped_dgrad(dy, w, offs), k.grouped_wgrad(dy, x, offs,
                                                                                           out=bufs)
    step()  # warm-up: compile, pointer table
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, dx, _ = step()
    new_offs = _random_offsets(T, E, torch.Generator().manual_seed(99), "cuda")
    offs.copy_(new_offs)
    for e in range(E):
        bufs[e].copy_(m[e])
    graph.replay()
    torch.cuda.synchronize()
    _check("graph fprop", y, R.grouped_fprop(x, w, new_offs), R.grouped_fprop(x.double(), w.double(), new_offs))
    _check("graph dgrad", dx, R.grouped_dgrad(dy, w, new_offs),
           R.grouped_dgrad(dy.double(), w.double(), new_offs))
    _check("graph wgrad_acc_list", torch.stack(bufs), R.grouped_wgrad(dy, x, new_offs, out=m.clone()),
           m.double() + R.grouped_wgrad(dy.double(), x.double(), new_offs))
    compiled = torch.compile(lambda: (k.grouped_fprop(x, w, offs), k.grouped_wgrad(dy, x, offs)),
                             fullgraph=True)()
    torch.testing.assert_close(compiled[0], k.grouped_fprop(x, w, offs), rtol=0, atol=0)
    torch.testing.assert_close(compiled[1], k.grouped_wgrad(dy, x, offs), rtol=0, atol=0)
