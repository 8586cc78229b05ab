"""The grouped GEMMs without a GPU: sm_90a builds of the Triton kernels (Triton ships ptxas; half and wide
tail tiles, the L2 prefetch) and the config picks.
"""

import re

import pytest
from grouped_gemm_cases import _kernels

# ---- sm_90a builds and config picks (no GPU needed) ---------------------------------------------------


def test_wgrad_l2_prefetch_only_where_it_was_measured_faster():
    """[Note: L2 prefetch of the accumulated tile]: the accumulating wgrad prefetches at ~128 tokens per
    group (bf16 round 7 on an H200: 115 vs 91 TFLOP/s; FP8 67 vs 59 and 64 vs 56), not at 1024 or more
    (slower or within noise there), never for a fresh output; a tile narrower than one line refuses."""
    pytest.importorskip("triton")
    from distwgrad.kernels import _grouped_gemm_configs as C
    from distwgrad.kernels import _grouped_gemm_fp8_configs as CF
    kw = dict(n=768, k=2048, elem_bytes=2, smem_limit=None)
    assert C.pick_wgrad(num_tokens=16384, num_groups=128, accumulate=True, **kw).l2_prefetch
    assert not C.pick_wgrad(num_tokens=16384, num_groups=128, accumulate=False, **kw).l2_prefetch
    assert not C.pick_wgrad(num_tokens=65536, num_groups=64, accumulate=True, **kw).l2_prefetch
    assert not C.pick_wgrad(num_tokens=32768, num_groups=8, accumulate=True, **kw).l2_prefetch
    for block in (0, 128):
        pick = lambda acc, tpg, block=block: CF.pick("wgrad", block=block, accumulate=acc, smem_limit=None,
                                                    tokens_per_group=tpg)
        assert pick(True, 128).l2_prefetch and not pick(False, 128).l2_prefetch
        assert not pick(True, 1024).l2_prefetch and not pick(True, 4096).l2_prefetch
    with pytest.raises(ValueError, match="l2_prefetch needs block_n >= 32"):
        C.TileConfig(64, 16, 32, l2_prefetch=True)


@pytest.mark.parametrize("first", [False, True], ids=["", "first"])
@pytest.mark.parametrize("mode", ["load", "atomic", "tma_add"])
def test_wgrad_l2_prefetch_builds_for_sm90(mode, first):
    """[Note: L2 prefetch of the accumulated tile]: with ``l2_prefetch`` the accumulating wgrad kernel
    (E=64 pick: 128x128x32, 4 warps) issues one ``prefetch.global.L2::evict_last`` per 128-byte line of its
    fp32 tile (128 rows x 4 lines over 128 threads: 4 each) before its first MMA; without it, none. With FIRST
    ([Note: an unwritten accumulator]) the same prefetches (skipped at run time when the flag is set), and the
    accumulating build also has the plain stores of an output that holds nothing yet."""
    triton = pytest.importorskip("triton")
    from distwgrad.kernels import _grouped_wgrad as kw
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from distwgrad.testing.sm90 import specialize
    add = {"load": 1, "atomic": 3, "tma_add": 4}[mode]
    bm, bn, bk = 128, 128, 32
    T, K, N = 65536, 7168, 2048  # the E=64 MoE shape
    counts = {}
    for prefetch in (False, True):
        vals = dict(dy_desc=f"tensordesc<bf16[{bk}, {bm}]>", x_desc=f"tensordesc<bf16[{bk}, {bn}]>",
                    out_desc=f"tensordesc<fp32[1, {bm}, {bn}]>" if add == 4 else None, dy_ptr="*bf16",
                    x_ptr="*bf16", out_ptr="*fp32", offs_ptr="*i32", first_ptr="*i32", T=T, N=N, K=K, stride_dt=N,
                    stride_dn=1,
                    stride_xt=K, stride_xk=1, stride_oe=N * K, stride_on=K, stride_ok=1, stride_o=1)
        consts = dict(ADD_MODE=add, PTR_TABLE=False, USE_TMA=True, UPCAST=False, PRECISION="tf32", BLOCK_M=bm,
                      BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, L2_PREFETCH=prefetch, FIRST=first)
        if add != 4:
            consts["out_desc"] = None
        sig, attrs = specialize(kw._wgrad_kernel, {k: v for k, v in vals.items() if v is not None}, consts, ("T",))
        try:
            kernel = triton.compile(ASTSource(kw._wgrad_kernel, sig, consts, attrs),
                                    target=GPUTarget("cuda", 90, 32),
                                    options=dict(num_warps=4, num_stages=4, enable_fp_fusion=True))
        except RuntimeError as exc:
            if "ptxas" in str(exc) and "not found" in str(exc):
                pytest.skip(f"no ptxas: {exc}")
            raise
        ptx = kernel.asm["ptx"]
        counts[prefetch] = ptx.count("prefetch.global.L2::evict_last")
        if prefetch:
            assert ptx.index("prefetch.global.L2::evict_last") < ptx.index("wgmma.mma_async"), "prefetch after MMAs"
        stores = re.findall(r"\bst\.global[.\w]*", ptx)
        assert bool(stores) is (first or add == 1), stores
    assert counts == {False: 0, True: 4}, counts


