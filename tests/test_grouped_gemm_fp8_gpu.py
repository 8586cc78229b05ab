"""The FP8 grouped GEMMs on a GPU (``-m gpu``): bf16 sources quantized to fp8 at realistic shapes against the
oracle (printing the worst error/bound ratios, for the provisional Hopper term of the bound), the Gluon
kernels bit for bit against the Triton kernel, chunk order, NaN masking, weight layouts and CUDA graphs.
"""

from __future__ import annotations

import json

import pytest
import torch
from grouped_gemm_fp8_cases import (
    SHAPE_TMA,
    WORST,
    _check_chunk_order,
    _kernels,
    _offsets,
    _problem,
    _quantized,
    _run_ragged,
    _run_wgrad,
    _weight_form,
)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("recipe", ["per_tensor", "per_tensor_fast", "blockwise"])
@pytest.mark.parametrize("T,E,K,N,use_tma", [
    (4096, 8, 1024, 1536, None),     # TMA on Hopper
    (4096, 8, 1024, 1536, False),    # masked pointer loads
    (8192, 64, 512, 384, None),      # ~128 tokens per expert
    (3000, 5, 1000, 1304, None),     # K, N, T off the 16-byte grid -> pointer path; partial blocks
])
def test_gpu_fp8(recipe, T, E, K, N, use_tma):
    gen = torch.Generator().manual_seed(T + E)
    src = (torch.randn(T, K, generator=gen), torch.randn(E, N, K, generator=gen) * K ** -0.5,
           torch.randn(T, N, generator=gen))
    pb = _problem(T, E, K, N, recipe, src=src, device="cuda", seed=T)
    bias = torch.randn(E, N, device="cuda", dtype=torch.bfloat16)
    _run_ragged("fprop", pb, bias=bias, form="stacked", use_tma=use_tma)
    _run_ragged("dgrad", pb, form="stacked", use_tma=use_tma)
    _run_ragged("dgrad", pb, form="kn", use_tma=use_tma)
    for mode in ("fresh", "acc", "acc_list"):  # (a fresh bf16 output: the fp32 one's bits rounded)
        _run_wgrad(pb, mode, use_tma=use_tma, out_dtype=torch.bfloat16 if mode == "fresh" else torch.float32)
    print("worst error/bound:", json.dumps({k: round(v, 4) for k, v in WORST.items()}))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", ["m128", "m64"])
@pytest.mark.parametrize("recipe", ["per_tensor", "blockwise"])
@pytest.mark.parametrize("T,E,K,N", [
    (4096, 8, 1024, 1536),     # 8 K steps (fprop) / 12 (dgrad): even counts
    (2048, 5, 384, 1040),      # 3 steps (odd), N off the 128 grid
    (1024, 3, 128, 256),       # one step: the loop and the tail never run
    (1024, 4, 256, 128),       # two steps: the tail only
    (8192, 64, 512, 384),      # ~128 tokens per group, random splits with empty groups
    (1000, 1, 208, 144),       # one group; K ends inside a step (TMA's zero fill), T off the tile
])
def test_gpu_gluon_promoting_kernel(recipe, T, E, K, N, variant, kernel_tuning):
    """[Note: promotion under the next MMA]: the Gluon kernel against the oracle (bound with the
    128-deep Hopper term) and against the Triton kernel: the same bits (the same 128-deep partial sums,
    added and scaled in the same order; blockwise too in every GPU run so far, asserted per-tensor)."""
    from distwgrad.kernels.gluon import grouped_gemm_fp8 as kg
    if not kg.AVAILABLE or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel runs on Hopper with a Triton that has Gluon")
    kernel_tuning(grouped_gemm_fp8=dict(ragged_gluon_block_m=64 if variant == "m64" else 128))
    gen = torch.Generator().manual_seed(T + K)
    src = (torch.randn(T, K, generator=gen), torch.randn(E, N, K, generator=gen) * K ** -0.5,
           torch.randn(T, N, generator=gen))
    pb = _problem(T, E, K, N, recipe, src=src, device="cuda", seed=K)
    bias = torch.randn(E, N, device="cuda", dtype=torch.bfloat16)
    n = int(pb.offs[-1])
    for op, form, dt in (("fprop", "stacked", torch.bfloat16), ("dgrad", "kn", torch.bfloat16),
                         ("fprop", "stacked", torch.float32), ("dgrad", "kn", torch.float16)):
        b = bias if op == "fprop" else None
        ours = _run_ragged(op, pb, bias=b, form=form, out_dtype=dt, gluon=True)
        triton_k = _run_ragged(op, pb, bias=b, form=form, out_dtype=dt, gluon=False)
        same = (ours[:n] == triton_k[:n]) | (ours[:n].isnan() & triton_k[:n].isnan())
        print(f"gluon {variant} vs triton {op} {dt} {recipe} T={T} E={E} K={K} N={N}: "
              f"{int((~same).sum())} of {same.numel()} "
              f"differ, max |diff| {float((ours[:n].float() - triton_k[:n].float()).abs().max()):.3g}")
        if recipe == "per_tensor":
            assert bool(same.all()), f"{op} {dt}: the Gluon and Triton kernels differ"
    print("worst error/bound:", json.dumps({k: round(v, 4) for k, v in WORST.items()}))


