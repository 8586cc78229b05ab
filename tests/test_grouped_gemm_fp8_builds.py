"""The FP8 grouped GEMMs' GPU builds without a GPU: sm_90a compiles of the default Triton variants and of
the Gluon kernels (Triton ships ptxas), checked for fp8 wgmma, the MMA pipeline ptxas keeps, spills and
shared memory ([Note: promotion under the next MMA], [Note: fp8 wgrad under the next MMA]). Each grid runs a
fixed sample in CI (every build compiles for seconds on two cores) and the rest with ``--full``.
"""

from __future__ import annotations

import re

import pytest
from grouped_gemm_fp8_cases import _kernels

from distwgrad.testing.sm90 import assemble_or_skip, specialize
from distwgrad.testing.sweep import params

_MOE = dict(E=8, T=32768, K=4096, N=14336)


def _sm90_source(op: str, block: int, *, tma: bool, kn: bool = False, add_mode: int = 0, split: bool = True,
                 l2_prefetch: bool = False, first: bool = False):
    """ASTSource of one kernel variant at the first MoE shape with the JIT's specializations (unit strides
    constant, 16-divisible ints and all pointers hinted), as a launch on CUDA tensors would build it."""
    from triton.compiler import ASTSource
    k = _kernels()
    from distwgrad.kernels import _grouped_gemm_fp8_configs as CF
    E, T, K, N = _MOE["E"], _MOE["T"], _MOE["K"], _MOE["N"]
    cfg = CF.pick(op, block=block, accumulate=add_mode > 0, smem_limit=232448,  # H100/H200 opt-in smem
                  tokens_per_group=T / E, split_accumulator=split)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    grad = "fp8e5" if not block else "fp8e4nv"          # per-tensor gradients are e5m2
    sc = lambda n: -(-n // (block or 1)) if block else 16  # scale strides (any value when per-tensor)
    if op == "wgrad":
        fn, nospec = k._wgrad_fp8_kernel, ("T",)
        vals = dict(a_ptr=f"*{grad}", b_ptr="*fp8e4nv", as_ptr="*fp32", bs_ptr="*fp32", out_ptr="*fp32",
                    offs_ptr="*i32", first_ptr="*i32", T=T, N=N, K=K, stride_an=T, stride_at=1, stride_bk=T,
                    stride_bt=1,
                    stride_asn=sc(T), stride_asc=1, stride_bsk=sc(T), stride_bsc=1, stride_oe=N * K, stride_on=K,
                    stride_ok=1, stride_o=1,
                    a_desc=f"tensordesc<{grad}[{bm}, {bk}]>", b_desc=f"tensordesc<fp8e4nv[{bn}, {bk}]>")
        consts = dict(BLOCKWISE=block > 0, ADD_MODE=add_mode, PTR_TABLE=False, L2_PREFETCH=l2_prefetch, FIRST=first)
    else:
        fn, nospec = k._fp8_ragged_kernel, ("T", "E")
        Kc, No = (K, N) if op == "fprop" else (N, K)       # contraction, output features
        kin = op == "fprop" or kn
        sb = (N * K, 1, Kc) if kin else (N * K, No, 1)      # b_EKN strides
        a_dt = "fp8e4nv" if op == "fprop" else grad
        vals = dict(a_ptr=f"*{a_dt}", b_ptr="*fp8e4nv", as_ptr="*fp32", bs_ptr="*fp32", out_ptr="*bf16",
                    bias_ptr="*bf16", offs_ptr="*i32", T=T, E=E, N=No, K=Kc, stride_at=Kc, stride_ak=1,
                    stride_be=sb[0], stride_bk=sb[1], stride_bn=sb[2], stride_ast=sc(Kc), stride_ask=1,
                    stride_bse=sc(N) * sc(K), stride_bsk=1 if op == "fprop" else sc(K),
                    stride_bsn=sc(K) if op == "fprop" else 1, stride_ot=No, stride_on=1, stride_biase=No,
                    stride_biasn=1, stride_o=1, a_desc=f"tensordesc<{a_dt}[{bm}, {bk}]>",
                    b_desc=f"tensordesc<fp8e4nv[1, {bn}, {bk}]>" if kin else f"tensordesc<fp8e4nv[1, {bk}, {bn}]>")
        consts = dict(BLOCKWISE=block > 0, B_K_INNER=kin, HAS_BIAS=op == "fprop", BLOCK_E=16)
    consts.update(USE_TMA=tma, UPCAST=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, SPLIT_ACC=split)
    if not tma:
        consts.update(a_desc=None, b_desc=None)
    if consts.get("HAS_BIAS") is False:
        consts["bias_ptr"] = None
    sig, attrs = specialize(fn, vals, consts, nospec)
    return ASTSource(fn, sig, consts, attrs), cfg, (a_dt if op != "wgrad" else grad)


@pytest.mark.parametrize("variant", params([
    "fprop/128/tma", "fprop/0/tma", "fprop/128/ptr", "dgrad/128/tma", "dgrad/0/tma", "dgrad/128/tma/kn",
    "wgrad/128/tma/add3", "wgrad/0/tma/add0", "wgrad/128/ptr/add1",
    "fprop/0/tma/nosplit", "dgrad/0/tma/kn/nosplit", "wgrad/0/tma/add3/nosplit",
    "wgrad/0/tma/add3/l2pf", "wgrad/128/ptr/add3/l2pf", "wgrad/128/tma/add3/first", "wgrad/0/tma/add1/l2pf/first",
], 6))
def test_compiles_for_sm90(variant):
    """The GPU path of the default configs compiles for Hopper (sm_90a) and runs its products on fp8
    wgmma (no fallback to mma.sync or an upcast). Registers and spills are in the message, for tuning."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    op, block, load, *rest = variant.split("/")
    add = next((int(r[3:]) for r in rest if r.startswith("add")), 0)
    src, cfg, a_dt = _sm90_source(op, int(block), tma=load == "tma", kn="kn" in rest, add_mode=add,
                                  split="nosplit" not in rest, l2_prefetch="l2pf" in rest, first="first" in rest)
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                             enable_fp_fusion=True))
    except RuntimeError as exc:
        if "ptxas" in str(exc) and "not found" in str(exc):
            pytest.skip(f"no ptxas: {exc}")
        raise
    ptx = kernel.asm["ptx"]
    a_ty = {"fp8e4nv": "e4m3", "fp8e5": "e5m2"}[a_dt]
    assert f".f32.{a_ty}.e4m3" in ptx and "wgmma.mma_async" in ptx, f"{variant}: no fp8 wgmma"
    assert "mma.sync" not in ptx, f"{variant}: fell back to mma.sync"
    # [Note: L2 prefetch of the accumulated tile]: one prefetch per 128-byte line of the fp32 tile, before
    # the first MMA, only where asked for
    lines = cfg.block_m * (cfg.block_n // 32) // (32 * cfg.num_warps)
    assert ptx.count("prefetch.global.L2::evict_last") == (lines if "l2pf" in rest else 0), variant
    if "l2pf" in rest:
        assert ptx.index("prefetch.global.L2::evict_last") < ptx.index("wgmma.mma_async"), variant


def _sm90_gluon_ptxas(blockwise: bool, a_dt: str, block_m: int = 128) -> tuple[str, str]:
    """(PTX, ptxas -v messages) of the Gluon promoting kernel for sm_90a at the first MoE shape, tiles of
    ``block_m`` rows (one warpgroup per 64)."""
    from distwgrad.kernels.gluon import grouped_gemm_fp8 as kg
    from triton.experimental.gluon import language as gl
    E, T, K, N = _MOE["E"], _MOE["T"], _MOE["K"], _MOE["N"]
    L = kg.BLOCK
    a_lay = gl.NVMMASharedLayout.get_default_for([block_m, L], getattr(gl, a_dt))
    b_lay = gl.NVMMASharedLayout.get_default_for([L, L], gl.float8e4nv)
    ty = {"float8e4nv": "fp8e4nv", "float8e5": "fp8e5"}
    vals = dict(a_desc=f"tensordesc<{ty[a_dt]}[{block_m},{L}],{a_lay!r}>",
                b_desc=f"tensordesc<fp8e4nv[{L},{L}],{b_lay!r}>",
                as_ptr="*fp32", bs_ptr="*fp32", out_ptr="*bf16", bias_ptr="*bf16", offs_ptr="*i32",
                T=T, E=E, N=N, K=K, W_ROWS=N, stride_ast=K // L, stride_ask=1, stride_bse=(N // L) * (K // L),
                stride_bsk=N // L, stride_bsn=1, stride_ot=N, stride_on=1, stride_biase=N, stride_biasn=1, stride_o=1)
    consts = dict(BLOCKWISE=blockwise, HAS_BIAS=True, GROUP_M=8, BLOCK_E=16, NUM_STAGES=4, num_warps=block_m // 16)
    _, ptx, info = _sm90_gluon_build(kg.ragged_kernel, vals, consts, ("T", "E"))
    return ptx, info


def _sm90_gluon_build(fn, vals: dict, consts: dict, nospec) -> tuple[object, str, str]:
    """(compiled kernel, PTX, ptxas -v messages) of Gluon kernel ``fn`` for sm_90a with ``consts`` (its
    ``num_warps`` among them); skips where this Triton ships no ptxas or one older than the PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig, attrs = specialize(fn, vals, consts, nospec)
    kernel = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=consts["num_warps"], enable_fp_fusion=True))
    return kernel, kernel.asm["ptx"], assemble_or_skip(kernel.asm["ptx"])