@pytest.mark.parametrize("shape", [(16384, 128, 2048, 768), (32768, 8, 4096, 14336)], ids=["e128", "e8"])
@pytest.mark.parametrize("op", ["fprop", "dgrad"])
def test_half_tail_builds_for_sm90(op, shape):
    """[Note: half tail tiles]: the default fprop/dgrad tile (128x256x64, 8 warps, 4 stages) with half tails
    builds for sm_90a with both MMA heights (m64n256k16 for full tiles, m64n128k16 per warpgroup for half
    ones; without half tails only the first), in the same shared memory as the full-height kernel alone
    (the two loops share one ring), and neither spills; with wide tails too ([Note: wide tail tiles]) its
    ring grows by the extra rows' stages and still fits, without spills."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from distwgrad.testing.sm90 import assemble_or_skip, specialize
    k = _kernels()
    w_trans = op == "fprop"
    bm, bn, bk = 128, 256, 64
    T, E, K, N = shape  # two of the MoE shapes, each with the tails its default config has (dgrad swaps K and N)
    if not w_trans:
        K, N = N, K
    built = {}
    for half, wide in ((False, False), (True, False), (True, True)):
        vals = dict(a_desc=f"tensordesc<bf16[{bm}, {bk}]>",
                    w_desc=f"tensordesc<bf16[{bn}, {bk}]>" if w_trans else f"tensordesc<bf16[{bk}, {bn}]>",
                    a_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", offs_ptr="*i32", T=T, E=E, N=N, K=K,
                    W_ROWS=N if w_trans else K, stride_at=K, stride_ak=1, stride_we=N * K,
                    stride_bk=1 if w_trans else N, stride_bn=K if w_trans else 1, stride_ot=N, stride_on=1,
                    stride_be=N, stride_bn_bias=1, stride_o=1)
        consts = dict(W_TRANS=w_trans, HAS_BIAS=False, USE_TMA=True, UPCAST=False, PRECISION=None, BLOCK_M=bm,
                      BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, BLOCK_E=max(16, E), HALF_TAIL=half, WIDE_TAIL=wide,
                      bias_ptr=None)
        if half:
            vals["a_half_desc"] = f"tensordesc<bf16[{bm // 2}, {bk}]>"
        else:
            consts["a_half_desc"] = None
        sig, attrs = specialize(k._ragged_m_kernel, vals, consts, ("T", "E"))
        kernel = triton.compile(ASTSource(k._ragged_m_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=8, num_stages=4, enable_fp_fusion=True))
        ptx = kernel.asm["ptx"]
        info = assemble_or_skip(ptx)
        assert " 0 bytes spill stores" in info, info
        # ptxas serializes the wgmma pipeline when other instructions write an accumulator inside it (C7515):
        # it cost the full tiles 10-15% at E=8 on an H200 when an epilogue refactor triggered it under
        # Triton 3.6. The wide build still has it there ([Note: wide tail tiles]).
        assert wide or "C7515" not in info, info
        shapes = sorted({m.group(1) for m in re.finditer(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)})
        built[half, wide] = (shapes, kernel.metadata.shared)
    plain, halves, wides = built[False, False], built[True, False], built[True, True]
    assert plain[0] == ["m64n256k16"] and halves[0] == wides[0] == ["m64n128k16", "m64n256k16"], built
    assert halves[1] == plain[1] <= 232448, built  # one ring, within Hopper's 227 KB per block
    # [Note: wide tail tiles]: the wide stage adds a [64, 64] x tile to each of the four stages, and the
    # ring still fits (the margin pick_ragged leaves)
    assert wides[1] == plain[1] + 4 * 64 * bk * 2 <= 232448 - 1024 + 32, built
