"""The grouped GEMMs on a GPU (``-m gpu``): bf16 at realistic shapes against the oracle, half and wide tail
tiles bit for bit against full tiles, other dtypes, wgrad add modes, L2 prefetch, the wgrad at edge splits
and with NaN tokens past a group, E=256, CUDA graphs and compile.
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
    (8192, 64, 512, 384, None),             # ~128 tokens per group
    (512, 5, 256, 256, [100, 0, 20, 264, 128]),  # small groups, one ending on a 128-token boundary
    (256, 2, 128, 128, [0, 256]),           # the first group empty
])
def test_gpu_wgrad_splits(T, E, K, N, splits):
    """The wgrad at edge splits, bf16 and fp16, fresh (in dy's dtype and fp32), added into a stacked fp32
    output and into a list of strided buffers, against the oracle."""
    for dtype in (torch.bfloat16, torch.float16):
        _check_all_ops(T, E, K, N, dtype, "cuda", seed=T + K, splits=splits,
                       ops=("wgrad", "wgrad_acc", "wgrad_acc_list", "wgrad_fp32"))


@pytest.mark.gpu
@gpu
def test_gpu_wgrad_ignores_tokens_past_the_groups():
    """A group's tokens end where the next group's begin or, after the last group, at unrouted rows: those
    must count as zeros, even where they are NaN. The unrouted rows of dy and x are NaN here; the sums must
    match the oracle over the routed rows alone."""
    k = _kernels()
    T, K, N, splits = 1024, 272, 400, [100, 37, 0, 500, 64]  # routed: 701 of 1024 rows
    d = _inputs(T, len(splits), K, N, torch.bfloat16, "cuda", seed=7)
    offs = torch.tensor(splits).cumsum(0).to(device="cuda", dtype=torch.int32)
    end = sum(splits)
    dy, x, m = d["dy"].clone(), d["x"].clone(), d["m"]
    dy[end:], x[end:] = float("nan"), float("nan")
    out = m.clone()
    k._launch_wgrad(dy, x, offs, out, accumulate=True, table=None, config=None, use_tma=None)
    assert not out.isnan().any(), "an unrouted (NaN) token reached a sum"
    _check("wgrad past the groups", out, R.grouped_wgrad(dy[:end], x[:end], offs, out=m.clone()),
           m.double() + R.grouped_wgrad(dy[:end].double(), x[:end].double(), offs))


@pytest.mark.gpu
@gpu
def test_gpu_e256():
    _check_all_ops(3000, 256, 64, 96, torch.bfloat16, "cuda", seed=256)


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_and_compile():
    """Captured once, replayed with new routing (offsets on the device change, the graph does not), the
    accumulating wgrad into a list of buffers among the captured calls."""
    k = _kernels()
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