@pytest.mark.parametrize("variant", params(["per_tensor/e4m3", "per_tensor/e5m2", "blockwise/e4m3",
                                            "per_tensor/e4m3/64", "blockwise/e4m3/64"], 3))
def test_gluon_kernel_keeps_the_mma_pipeline(variant):
    """[Note: promotion under the next MMA]: the Gluon kernel (128- and 64-row tiles; warp-specialized,
    persistent, each epilogue after the next tile's step 0) builds for sm_90a with fp8 wgmma, waits for
    all but the newest MMA group in the loop (``wait_group 1``, once per step), and ptxas neither
    serializes the wgmmas (C7514: a non-wgmma instruction reading an in-flight accumulator; C7512:
    registers) nor spills."""
    pytest.importorskip("triton")
    from distwgrad.kernels.gluon import grouped_gemm_fp8 as kg
    if not kg.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    recipe, a_ty, *rest = variant.split("/")
    ptx, info = _sm90_gluon_ptxas(recipe == "blockwise", {"e4m3": "float8e4nv", "e5m2": "float8e5"}[a_ty],
                                  64 if "64" in rest else 128)
    assert f"wgmma.mma_async.sync.aligned.m64n128k32.f32.{a_ty}.e4m3" in ptx, "no fp8 wgmma"
    assert ptx.count("wgmma.wait_group.sync.aligned 1;") == 4, "peeled step + two loop steps + tail step"
    # the next tile's step 0 is issued before this tile's stores
    first_mma, first_store = ptx.index("wgmma.mma_async"), ptx.index("st.global")
    assert first_mma < first_store, "the epilogue's stores come before the next tile's first MMA"
    assert "C7514" not in info and "C7512" not in info and "serialized" not in info, info
    assert " 0 bytes spill stores" in info, info
    # the MMA warps get the registers, the TMA warp gives them back
    assert "setmaxnreg.inc.sync.aligned.u32" in ptx and "setmaxnreg.dec.sync.aligned.u32" in ptx
    # [Note: the epilogue's wide stores]: every output store writes 16 bytes (8 bf16 of one row)
    stores = re.findall(r"st\.global[.\w]*", ptx)
    assert stores and all(".v4." in st for st in stores), sorted(set(stores))