# the Gluon wgrad kernel's launch choices: (add mode, ring depth, epilogue warps); "atomic_s5_epi" is the default
# (GroupedGemmFp8Tuning.wgrad_gluon_*); epilogue warps 0: what a Triton without warp_specialize pairs runs
WGRAD_GLUON_VARIANTS = {"atomic_s5_epi": ("atomic", 5, 2), "atomic_s5": ("atomic", 5, 0),
                        "atomic": ("atomic", 4, 0), "load": ("load", 4, 0), "atomic_s3": ("atomic", 3, 0),
                        "load_epi_s3": ("load", 3, 2)}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", sorted(WGRAD_GLUON_VARIANTS))
@pytest.mark.parametrize("T,E,K,N,splits", [
    (4096, 8, 1024, 1536, None),            # ~512 tokens per group: head, body and tail chunks
    (8192, 64, 512, 384, None),             # ~128 per group, about a third empty: mostly edge chunks
    (2048, 5, 384, 1040, None),             # N off the 128 grid
    (1008, 1, 208, 144, None),              # one group; T, K, N off the tile (TMA's zero fill)
    (512, 5, 256, 256, [100, 0, 20, 264, 128]),  # a group inside one chunk (head = tail), one exactly on it
    (256, 2, 128, 128, [0, 256]),           # the first group empty, the second on the grid
])
def test_gpu_gluon_wgrad(T, E, K, N, splits, variant, kernel_tuning):
    """[Note: fp8 wgrad under the next MMA]: the Gluon per-tensor wgrad against the oracle (fresh into a
    NaN-poisoned output, accumulating into a stacked tensor and into a list of strided buffers) and
    against the Triton kernel: the same bits (the same 128-token partial sums, added in the same order);
    a fresh bf16 / fp16 output holds the fp32 output's bits rounded to nearest even."""
    from distwgrad.kernels.gluon import grouped_wgrad_fp8 as kw
    if not kw.AVAILABLE or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel runs on Hopper with a Triton that has Gluon")
    add, stages, epilogue_warps = WGRAD_GLUON_VARIANTS[variant]
    # a fresh 16-bit output handed off rounded has room for one stage more ([Note: a 16-bit handoff])
    kernel_tuning(grouped_gemm_fp8=dict(wgrad_gluon_add_mode=add, wgrad_gluon_stages=stages,
                                        wgrad_gluon_stages_16=stages + 1 if epilogue_warps else stages,
                                        wgrad_gluon_epilogue_warps=epilogue_warps))
    gen = torch.Generator().manual_seed(T + K)
    src = (torch.randn(T, K, generator=gen), torch.randn(E, N, K, generator=gen) * K ** -0.5,
           torch.randn(T, N, generator=gen))
    pb = _problem(T, E, K, N, "per_tensor", src=src, device="cuda", seed=K, splits=splits)
    low = torch.bfloat16 if epilogue_warps else torch.float16  # a fresh output's rounding, either writer
    for mode in ("fresh", "acc", "acc_list"):
        ours = _run_wgrad(pb, mode, gluon=True, seed=E, out_dtype=low if mode == "fresh" else torch.float32)
        triton_k = _run_wgrad(pb, mode, gluon=False, seed=E)
        same = (ours == triton_k) | (ours.isnan() & triton_k.isnan())
        print(f"gluon wgrad {variant} vs triton {mode} T={T} E={E} K={K} N={N}: {int((~same).sum())} of "
              f"{same.numel()} differ, max |diff| {float((ours - triton_k).abs().max()):.3g}")
        assert bool(same.all()), f"wgrad {mode}: the Gluon and Triton kernels differ"
    print("worst error/bound:", json.dumps({k: round(v, 4) for k, v in WORST.items()}))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant,stages_blockwise", [("atomic_s5_epi", 4), ("load_epi_s3", 3), ("atomic", 2)])
