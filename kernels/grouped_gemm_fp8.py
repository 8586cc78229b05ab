"""FP8 grouped GEMMs for MoE: the three products over ragged token groups, scales applied in the kernel.

Dispatch: the modules reach these kernels on CUDA through ``distwgrad.ops.grouped_gemm_fp8`` ([Note: fp8
gemm dispatch]). dgrad reads the weight N-contiguous (Hopper's fp8 MMA takes B only K-major; the
dispatcher passes that copy). With promotion (per-tensor split accumulator, blockwise), fprop/dgrad of
contractions from 768 run in a persistent warp-specialized Gluon kernel on Hopper that adds each 128-deep
partial while the next step's MMAs run (``_grouped_gemm_fp8_gluon.py``, [Note: promotion under the next
MMA]; the same bits as the Triton kernel); per-tensor wgrad with the split accumulator likewise
(``_grouped_wgrad_fp8_gluon.py``, [Note: fp8 wgrad under the next MMA]). Where the Gluon kernels take over,
their ring depths and tiles: ``GroupedGemmFp8Tuning`` ([Note: kernel tuning] in ``_tuning.py``). The tile
table (``_grouped_gemm_fp8_configs.py``) comes from H200 sweeps. Current speeds: docs/benchmarks.md;
history: docs/benchmarks/LOG.md.

Weights from a sharded gather off the 128-row grid come with per-row ``block=(1, 128)`` scales
(``distwgrad.fp8.weights``): not supported here; the dispatcher emulates those.

Legend: E experts (groups), T tokens, K in-features, N out-features, L the scale block (128).
``offs_E``: int32 END offsets on the device (``grouped_gemm``'s convention: no host sync, clamped into
``[0, T]``, rows at or past ``offs_E[-1]`` of fprop/dgrad outputs left unwritten).

    fprop  y_TN[g]   = deq(x_TK)[g] @ deq(w_ENK[e])^T (+ bias_EN[e])  grouped_fprop_fp8(x_q, w_qs, offs_E, ...)
    dgrad  dx_TK[g]  = deq(dy_TN)[g] @ deq(w_ENK[e])                  grouped_dgrad_fp8(dy_q, w_qs, offs_E, ...)
    wgrad  dW_ENK[e] = deq(dy^T_NT)[:, g] @ deq(x^T_KT)[:, g]^T       grouped_wgrad_fp8(dy_qt, x_qt, offs_E, out)

Operands (``distwgrad.fp8.quantize.Quantized``), one recipe for all operands of a call:
- per-tensor: one fp32 ``scale_inv`` per activation / gradient, one per expert weight ([E]);
- blockwise (DeepSeek-V3): activations and gradients in 1xL tiles along the contraction (x: [T, cdiv(K,
  L)], dy: [T, cdiv(N, L)]; for wgrad the TRANSPOSED quantizations ``dy^T`` [N, T] and ``x^T`` [K, T] that
  ``quantize_rowwise_and_columnwise`` returns, tiles along the tokens), weights in LxL blocks ([E, cdiv(N,
  L), cdiv(K, L)]). dgrad contracts over N, so it reads weight block (nb, kb) for contraction block nb:
  the square blocks make the transposed use exact.
``w_qs`` is a sequence of E per-expert ``Quantized`` ([N, K]; stacked here, one copy) or a tuple
``(w_ENK, scale_inv)`` of a stacked float8 tensor (any strides) and stacked scales ([E] or [E, gn, gk]).

Math: fp8 x fp8 products on the tensor cores (exact in fp32), fp32 accumulation. Blockwise: one K step
per scale block (BLOCK_K = L); each step's dot starts from zero and is added to the fp32 accumulator
times ``a_scale[row, kb] * b_scale[col_block, kb]`` (DeepSeek-V3's promotion every 128 elements, which
also bounds Hopper's limited-precision fp8 accumulation to 128-deep partial sums). Per-tensor: the dot
accumulates directly with ``max_num_imprecise_acc=BLOCK_K`` (the same promotion) and the two scales
multiply once after the loop. wgrad walks each group's tokens in chunks ALIGNED TO THE GLOBAL L GRID,
masking tokens outside the group, so every chunk lies in one token tile (one scale per row) even when a
group starts mid-tile: the module quantizes over the whole token range, and a tile may span two groups.
Outputs: fprop/dgrad in ``out_dtype`` (bf16 default; fp16, fp32); wgrad a fresh ``[E, N, K]`` in ``out_dtype``
(fp32 by default: an fp8 product has no natural output dtype; a module without ``main_grad`` asks for its
parameter's dtype, which the epilogue rounds to from the fp32 accumulator, the bits of the fp32 result cast,
at half or a quarter of its bytes written) or ADDED into fp32 ``out`` (stacked ``[E, N, K]`` or a list of E
``[N, K]``), as ``grouped_wgrad``. An empty group writes zeros to a fresh wgrad and adds nothing to ``out``.
Non-finite scales (the quantizers' NaN policy) propagate: a NaN scale makes the outputs that use it NaN.

Loads: TMA descriptors when layouts allow (16-byte aligned base and outer strides, unit inner stride;
the weight through a 3-D [E, rows, cols] descriptor, so a step never reads the next expert), else masked
pointer loads with any strides. wgrad's partial chunks (group edges) always take the pointer path.

Interpreter (TRITON_INTERPRET=1, CPU tensors; triton 3.9): fp8 loads (plain and TMA) and the fp8 ->
fp32 cast are exact for every finite fp8 value, but its fp8 ``tl.dot`` decodes through fp16 and turns
e5m2 subnormals wrong (2^-16 -> 0, 3 * 2^-16 -> 2^-15; e4m3 is exact), so the kernels upcast fp8
operands to fp32 there (UPCAST, as ``grouped_gemm`` does for bf16); the GPU path feeds fp8 to the tensor
cores. Other interpreter quirks: its fp8 -> fp32 cast maps NaN/inf to finite values (harmless: the
quantizers give a non-finite unit a NaN scale, which the kernels propagate) and fp32 -> bf16 stores
truncate. ``tests/test_grouped_gemm_fp8_kernels.py`` (cases interpreter_fp8_dot, e5m2_subnormals) pins
this down.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import triton
from triton.compiler.errors import CompilationError
from triton.tools.tensor_descriptor import TensorDescriptor

from distwgrad.fp8.quantize import Quantized

from . import _grouped_gemm_fp8_configs as _cfg
from ._context import ensure_context
from ._dispatch import call
from ._grouped_gemm_fp8_checks import _act, _check_ragged, _check_runnable, _check_split, _check_wgrad, _weights
from ._grouped_gemm_fp8_kernels import _fp8_ragged_kernel, _wgrad_fp8_kernel
from ._tuning import current as _tuning
from .grouped_gemm import _device_info, _interpreting, _num_sms, _ptr_table

__all__ = ["grouped_fprop_fp8", "grouped_dgrad_fp8", "grouped_wgrad_fp8"]

_ADD_MODES = {"load": 1, "atomic": 3}  # ADD_MODE values as in grouped_gemm's _wgrad_kernel

# [Note: fp8 wgrad edges]
# A wgrad chunk that straddles a group edge must zero the other group's tokens, in registers (a TMA box
# cannot stop at a group's end, and its innermost offset, here the token, must be 16-byte aligned: [Note:
# fp8 wgrad chunks]).
# The TMA path runs masked head and tail chunks around an unmasked pipelined loop over the full chunks
# (the head and tail run outside the pipeline, each waiting out a full TMA round trip; the arrangements
# that masked every chunk inside one pipelined loop ran slower at every config and shape:
# docs/benchmarks/LOG.md).

# [Note: fp8 wgrad chunks]
# The wgrad contracts each group's tokens in 128-token chunks (the promotion interval, [Note: fp8 split
# accumulator]) on the global 128-token grid and adds the chunks' partial sums in token order, in every
# path of every kernel (the Gluon one: ``_grouped_wgrad_fp8_gluon``), so that they give the same bits (the
# GPU tests compare them; ``_case_wgrad_chunks`` pins the order with sums whose rounding depends on it).
# Why this arrangement and not a 16-token grid or the first chunk last: docs/benchmarks/LOG.md.

# [Note: fp8 split accumulator]
# Hopper's fp8 tensor cores add each 32-deep product into the accumulator with ~13 explicit mantissa
# bits, not fp32's 23 (DeepSeek-V3 report, Sec. 3.3.2). ``split_accumulator=True`` (every default here)
# starts a fresh partial sum every BLOCK_K = 128 products and adds it to an fp32 accumulator
# (``max_num_imprecise_acc=BLOCK_K``): the error stays that of a 128-deep sum. False accumulates the
# whole contraction in the tensor cores (Triton's default for fp8 on sm_90): no second accumulator,
# so wider tiles fit the registers and each step saves an add, at an error that grows with the depth
# (``reference_fp8.hopper_mma_rel``). TransformerEngine's per-tensor recipes make the same trade per
# GEMM (``use_split_accumulator``: False for fprop, True for dgrad and wgrad); our ``PerTensorScaling``
# exposes it as ``fp8_gemm_fprop`` / ``fp8_gemm_dgrad`` / ``fp8_gemm_wgrad`` and keeps True for all
# three by default. The blockwise recipe scales every block's dot before adding it, so it always splits.
# On CPU (interpreter or emulation) products are exact fp32 either way.

_GLUON_FAILED: dict[str, str] = {}  # "ragged", "wgrad" -> why that Gluon kernel did not build here

# ---------------------------------------------------------------------------------------------------
# Launchers: check, allocate, grid, launch
# ---------------------------------------------------------------------------------------------------


def _aligned(t: torch.Tensor, outer_strides: Sequence[int], inner_stride: int) -> bool:
    """TMA-able 1-byte layout: 16-byte aligned base and outer strides, unit inner stride."""
    return t.data_ptr() % 16 == 0 and inner_stride == 1 and all(s % 16 == 0 for s in outer_strides)


def _resolve_tma(requested: bool | None, eligible: bool, device: torch.device, op: str) -> bool:
    """None: TMA iff Hopper or newer and the layouts allow. True: required (tests), else ValueError."""
    if requested is None:
        return eligible and not _interpreting() and _device_info(device)[0] >= 9
    if requested and not eligible:
        raise ValueError(f"{op}: TMA was requested but the layouts do not allow it (16-byte aligned base "
                         f"and outer strides of the fp8 operands, unit inner stride)")
    return requested


def _config(op: str, config, block: int, accumulate: bool, device: torch.device, tokens_per_group: float = 0.0,
            split_acc: bool = True):
    """``config``, else the table's pick for ``op`` ("grouped_fprop_fp8", ...)."""
    if config is None:
        config = _cfg.INTERPRETER if _interpreting() else _cfg.pick(
            op.removeprefix("grouped_").removesuffix("_fp8"), block=block, accumulate=accumulate,
            smem_limit=_device_info(device)[1], tokens_per_group=tokens_per_group, split_accumulator=split_acc)
    config = _cfg.with_block_k(config, block)
    if config.block_k < 32 or config.add_mode not in _cfg.ADD_MODES or config.half_tail or config.wide_tail:
        raise ValueError(f"{op}: fp8 configs need block_k >= 32, add_mode in {_cfg.ADD_MODES} and no half_tail "
                         f"or wide_tail (bf16 fprop/dgrad only), got {config.short()}")
    return config