@pytest.mark.parametrize("variant", params(["fresh", "load", "atomic", "atomic/table", "fresh/e5m2",
                                            "atomic/s5", "atomic/s5/epi", "fresh/epi/s5", "load/epi",
                                            "atomic/table/epi/s5", "atomic/epi/s5/trace", "dry/epi/s5/trace",
                                            "dry/trace", "dry/epi/s5/trace/unzeroed", "fresh/epi/s5/bf16",
                                            "fresh/epi/s5/fp16", "fresh/epi/s6/bf16",
                                            "fresh/bf16", "atomic/epi/s5/first", "atomic/first", "load/epi/s5/first",
                                            "atomic/epi/s4/blockwise", "fresh/epi/s4/bf16/blockwise",
                                            "atomic/epi/s4/first/blockwise", "load/epi/blockwise",
                                            "atomic/blockwise"], 8))
def test_gluon_wgrad_kernel_keeps_the_mma_pipeline(variant):
    """[Note: fp8 wgrad under the next MMA]: the Gluon wgrad kernel builds for sm_90a at the second MoE
    shape with fp8 wgmma, one ``wait_group 1`` per step of the shared promoting loop, no serialized wgmma
    (C7514, C7512) and no spill (blockwise fresh or load-add-store: a few words); the MMA warps fence their
    zeroing of edge chunks for the async proxy ([Note: a group's edge chunks in shared memory]); the epilogue
    writes 16 bytes per instruction (fp32 reductions
    likewise into a stacked output; 8 elements of a fresh bf16 / fp16 output). With FIRST ([Note: an unwritten
    accumulator]) an accumulating build also stores: the tiles of an output that holds nothing yet."""
    pytest.importorskip("triton")
    from distwgrad.kernels.gluon import grouped_wgrad_fp8 as kw
    if not kw.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    from triton.experimental.gluon import language as gl
    mode, *rest = variant.split("/")
    stages = int(next((r[1:] for r in rest if r.startswith("s")), 4))  # "s5": a ring of 5 stages
    E, T, K, N, L = 64, 65536, 7168, 2048, kw.BLOCK
    a_ty = "fp8e5" if "e5m2" in rest else "fp8e4nv"
    a_lay = gl.NVMMASharedLayout.get_default_for([L, L], gl.float8e5 if "e5m2" in rest else gl.float8e4nv)
    b_lay = gl.NVMMASharedLayout.get_default_for([L, L], gl.float8e4nv)
    out_ty = "*i64" if "table" in rest else "*bf16" if "bf16" in rest else "*fp16" if "fp16" in rest else "*fp32"
    vals = dict(a_desc=f"tensordesc<{a_ty}[{L},{L}],{a_lay!r}>", b_desc=f"tensordesc<fp8e4nv[{L},{L}],{b_lay!r}>",
                T=T, groups=("*i32", 1, E, N, K), output=(out_ty, N * K, K, 1, "*i32"),
                scales=("*fp32", "*fp32", T // L, 1, 1, K), tracing=("*i64", 435))
    consts = dict(ADD_MODE={"fresh": 0, "load": 1, "atomic": 3, "dry": -1}[mode], PTR_TABLE="table" in rest,
                  GROUP_M=8, NUM_STAGES=stages,
                  EPI_WARPS=2 if "epi" in rest else 0, EPI_ROWS=kw.EPI_ROWS, EPI_REGS=kw.EPI_REGS, num_warps=8,
                  TRACE="trace" in rest, ZERO_EDGES="unzeroed" not in rest, FIRST="first" in rest,
                  BLOCKWISE="blockwise" in rest)
    kernel, ptx, info = _sm90_gluon_build(kw.wgrad_kernel, vals, consts, ("T",))
    a_name = "e5m2" if "e5m2" in rest else "e4m3"
    assert f"wgmma.mma_async.sync.aligned.m64n128k32.f32.{a_name}.e4m3" in ptx, "no fp8 wgmma"
    assert ptx.count("wgmma.wait_group.sync.aligned 1;") == 4, "peeled step + two loop steps + tail step"
    # [Note: blockwise wgrad scales]: the TMA warp stages each chunk's column scales by cp.async and the stage's
    # barrier counts their landing; with the epilogue warps, and not loading the tile (the builds whose MMA
    # warps have the registers), in the MMA layout's order: 8-byte copies, each MMA thread's reads 16 bytes
    assert ("cp.async.mbarrier.arrive" in ptx) is ("blockwise" in rest), "column scales not staged"
    mma_order = "blockwise" in rest and "epi" in rest and mode != "load"
    if mma_order:
        assert "cp.async.ca.shared.global" in ptx and "0x8, 0x8;" in ptx, "the column scales' copies are not 8 bytes"
    elif "blockwise" in rest:
        assert "cp.async.cg.shared.global" in ptx and ", 16" in ptx, "the column scales' copies are not 16 bytes"
    if "blockwise" in rest:
        # each step hands its stage back before it reads the column scales (their slot outlives the stage), so
        # the barrier after the MMA wait and the hand-back's barrier are one
        steps = [after.split("wgmma.mma_async")[0] for after in ptx.split("wgmma.wait_group.sync.aligned 1;")[1:]]
        reads = [step for step in steps if "ld.shared" in step]  # the peeled step 0 adds nothing
        assert len(reads) == 3 and all(step.index("mbarrier.arrive") < step.index("ld.shared") for step in reads), \
            "column scales read before the stage is handed back"
        # in the MMA layout's order each MMA thread's 32 column scales are 8 runs of 16 contiguous bytes
        assert not mma_order or all("ld.shared.v4.b32" in step and "ld.shared.v2" not in step for step in reads), \
            "column scales read in pieces under 16 bytes"
    assert "C7514" not in info and "C7512" not in info and "serialized" not in info, info
    spilled = int(re.search(r"(\d+) bytes spill stores", info).group(1))
    # blockwise, fresh or load-add-store: a few words (12-24 bytes a thread with Triton 3.9's ptxas)
    assert spilled <= (32 if "blockwise" in rest and mode != "atomic" else 0), info
    assert "setmaxnreg.inc.sync.aligned.u32" in ptx and "setmaxnreg.dec.sync.aligned.u32" in ptx
    # (a dry run may skip the zeroing: [Note: tracing the MMA warps' tile phases])
    assert ("fence.proxy.async.shared::cta" in ptx) is ("unzeroed" not in rest), "zeroed edge chunk not fenced"
    stores = re.findall(r"\bst\.global[.\w]*", ptx)
    reductions = re.findall(r"\b(?:red|atom)\.global[.\w]*", ptx)
    if "trace" in rest:  # a traced tile's record: five 8-byte stores
        assert stores.count("st.global.b64") == 5, stores
        stores = [st for st in stores if st != "st.global.b64"]
    if mode == "dry":  # a traced dry run: no reductions, and no stores with the MMA warps writing
        assert not reductions and (stores if "epi" in rest else not stores), (stores, reductions)
    elif mode == "atomic":  # a table's bases carry no alignment: one element per reduction there
        wide = "table" not in rest
        assert reductions and all((".v4.f32" in r) == wide for r in reductions), (stores, reductions)
        assert (stores and all(".v4." in st for st in stores)) if "first" in rest else not stores, stores
    else:
        assert stores and all(".v4." in st for st in stores) and not reductions, (stores, reductions)
    if "bf16" in rest or "fp16" in rest:  # rounded in registers: 8 elements per 16-byte store
        assert "cvt.rn.bf16x2.f32" in ptx if "bf16" in rest else "cvt.rn.f16x2.f32" in ptx, "no packed rounding"
    assert "prefetch.global.L2" not in ptx
    assert kernel.metadata.shared <= 232448, kernel.metadata.shared  # Hopper's 227 KB per block
    # [Note: tracing the MMA warps' tile phases]: four clock reads per tile when traced, none otherwise
    assert ptx.count("%clock64") == (4 if "trace" in rest else 0)
    if "epi" in rest:  # [Note: an epilogue partition]: the MMA warps hand each tile over in shared memory
        assert ptx.count(".reqntid 384") == 1, "the epilogue warps share the TMA warp's warpgroup"
        # [Note: a 16-bit handoff]: a fresh bf16 / fp16 tile is handed off rounded, in half the bytes
        out16 = mode == "fresh" and ("bf16" in rest or "fp16" in rest)
        assert kernel.metadata.shared >= stages * 32768 + (32768 if out16 else 65536), kernel.metadata.shared
        # the MMA layout's pairs of columns stored (two fp32, or two 16-bit values in one word), the epilogue
        # warps' 16-byte loads (four fp32, or eight 16-bit values)
        assert ("st.shared.v2.b32" in ptx) is not out16 and "ld.shared.v4.b32" in ptx