@pytest.mark.parametrize("T,E,K,N,splits", [
    (4096, 8, 1024, 1536, None),            # ~512 tokens per group: head, body and tail chunks
    (8192, 64, 512, 384, None),             # ~128 per group, about a third empty: mostly edge chunks
    (2048, 5, 384, 1040, None),             # N off the 128 grid
    (1008, 1, 208, 144, None),              # one group; T, K, N off the tile (K's scales padded)
    (512, 5, 256, 256, [100, 0, 20, 264, 128]),  # a group inside one chunk (head = tail), one exactly on it
])
def test_gpu_gluon_blockwise_wgrad(T, E, K, N, splits, variant, stages_blockwise, kernel_tuning):
    """[Note: blockwise wgrad scales]: the Gluon blockwise wgrad against the oracle (fresh into a NaN-poisoned
    output, accumulating into a stacked tensor and into a list of strided buffers) and against the Triton
    kernel: the same bits (each chunk's partial times the outer product of its scales, added in chunk order);
    rings of 4, 3 and 2 stages (the scales' slots, one more than the stages, reused soonest with 2)."""
    from distwgrad.kernels.gluon import grouped_wgrad_fp8 as kw
    if not kw.AVAILABLE or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel runs on Hopper with a Triton that has Gluon")
    add, stages, epilogue_warps = WGRAD_GLUON_VARIANTS[variant]
    kernel_tuning(grouped_gemm_fp8=dict(wgrad_gluon_blockwise=True, wgrad_gluon_stages_blockwise=stages_blockwise,
                                        wgrad_gluon_add_mode=add,
                                        wgrad_gluon_stages=stages, wgrad_gluon_stages_16=stages + 1 if epilogue_warps
                                        else stages, wgrad_gluon_epilogue_warps=epilogue_warps))
    gen = torch.Generator().manual_seed(T + K)
    src = (torch.randn(T, K, generator=gen), torch.randn(E, N, K, generator=gen) * K ** -0.5,
           torch.randn(T, N, generator=gen))
    pb = _problem(T, E, K, N, "blockwise", src=src, device="cuda", seed=K, splits=splits)
    for mode in ("fresh", "acc", "acc_list"):
        ours = _run_wgrad(pb, mode, gluon=True, seed=E, out_dtype=torch.bfloat16 if mode == "fresh" else torch.float32)
        triton_k = _run_wgrad(pb, mode, gluon=False, seed=E)
        same = (ours == triton_k) | (ours.isnan() & triton_k.isnan())
        print(f"gluon blockwise wgrad {variant} vs triton {mode} T={T} E={E} K={K} N={N}: {int((~same).sum())} of "
              f"{same.numel()} differ, max |diff| {float((ours - triton_k).abs().max()):.3g}")
        assert bool(same.all()), f"blockwise wgrad {mode}: the Gluon and Triton kernels differ"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("path", ["gluon", "triton", "pointer"])
def test_gpu_wgrad_chunk_order(path):
    """[Note: fp8 wgrad chunks] on the GPU: the Gluon kernel and the Triton kernel's paths add a group's
    chunks in token order (the Hopper fp8 MMA sums these powers of two exactly)."""
    if path == "gluon":
        from distwgrad.kernels.gluon import grouped_wgrad_fp8 as kw
        if not kw.AVAILABLE or torch.cuda.get_device_capability()[0] != 9:
            pytest.skip("the Gluon kernel runs on Hopper with a Triton that has Gluon")
        _check_chunk_order("cuda", gluon=True, use_tma=None)
    else:
        _check_chunk_order("cuda", gluon=False, use_tma=path == "triton")


@pytest.mark.gpu
@gpu
def test_gpu_gluon_wgrad_foreign_nan_masked():
    """[Note: a group's edge chunks in shared memory]: fp8 NaN data of another group's token in a shared
    chunk stays out of this group's wgrad, for either operand (the TMA warp zeroes both)."""
    from distwgrad.kernels.gluon import grouped_wgrad_fp8 as kw
    if not kw.AVAILABLE or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel runs on Hopper with a Triton that has Gluon")
    T, E, K, N = SHAPE_TMA
    pb = _problem(T, E, K, N, "per_tensor", splits=[100, 0, 100, 88], device="cuda")
    pb.x_qt.data[3, 90] = float("nan")     # token 90 is group 0's; chunk [0, 128) also serves group 2
    pb.dy_qt.data[4, 110] = float("nan")   # token 110 is group 2's; the same chunk serves group 0
    dw = torch.full((E, N, K), float("nan"), device="cuda")
    _kernels()._launch_wgrad(pb.dy_qt.data, pb.dy_qt.scale_inv, pb.x_qt.data, pb.x_qt.scale_inv, pb.offs, dw,
                             block=0, accumulate=False, table=None, config=None, use_tma=None, gluon=True)
    rows_but_4 = torch.arange(pb.N, device=dw.device) != 4
    cols_but_3 = torch.arange(pb.K, device=dw.device) != 3
    assert bool(dw[0, :, 3].isnan().all()) and not bool(dw[2, :, 3][rows_but_4].isnan().any())
    assert bool(dw[2, 4, :].isnan().all()) and not bool(dw[0, 4, :][cols_but_3].isnan().any())
    assert bool((dw[1] == 0).all()), "the empty group's fresh output is zeros"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("recipe", ["per_tensor", "blockwise"])