def _gluon_ragged(a: torch.Tensor, b_EKN: torch.Tensor, block: int, split_acc: bool, tma_k_inner: bool) -> bool:
    """Whether the Gluon kernel can take this fprop / dgrad ([Note: promotion under the next MMA]): a
    Hopper GPU (wgmma is sm_90a only) and a Triton with Gluon, a promoting accumulation (per-tensor split
    or 128-blockwise), TMA-aligned operands with B's contraction innermost, and experts stacked so that B
    is a 2-D ``[E * N, K]`` view. ``_launch_ragged`` takes it when it can, unless the tuning does not want it
    (``GroupedGemmFp8Tuning.ragged_gluon_wanted``: off, or a contraction too short), a config was given, or it
    failed to build here."""
    if not (tma_k_inner and a.is_cuda) or _interpreting():
        return False
    from . import _grouped_gemm_fp8_gluon as kg
    E, _, N = b_EKN.shape
    sb = b_EKN.stride()
    return (kg.AVAILABLE and (block == kg.BLOCK if block else split_acc) and (E <= 1 or sb[0] == N * sb[2])
            and torch.cuda.get_device_capability(a.device)[0] == 9)


def _launch_gluon_ragged(a, a_s, b_EKN, bs_EKN, offs_E, bias_EN, out, block, sas, sbs, sbias) -> bool:
    """Launches the Gluon kernel; False (and one warning) if this Triton cannot build it (Gluon is
    experimental and its API moves between releases): the caller then runs the Triton kernel."""
    ensure_context(a.device)  # [Note: a current context on any thread]
    from . import _grouped_gemm_fp8_gluon as kg
    T, K = a.shape
    E, _, N = b_EKN.shape
    t = _tuning().grouped_gemm_fp8
    L, bm = kg.BLOCK, t.ragged_gluon_block_m
    if "ragged" in _GLUON_FAILED:
        return False
    b2 = b_EKN.as_strided((E * N, K), (b_EKN.stride(2), 1))
    tiles = (triton.cdiv(T, bm) + E) * triton.cdiv(N, L)  # >= the tiles of any split (offsets stay on device)
    try:
        kg.ragged_kernel[(min(tiles, _num_sms(a.device)),)](
            kg.descriptor(a, (bm, L)), kg.descriptor(b2, (L, L)), a_s, bs_EKN, out, bias_EN, offs_E,
            T, E, N, K, N,
            sas[0], sas[1], sbs[0], sbs[1], sbs[2],
            out.stride(0), out.stride(1), sbias[0], sbias[1], offs_E.stride(0),
            BLOCKWISE=block > 0, HAS_BIAS=bias_EN is not None, GROUP_M=8,
            BLOCK_E=max(16, triton.next_power_of_2(E)), NUM_STAGES=t.ragged_gluon_stages, num_warps=bm // 16)
    except CompilationError as exc:
        _GLUON_FAILED["ragged"] = f"{type(exc).__name__}: {exc}"[:2000]
        warnings.warn(f"the Gluon FP8 grouped GEMM kernel does not build with triton {triton.__version__}; "
                      f"using the Triton kernel (same products, slower): {_GLUON_FAILED['ragged'][:400]}",
                      RuntimeWarning, stacklevel=4)
        return False
    return True


def _launch_ragged(a, a_s, b_EKN, bs_EKN, offs_E, bias_EN, out, *, block: int, op: str, config, use_tma,
                   split_acc: bool = True, gluon: bool | None = None):
    """out[g] = a[g] @ b_EKN[e] for every group: a [T, K] fp8, b_EKN [E, K, N] (any strides), the
    contraction K; blockwise scales a_s [T, cdiv(K, L)], bs_EKN [E, cdiv(K, L), cdiv(N, L)]. ``gluon``:
    None picks ([Note: promotion under the next MMA]), True requires the Gluon kernel, False the Triton one."""
    ensure_context(a.device)  # [Note: a current context on any thread]
    T, K = a.shape
    E, _, N = b_EKN.shape
    if T == 0 or N == 0 or E == 0:
        return out
    cfg = _config(op, config, block, False, a.device, T / E, split_acc)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    sb = b_EKN.stride()
    b_k_inner = sb[1] == 1 and sb[2] != 1
    a_ok = K > 0 and _aligned(a, [a.stride(0)], a.stride(1))
    b_ok = _aligned(b_EKN, [sb[0], sb[2]], sb[1]) if b_k_inner else _aligned(b_EKN, [sb[0], sb[1]], sb[2])
    tma = _resolve_tma(use_tma, a_ok and b_ok, a.device, op)
    sas = a_s.stride() if block else (0, 0)
    sbs = bs_EKN.stride() if block else (bs_EKN.stride(0), 0, 0)
    sbias = bias_EN.stride() if bias_EN is not None else (0, 0)
    applies = _gluon_ragged(a, b_EKN, block, split_acc, tma and b_k_inner)
    if gluon and not applies:
        raise ValueError(f"{op}: gluon=True, but the Gluon kernel needs a Hopper GPU, a Triton with Gluon, TMA-aligned "
                         f"operands with the contraction innermost, stacked weights and a promoting accumulation; "
                         f"got block={block}, split_accumulator={split_acc}, tma={tma}, weight strides {tuple(sb)}")
    preferred = _tuning().grouped_gemm_fp8.ragged_gluon_wanted(K, block)
    if gluon or (gluon is None and applies and config is None and preferred):
        if _launch_gluon_ragged(a, a_s, b_EKN, bs_EKN, offs_E, bias_EN, out, block, sas, sbs, sbias):
            return out
        if gluon:
            raise RuntimeError(f"{op}: gluon=True, but the Gluon kernel does not build here: {_GLUON_FAILED}")
    a_desc = b_desc = None
    if tma:
        a_desc = TensorDescriptor(a, [T, K], [a.stride(0), 1], [bm, bk])
        if b_k_inner:
            b_desc = TensorDescriptor(b_EKN, [E, N, K], [sb[0], sb[2], 1], [1, bn, bk])
        else:
            b_desc = TensorDescriptor(b_EKN, [E, K, N], [sb[0], sb[1], 1], [1, bk, bn])
    grid = ((triton.cdiv(T, bm) + E) * triton.cdiv(N, bn),)
    _fp8_ragged_kernel[grid](
        a_desc, b_desc, a, b_EKN, a_s, bs_EKN, out, bias_EN, offs_E,
        T, E, N, K,
        a.stride(0), a.stride(1), sb[0], sb[1], sb[2],
        sas[0], sas[1], sbs[0], sbs[1], sbs[2],
        out.stride(0), out.stride(1), sbias[0], sbias[1], offs_E.stride(0),
        BLOCKWISE=block > 0, B_K_INNER=b_k_inner, HAS_BIAS=bias_EN is not None, USE_TMA=tma,
        UPCAST=_interpreting(), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m,
        BLOCK_E=max(16, triton.next_power_of_2(E)), SPLIT_ACC=split_acc, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out


def _gluon_wgrad(a_NT: torch.Tensor, block: int, split_acc: bool, tma: bool) -> bool:
    """Whether the Gluon wgrad kernel can take this call ([Note: fp8 wgrad under the next MMA]): a Hopper
    GPU and a Triton with Gluon, per-tensor scaling with the split accumulator, TMA-aligned operands."""
    if not (tma and a_NT.is_cuda and block == 0 and split_acc) or _interpreting():
        return False
    from . import _grouped_wgrad_fp8_gluon as kw
    return kw.AVAILABLE and torch.cuda.get_device_capability(a_NT.device)[0] == 9


def _handoff_16(out, accumulate: bool, table) -> bool:
    """Whether the Gluon wgrad hands its tiles off in 16 bits (a fresh bf16 / fp16 stacked output) and so
    has room for ``GroupedGemmFp8Tuning.wgrad_gluon_stages_16`` stages ([Note: a 16-bit handoff])."""
    return not accumulate and table is None and out.dtype != torch.float32


def _launch_gluon_wgrad(a_NT, as_, b_KT, bs, offs_E, out, accumulate: bool, table) -> bool:
    """Launches the Gluon wgrad kernel; False (and one warning) if this Triton cannot build it: the caller
    then runs the Triton kernel."""
    from . import _grouped_wgrad_fp8_gluon_launch as kl
    if "wgrad" in _GLUON_FAILED:
        return False
    try:
        t = _tuning().grouped_gemm_fp8
        kl.launch(a_NT, as_, b_KT, bs, offs_E, out, table, add_mode=_ADD_MODES[t.wgrad_gluon_add_mode] if accumulate
                  else 0, stages=t.wgrad_stages(_handoff_16(out, accumulate, table)),
                  epilogue_warps=t.wgrad_gluon_epilogue_warps, num_sms=_num_sms(a_NT.device))
    except CompilationError as exc:
        _GLUON_FAILED["wgrad"] = f"{type(exc).__name__}: {exc}"[:2000]
        warnings.warn(f"the Gluon FP8 wgrad kernel does not build with triton {triton.__version__}; using the "
                      f"Triton kernel (same products, slower): {_GLUON_FAILED['wgrad'][:400]}",
                      RuntimeWarning, stacklevel=4)
        return False
    return True


def _launch_wgrad(a_NT, as_, b_KT, bs, offs_E, out, *, block: int, accumulate: bool, table, config, use_tma,
                  split_acc: bool = True, gluon: bool | None = None):
    """dW_e for every group into ``out`` ([E, N, K]) or the per-group buffers ``table`` points to.
    ``gluon``: None picks ([Note: fp8 wgrad under the next MMA]: per-tensor, split accumulator, TMA, no
    config given), True requires the Gluon kernel, False the Triton one."""
    ensure_context(a_NT.device)  # [Note: a current context on any thread]
    N, T = a_NT.shape
    K = b_KT.shape[0]
    E = offs_E.shape[0]
    if E == 0 or N == 0 or K == 0:
        return
    if gluon or (gluon is None and _tuning().grouped_gemm_fp8.wgrad_gluon and config is None and use_tma is not False):
        eligible = (T > 0 and _aligned(a_NT, [a_NT.stride(0)], a_NT.stride(1))
                    and _aligned(b_KT, [b_KT.stride(0)], b_KT.stride(1)))
        can = _gluon_wgrad(a_NT, block, split_acc, eligible)
        if gluon and not can:
            raise ValueError("grouped_wgrad_fp8: gluon=True needs a Hopper GPU, a Triton with Gluon, per-tensor "
                             "scaling with the split accumulator and TMA-aligned operands (16-byte aligned base and "
                             f"outer strides, T % 16 == 0); got block={block}, split_accumulator={split_acc}, "
                             f"aligned={eligible}, device={a_NT.device}")
        if can:
            if _launch_gluon_wgrad(a_NT, as_, b_KT, bs, offs_E, out, accumulate, table):
                return
            if gluon:
                raise RuntimeError(f"grouped_wgrad_fp8: gluon=True, but the Gluon kernel does not build here: "
                                   f"{_GLUON_FAILED['wgrad']}")
    cfg = _config("grouped_wgrad_fp8", config, block, accumulate, a_NT.device, tokens_per_group=T / E,
                  split_acc=split_acc)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    eligible = (T > 0 and _aligned(a_NT, [a_NT.stride(0)], a_NT.stride(1))
                and _aligned(b_KT, [b_KT.stride(0)], b_KT.stride(1)))
    tma = _resolve_tma(use_tma, eligible, a_NT.device, "grouped_wgrad_fp8")
    a_desc = b_desc = None
    if tma:
        a_desc = TensorDescriptor(a_NT, [N, T], [a_NT.stride(0), 1], [bm, bk])
        b_desc = TensorDescriptor(b_KT, [K, T], [b_KT.stride(0), 1], [bn, bk])
    so = (0,) + out.stride() if table is not None else out.stride()
    sas = as_.stride() if block else (0, 0)
    sbs = bs.stride() if block else (0, 0)
    grid = (E * triton.cdiv(N, bm) * triton.cdiv(K, bn),)
    _wgrad_fp8_kernel[grid](
        a_desc, b_desc, a_NT, b_KT, as_, bs, out if table is None else table, offs_E,
        T, N, K,
        a_NT.stride(0), a_NT.stride(1), b_KT.stride(0), b_KT.stride(1),
        sas[0], sas[1], sbs[0], sbs[1],
        so[0], so[1], so[2], offs_E.stride(0),
        BLOCKWISE=block > 0, ADD_MODE=_ADD_MODES[cfg.add_mode] if accumulate else 0,
        PTR_TABLE=table is not None, USE_TMA=tma, UPCAST=_interpreting(),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=cfg.group_m, SPLIT_ACC=split_acc, L2_PREFETCH=cfg.l2_prefetch and accumulate and not _interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


# ---- the three products on raw tensors (config and use_tma are for tests and benchmarks) -----------


def _fprop(x, x_s, w, w_s, offs_E, bias_EN, block, out_dtype, *, config=None, use_tma=None, out=None,
           split_accumulator: bool = True, gluon: bool | None = None):
    """``out``: a preallocated [T, N] output in ``out_dtype`` (tests poison it), else a fresh one."""
    _check_ragged("grouped_fprop_fp8", x, x_s, w, w_s, offs_E, block, out_dtype, bias_EN)
    _check_split("grouped_fprop_fp8", block, split_accumulator)
    _check_runnable("grouped_fprop_fp8", x)
    y = torch.empty(x.shape[0], w.shape[1], dtype=out_dtype, device=x.device) if out is None else out
    return _launch_ragged(x, x_s, w.transpose(1, 2), w_s.transpose(1, 2) if block else w_s, offs_E, bias_EN, y,
                          block=block, op="grouped_fprop_fp8", config=config, use_tma=use_tma,
                          split_acc=split_accumulator, gluon=gluon)


def _dgrad(dy, dy_s, w, w_s, offs_E, block, out_dtype, *, config=None, use_tma=None, out=None,
           split_accumulator: bool = True, gluon: bool | None = None):
    _check_ragged("grouped_dgrad_fp8", dy, dy_s, w, w_s, offs_E, block, out_dtype)
    _check_split("grouped_dgrad_fp8", block, split_accumulator)
    _check_runnable("grouped_dgrad_fp8", dy)
    dx = torch.empty(dy.shape[0], w.shape[2], dtype=out_dtype, device=dy.device) if out is None else out
    return _launch_ragged(dy, dy_s, w, w_s, offs_E, None, dx, block=block, op="grouped_dgrad_fp8",
                          config=config, use_tma=use_tma, split_acc=split_accumulator, gluon=gluon)


def _wgrad(dy_t, dy_s, x_t, x_s, offs_E, block, out=None, *, out_dtype: torch.dtype = torch.float32, config=None,
           use_tma=None, split_accumulator: bool = True, gluon: bool | None = None):
    _check_wgrad(dy_t, dy_s, x_t, x_s, offs_E, block, out, out_dtype)
    _check_split("grouped_wgrad_fp8", block, split_accumulator)
    _check_runnable("grouped_wgrad_fp8", dy_t)
    kw = dict(block=block, config=config, use_tma=use_tma, split_acc=split_accumulator, gluon=gluon)
    args = (dy_t, dy_s, x_t, x_s, offs_E)
    if out is None:
        dW = torch.empty(offs_E.shape[0], dy_t.shape[0], x_t.shape[0], dtype=out_dtype, device=dy_t.device)
        _launch_wgrad(*args, dW, accumulate=False, table=None, **kw)
        return dW
    if isinstance(out, torch.Tensor):
        _launch_wgrad(*args, out, accumulate=True, table=None, **kw)
    elif len(out) > 0:
        _launch_wgrad(*args, out[0], accumulate=True, table=_ptr_table(out, dy_t.device), **kw)
    return out


# ---------------------------------------------------------------------------------------------------
# torch.library custom ops (+ fake implementations) and the public API on Quantized operands
# ---------------------------------------------------------------------------------------------------


def _fprop_impl(x: torch.Tensor, x_scale_inv: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                offs_E: torch.Tensor, bias_EN: torch.Tensor | None, block: int, out_dtype: torch.dtype,
                split_accumulator: bool = True) -> torch.Tensor:
    return _fprop(x, x_scale_inv, w, w_scale_inv, offs_E, bias_EN, block, out_dtype,
                  split_accumulator=split_accumulator)


_fprop_op = torch.library.custom_op("distwgrad::grouped_fprop_fp8", _fprop_impl, mutates_args=())


@_fprop_op.register_fake
def _(x, x_scale_inv, w, w_scale_inv, offs_E, bias_EN, block, out_dtype, split_accumulator=True):
    _check_ragged("grouped_fprop_fp8", x, x_scale_inv, w, w_scale_inv, offs_E, block, out_dtype, bias_EN)
    _check_split("grouped_fprop_fp8", block, split_accumulator)
    return x.new_empty(x.shape[0], w.shape[1], dtype=out_dtype)


def _dgrad_impl(dy: torch.Tensor, dy_scale_inv: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                offs_E: torch.Tensor, block: int, out_dtype: torch.dtype,
                split_accumulator: bool = True) -> torch.Tensor:
    return _dgrad(dy, dy_scale_inv, w, w_scale_inv, offs_E, block, out_dtype, split_accumulator=split_accumulator)


_dgrad_op = torch.library.custom_op("distwgrad::grouped_dgrad_fp8", _dgrad_impl, mutates_args=())


@_dgrad_op.register_fake
def _(dy, dy_scale_inv, w, w_scale_inv, offs_E, block, out_dtype, split_accumulator=True):
    _check_ragged("grouped_dgrad_fp8", dy, dy_scale_inv, w, w_scale_inv, offs_E, block, out_dtype)
    _check_split("grouped_dgrad_fp8", block, split_accumulator)
    return dy.new_empty(dy.shape[0], w.shape[2], dtype=out_dtype)


def _wgrad_impl(dy_t: torch.Tensor, dy_t_scale_inv: torch.Tensor, x_t: torch.Tensor, x_t_scale_inv: torch.Tensor,
                offs_E: torch.Tensor, block: int, out_dtype: torch.dtype,
                split_accumulator: bool = True) -> torch.Tensor:
    return _wgrad(dy_t, dy_t_scale_inv, x_t, x_t_scale_inv, offs_E, block, out_dtype=out_dtype,
                  split_accumulator=split_accumulator)


_wgrad_op = torch.library.custom_op("distwgrad::grouped_wgrad_fp8", _wgrad_impl, mutates_args=())


@_wgrad_op.register_fake
def _(dy_t, dy_t_scale_inv, x_t, x_t_scale_inv, offs_E, block, out_dtype, split_accumulator=True):
    _check_wgrad(dy_t, dy_t_scale_inv, x_t, x_t_scale_inv, offs_E, block, None, out_dtype)
    _check_split("grouped_wgrad_fp8", block, split_accumulator)
    return dy_t.new_empty(offs_E.shape[0], dy_t.shape[0], x_t.shape[0], dtype=out_dtype)


def _wgrad_acc_impl(dy_t: torch.Tensor, dy_t_scale_inv: torch.Tensor, x_t: torch.Tensor,
                    x_t_scale_inv: torch.Tensor, offs_E: torch.Tensor, block: int, out: torch.Tensor,
                    split_accumulator: bool = True) -> None:
    _wgrad(dy_t, dy_t_scale_inv, x_t, x_t_scale_inv, offs_E, block, out, split_accumulator=split_accumulator)


_wgrad_acc_op = torch.library.custom_op(
    "distwgrad::grouped_wgrad_fp8_accumulate", _wgrad_acc_impl, mutates_args=("out",))


@_wgrad_acc_op.register_fake
def _(dy_t, dy_t_scale_inv, x_t, x_t_scale_inv, offs_E, block, out, split_accumulator=True):
    _check_wgrad(dy_t, dy_t_scale_inv, x_t, x_t_scale_inv, offs_E, block, out)
    _check_split("grouped_wgrad_fp8", block, split_accumulator)


def _wgrad_acc_list_impl(dy_t: torch.Tensor, dy_t_scale_inv: torch.Tensor, x_t: torch.Tensor,
                         x_t_scale_inv: torch.Tensor, offs_E: torch.Tensor, block: int,
                         out: list[torch.Tensor], split_accumulator: bool = True) -> None:
    _wgrad(dy_t, dy_t_scale_inv, x_t, x_t_scale_inv, offs_E, block, out, split_accumulator=split_accumulator)


_wgrad_acc_list_op = torch.library.custom_op(
    "distwgrad::grouped_wgrad_fp8_accumulate_list", _wgrad_acc_list_impl, mutates_args=("out",))


@_wgrad_acc_list_op.register_fake
def _(dy_t, dy_t_scale_inv, x_t, x_t_scale_inv, offs_E, block, out, split_accumulator=True):
    _check_wgrad(dy_t, dy_t_scale_inv, x_t, x_t_scale_inv, offs_E, block, out)
    _check_split("grouped_wgrad_fp8", block, split_accumulator)


def grouped_fprop_fp8(x_q: Quantized, w_qs, offs_E: torch.Tensor, bias_EN: torch.Tensor | None = None,
                      out_dtype: torch.dtype = torch.bfloat16, *, split_accumulator: bool = True) -> torch.Tensor:
    """``y_TN[g] = deq(x)[g] @ deq(w_e)^T (+ bias_EN[e])`` for the tokens g of every group e.

    Args:
        x_q: ``[T, K]`` fp8, per-tensor or 1xL tiles along K (``quantize_rowwise_and_columnwise(x)[0]``).
        w_qs: E per-expert ``[N, K]`` ``Quantized`` (per-tensor, or LxL blocks with the same L), or a tuple
            ``(w_ENK, scale_inv)`` with scale_inv ``[E]`` or ``[E, cdiv(N, L), cdiv(K, L)]``.
        offs_E: ``[E]`` int32 end offsets on the same device (never read on the host).
        bias_EN: optional ``[E, N]`` bf16/fp16/fp32 bias, added in fp32.
        out_dtype: bf16 (default), fp16 or fp32.
        split_accumulator: promote the tensor cores' partial sums to fp32 every L (128) products
            (default); False lets Hopper accumulate the whole contraction at its reduced fp8 precision
            (faster; per-tensor scaling only). [Note: fp8 split accumulator].

    Returns:
        ``[T, N]`` in ``out_dtype`` (rows at or past ``offs_E[-1]`` unwritten).
    """
    x, x_s, block = _act("grouped_fprop_fp8", "x_q", x_q)
    w, w_s = _weights("grouped_fprop_fp8", w_qs, block)
    _check_ragged("grouped_fprop_fp8", x, x_s, w, w_s, offs_E, block, out_dtype, bias_EN)
    _check_split("grouped_fprop_fp8", block, split_accumulator)
    return call(torch.ops.distwgrad.grouped_fprop_fp8, _fprop_impl, x, x_s, w, w_s, offs_E, bias_EN, block, out_dtype,
                split_accumulator)


def grouped_dgrad_fp8(dy_q: Quantized, w_qs, offs_E: torch.Tensor,
                      out_dtype: torch.dtype = torch.bfloat16, *, split_accumulator: bool = True) -> torch.Tensor:
    """``dx_TK[g] = deq(dy)[g] @ deq(w_e)``; ``dy_q`` ``[T, N]`` per-tensor or 1xL tiles along N, the
    weights as in :func:`grouped_fprop_fp8` (forward layout; block (nb, kb) serves contraction block nb),
    ``split_accumulator`` as there."""
    dy, dy_s, block = _act("grouped_dgrad_fp8", "dy_q", dy_q)
    w, w_s = _weights("grouped_dgrad_fp8", w_qs, block)
    _check_ragged("grouped_dgrad_fp8", dy, dy_s, w, w_s, offs_E, block, out_dtype)
    _check_split("grouped_dgrad_fp8", block, split_accumulator)
    return call(torch.ops.distwgrad.grouped_dgrad_fp8, _dgrad_impl, dy, dy_s, w, w_s, offs_E, block, out_dtype,
                split_accumulator)


def grouped_wgrad_fp8(dy_qt: Quantized, x_qt: Quantized, offs_E: torch.Tensor,
                      out: torch.Tensor | Sequence[torch.Tensor] | None = None, *, split_accumulator: bool = True,
                      out_dtype: torch.dtype | None = None):
    """``dW_e = deq(dy)[g]^T @ deq(x)[g]`` summed over the tokens g of each group e.

    Args:
        dy_qt, x_qt: the TRANSPOSED quantizations ``[N, T]`` and ``[K, T]`` (per-tensor, or 1xL tiles
            along the tokens over the whole token range: ``quantize_rowwise_and_columnwise(...)[1]``).
        offs_E: ``[E]`` int32 end offsets on the same device.
        out: None for a fresh ``[E, N, K]`` in ``out_dtype`` (zeros for an empty group); or fp32 buffers
            to ADD into (``main_grad``): a stacked ``[E, N, K]`` tensor or a list of E ``[N, K]`` tensors
            sharing shape and strides (an empty group adds nothing).
        split_accumulator: as in :func:`grouped_fprop_fp8` (the contraction is each group's tokens).
        out_dtype: a fresh output's dtype: fp32 (None, the default), bf16 or fp16, rounded from the fp32
            accumulator in the epilogue (the bits of the fp32 output cast). Not with ``out``.

    Returns:
        The fresh tensor, or ``out`` itself.
    """
    dy_t, dy_s, block = _act("grouped_wgrad_fp8", "dy_qt", dy_qt)
    x_t, x_s, x_block = _act("grouped_wgrad_fp8", "x_qt", x_qt)
    if x_block != block:
        raise ValueError(f"grouped_wgrad_fp8: dy_qt and x_qt must share one recipe, got blocks {dy_qt.block} "
                         f"and {x_qt.block}")
    if out is not None and out_dtype not in (None, torch.float32):
        raise ValueError(f"grouped_wgrad_fp8: out_dtype={out_dtype} is a fresh output's dtype; an out to add "
                         f"into is fp32 (pass one or the other)")
    out_dtype = torch.float32 if out_dtype is None else out_dtype
    _check_wgrad(dy_t, dy_s, x_t, x_s, offs_E, block, out, out_dtype)
    _check_split("grouped_wgrad_fp8", block, split_accumulator)
    ops, split = torch.ops.distwgrad, split_accumulator
    if out is None:
        return call(ops.grouped_wgrad_fp8, _wgrad_impl, dy_t, dy_s, x_t, x_s, offs_E, block, out_dtype, split)
    if isinstance(out, torch.Tensor):
        call(ops.grouped_wgrad_fp8_accumulate, _wgrad_acc_impl, dy_t, dy_s, x_t, x_s, offs_E, block, out, split,
             mutated=(6,))
    else:
        call(ops.grouped_wgrad_fp8_accumulate_list, _wgrad_acc_list_impl, dy_t, dy_s, x_t, x_s, offs_E, block,
             list(out), split, mutated=(6,))
    return out