def test_gpu_dgrad_weight_layouts(recipe):
    """dgrad with the [E, N, K] weight (contraction strided) and with a transposed copy (contraction
    contiguous, K-major for the fp8 wgmma): both must pass; the timings decide which the module caches."""
    from triton.testing import do_bench
    k = _kernels()
    T, E, K, N = 16384, 8, 2048, 4096
    gen = torch.Generator().manual_seed(0)
    src = (torch.randn(T, K, generator=gen), torch.randn(E, N, K, generator=gen) * K ** -0.5,
           torch.randn(T, N, generator=gen))
    pb = _problem(T, E, K, N, recipe, src=src, device="cuda")
    times = {}
    for form in ("stacked", "kn"):
        _run_ragged("dgrad", pb, form=form)
        w, w_s = _weight_form(pb, form)
        fn = lambda w=w, w_s=w_s: k._dgrad(pb.dy_q.data, pb.dy_q.scale_inv, w, w_s, pb.offs, pb.block,
                                           torch.bfloat16)
        times[form] = do_bench(fn, return_mode="median")
    print(f"dgrad {recipe} ms by weight layout:", times)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("recipe", ["per_tensor", "blockwise"])
def test_gpu_wgrad_tma_edges(recipe):
    """The TMA path's edge chunks on the GPU, ~128 tokens per group (most chunks straddle an edge)."""
    T, E, K, N = 8192, 64, 512, 384
    gen = torch.Generator().manual_seed(1)
    src = (torch.randn(T, K, generator=gen), torch.randn(E, N, K, generator=gen) * K ** -0.5,
           torch.randn(T, N, generator=gen))
    pb = _problem(T, E, K, N, recipe, src=src, device="cuda", seed=3)
    for m in ("fresh", "acc", "acc_list"):
        _run_wgrad(pb, m, use_tma=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("use_tma", [None, False])
def test_gpu_wgrad_foreign_nan_masked(use_tma):
    """fp8 NaN data under a finite scale (our quantizers never emit it, other producers may): only the
    group owning the token sees it, also when another group's chunk covers the token, i.e. both operands
    are masked. GPU only: the interpreter's fp8 -> fp32 cast turns NaN into finite values."""
    T, E, K, N = SHAPE_TMA
    pb = _problem(T, E, K, N, "blockwise", splits=[100, 0, 100, 88], device="cuda")
    pb.x_qt.data[3, 90] = float("nan")     # token 90 is group 0's; chunk [0, 128) also serves group 2
    pb.dy_qt.data[4, 110] = float("nan")   # token 110 is group 2's; the same chunk serves group 0
    dw = _run_wgrad(pb, "fresh", use_tma=use_tma)
    # Group 0's NaN is in column 3 (x), group 2's in row 4 (dy); each reaches only its own group.
    rows_but_4 = torch.arange(pb.N, device=dw.device) != 4
    cols_but_3 = torch.arange(pb.K, device=dw.device) != 3
    assert bool(dw[0, :, 3].isnan().all()) and not bool(dw[2, :, 3][rows_but_4].isnan().any())
    assert bool(dw[2, 4, :].isnan().all()) and not bool(dw[0, 4, :][cols_but_3].isnan().any())


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph():
    """Captured once, replayed with new routing (offsets on the device change, the graph does not)."""
    k = _quantized()
    T, E, K, N = 2048, 8, 256, 512
    pb = _problem(T, E, K, N, "blockwise", device="cuda", seed=4)
    m = torch.randn(E, N, K, device="cuda")
    bufs = [m[e].clone() for e in range(E)]
    w = _weight_form(pb, "stacked")

    def step():
        return (k.kernel_grouped_fprop_fp8(pb.x_q, w, pb.offs), k.kernel_grouped_dgrad_fp8(pb.dy_q, w, pb.offs),
                k.kernel_grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, pb.offs, out=bufs))
    step()  # warm-up: compile, pointer table
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, dx, _ = step()
    pb.offs.copy_(_offsets(T, E, torch.Generator().manual_seed(99)).cuda())
    for e in range(E):
        bufs[e].copy_(m[e])
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, k.kernel_grouped_fprop_fp8(pb.x_q, w, pb.offs), rtol=0, atol=0)
    torch.testing.assert_close(dx, k.kernel_grouped_dgrad_fp8(pb.dy_q, w, pb.offs), rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(bufs), k.kernel_grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, pb.offs, out=m.clone()),
                               rtol=0, atol=0)
