"""Problems and checks shared by the FP8 grouped GEMM tests (``test_grouped_gemm_fp8_*.py``): operands
quantized by the reference, the kernels' launch helpers checked against the oracle's bound ([Note: fp8
grouped gemm error bound]), and the chunk-order problem ([Note: fp8 wgrad chunks]). Not a test module:
the tests import it (pytest puts tests/ on the path; the interpreter child runs from there too).
"""

from __future__ import annotations

import dataclasses
import os
import types

import torch

from distwgrad.fp8.quantize import quantize_blockwise, quantize_per_tensor, quantize_rowwise_and_columnwise
from distwgrad.fp8.recipe import BlockwiseScaling, MMParams, PerTensorScaling, split_accumulator
from distwgrad.testing import reference_fp8 as RF

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = {
    "per_tensor": PerTensorScaling(),
    # no fp32 promotion in any GEMM ([Note: fp8 split accumulator]); the same operands as per_tensor
    "per_tensor_fast": PerTensorScaling(**{f"fp8_gemm_{g}": MMParams(False) for g in ("fprop", "dgrad", "wgrad")}),
    "blockwise": BlockwiseScaling(),
    "blockwise32": BlockwiseScaling(act_block=(1, 32), weight_block=(32, 32), power_of_two=False),
}
SHAPE_TMA = (288, 4, 160, 144)     # T, E, K, N: every fp8 row 16-byte aligned (TMA-able)
SHAPE_ODD = (300, 3, 150, 136)     # K, N, T off the 16-byte grid: masked pointer loads only
WORST: dict[str, float] = {}       # error/bound ratios, printed by the GPU tests


def _kernels():
    """The FP8 grouped GEMMs' launchers and raw products (what the public kernels and custom ops run); the
    custom ops registered."""
    from distwgrad.kernels import _grouped_gemm_fp8_launch, grouped_gemm_fp8  # noqa: F401
    return _grouped_gemm_fp8_launch


def _quantized():
    """The kernels on ``Quantized`` operands (``kernel_grouped_*_fp8``, no emulation fallback)."""
    from distwgrad.ops import grouped_gemm_fp8
    return grouped_gemm_fp8


def _offsets(T: int, E: int, gen: torch.Generator, splits=None) -> torch.Tensor:
    """int32 end offsets: ``splits`` as given, else random with about a third of the groups empty."""
    if splits is None:
        weights = torch.rand(E, generator=gen) * (torch.rand(E, generator=gen) > 0.33)
        if weights.sum() == 0:
            weights[0] = 1.0
        idx = torch.multinomial(weights, T, replacement=True, generator=gen) if T else torch.empty(0).long()
        splits = torch.bincount(idx, minlength=E)
    return torch.as_tensor(splits).cumsum(0).to(torch.int32)


def _rough(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """randn times 2^k, k in [-4, 4] drawn per 32x32 patch: block scales differ from block to block."""
    f = 2.0 ** torch.randint(-4, 5, (-(-rows // 32), -(-cols // 32)), generator=gen).float()
    f = f.repeat_interleave(32, 0)[:rows].repeat_interleave(32, 1)[:, :cols]
    return torch.randn(rows, cols, generator=gen) * f


def _problem(T, E, K, N, recipe: str, *, seed=0, splits=None, device="cpu", offs=None, src=None):
    """Quantized operands of all three products; ``src`` overrides the fp32 sources (x, w, dy)."""
    gen = torch.Generator().manual_seed(seed)
    r = RECIPES[recipe]
    x, w, dy = src if src is not None else (
        _rough(T, K, gen), torch.stack([_rough(N, K, gen) * 0.1 for _ in range(E)]), _rough(T, N, gen))
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    x, w, dy = x.to(device, dt), w.to(device, dt), dy.to(device, dt)
    x_q, x_qt = quantize_rowwise_and_columnwise(x, r)
    dy_q, dy_qt = quantize_rowwise_and_columnwise(dy, r, grad=True)
    if isinstance(r, PerTensorScaling):
        wq = [quantize_per_tensor(w[e], r.fwd_dtype) for e in range(E)]  # one scale per expert
    else:
        wq = [quantize_blockwise(w[e], r.weight_block, r.dtype, power_of_two=r.power_of_two) for e in range(E)]
    offs = _offsets(T, E, gen, splits) if offs is None else offs
    return types.SimpleNamespace(T=T, E=E, K=K, N=N, x_q=x_q, x_qt=x_qt, dy_q=dy_q, dy_qt=dy_qt, wq=wq,
                                 block=0 if x_q.block is None else x_q.block[1], offs=offs.to(device),
                                 device=device, split={g: split_accumulator(r, g) for g in ("fprop", "dgrad", "wgrad")})


def _weight_form(pb, form: str):
    """The weights as the API takes them: "list" of Quantized, "stacked" (data, scales) tuple, or "kn":
    the same values stored [E, K, N] (a transposed copy) and passed as an [E, N, K] view."""
    if form == "list":
        return pb.wq
    data, scales = torch.stack([q.data for q in pb.wq]), torch.stack([q.scale_inv for q in pb.wq])
    if form == "kn":
        data = data.transpose(1, 2).contiguous().transpose(1, 2)
    return data, scales


def _check(what, ours, expected, S, *, depth, out_dtype, device, addend=None, split=True):
    """``split``: the kernel promoted every 128 products (else its imprecise depth is the contraction)."""
    mma_rel = RF.hopper_mma_rel(128 if split else depth) if device == "cuda" else 0.0
    res = RF.check(ours, expected, S, depth=depth, out_dtype=out_dtype, mma_rel=mma_rel, addend=addend)
    assert res["ok"], f"{what}: {res}"
    WORST[what] = res["worst"]


def _run_ragged(op, pb, *, out_dtype=torch.bfloat16, bias=None, form="list", config=None, use_tma=None,
                gluon=None):
    """One fprop or dgrad launch on a NaN-poisoned output, checked against the oracle; ``gluon`` as the
    launchers take it ([Note: promotion under the next MMA])."""
    k = _kernels()
    fprop = op == "fprop"
    a_q, w_in = (pb.x_q if fprop else pb.dy_q), _weight_form(pb, form)
    w, w_s = _quantized()._weights(op, w_in, pb.block)
    rows, depth = (pb.N, pb.K) if fprop else (pb.K, pb.N)
    out = torch.full((pb.T, rows), float("nan"), dtype=out_dtype, device=pb.device)
    kw = dict(config=config, use_tma=use_tma, out=out, split_accumulator=pb.split[op], gluon=gluon)
    if fprop:
        k._fprop(a_q.data, a_q.scale_inv, w, w_s, pb.offs, bias, pb.block, out_dtype, **kw)
        ref = lambda **a: RF.grouped_fprop_fp8(a_q, w_in, pb.offs, bias, **a)
    else:
        k._dgrad(a_q.data, a_q.scale_inv, w, w_s, pb.offs, pb.block, out_dtype, **kw)
        ref = lambda **a: RF.grouped_dgrad_fp8(a_q, w_in, pb.offs, **a)
    n = min(max(int(pb.offs[-1]), 0), pb.T) if pb.E else 0
    tag = (f"{op} T={pb.T} E={pb.E} K={pb.K} N={pb.N} block={pb.block} {form} {out_dtype} tma={use_tma}"
           f"{'' if pb.split[op] else ' no-split'}{'' if gluon is None else f' gluon={gluon}'}")
    _check(tag, out[:n], ref(out_dtype=torch.float32)[:n], ref(absolute=True)[:n], depth=depth,
           out_dtype=out_dtype, device=pb.device, split=pb.split[op])
    assert bool(out[n:].isnan().all()), f"{tag}: rows at or past offs_E[-1] were written"
    return out


def _run_wgrad(pb, mode, *, config=None, use_tma=None, seed=0, gluon=None, out_dtype=torch.float32):
    """wgrad fresh (into a NaN-poisoned fp32 output), accumulating into a stacked tensor, or into a list
    of strided buffers, checked against the oracle (plus the buffers' old values). A fresh ``out_dtype``
    other than fp32 must hold the fp32 output's bits rounded (the epilogue rounds the same accumulator)."""
    k = _kernels()
    raw = (pb.dy_qt.data, pb.dy_qt.scale_inv, pb.x_qt.data, pb.x_qt.scale_inv, pb.offs)
    exp = RF.grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, pb.offs)
    S = RF.grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, pb.offs, absolute=True)
    split = pb.split["wgrad"]
    tag = (f"wgrad_{mode} T={pb.T} E={pb.E} K={pb.K} N={pb.N} block={pb.block} cfg={config} tma={use_tma}"
           f"{'' if split else ' no-split'}")
    m = torch.randn(pb.E, pb.N, pb.K, generator=torch.Generator().manual_seed(seed)).to(pb.device)
    if mode == "fresh":
        got = torch.full((pb.E, pb.N, pb.K), float("nan"), device=pb.device)
        k._launch_wgrad(*raw, got, block=pb.block, accumulate=False, table=None, config=config, use_tma=use_tma,
                        split_acc=split, gluon=gluon)
        addend = None
    elif mode == "acc":
        got = k._wgrad(*raw, pb.block, m.clone(), config=config, use_tma=use_tma, split_accumulator=split,
                       gluon=gluon)
        exp, addend = m.double() + exp.double(), m
    else:  # separate buffers at unrelated addresses, each a strided view (row stride K + 3)
        bufs = [torch.zeros(pb.N, pb.K + 3, device=pb.device)[:, :pb.K] for _ in range(pb.E)]
        for e in range(pb.E):
            bufs[e].copy_(m[e])
        k._wgrad(*raw, pb.block, bufs, config=config, use_tma=use_tma, split_accumulator=split, gluon=gluon)
        got, exp, addend = torch.stack(bufs), m.double() + exp.double(), m
    _check(tag, got, exp, S, depth=pb.T, out_dtype=torch.float32, device=pb.device, addend=addend, split=split)
    if out_dtype != torch.float32:
        assert mode == "fresh", mode
        low = torch.full((pb.E, pb.N, pb.K), float("nan"), dtype=out_dtype, device=pb.device)
        k._launch_wgrad(*raw, low, block=pb.block, accumulate=False, table=None, config=config, use_tma=use_tma,
                        split_acc=split, gluon=gluon)
        assert torch.equal(low, _rounded(got, out_dtype)), f"{tag}: the {out_dtype} output is not the fp32 one rounded"
    return got


def _rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``t`` as a kernel's ``.to(dtype)`` writes it: round to nearest even, except that Triton's
    interpreter converts fp32 to bf16 by truncating the low 16 bits (the GPU tests pin the rounding)."""
    if dtype == torch.bfloat16 and _INTERPRETED:
        return (t.view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return t.to(dtype)


def _cfg(**kw):
    from distwgrad.kernels import _grouped_gemm_fp8_configs as CF
    return dataclasses.replace(CF.INTERPRETER, **kw)


def _chunk_order_problem(device):
    """[Note: fp8 wgrad chunks]: a problem whose result pins the order in which a group's chunk partial sums
    are added. dW[0, 0] of groups 0 ([0, 384)) and 2 ([400, 784), starting mid-chunk) sums exact partials 1
    (the first chunk), 1 (the second), 2^24 (the third: 128 products 512 * 256) and 0 (group 2's fourth);
    in fp32, in token order, (1 + 1) + 2^24 = 2^24 + 2, where any order that adds a 1 to 2^24 first would
    give 2^24 (a 1 is half an ulp there: a tie, to even).
    Group 1 ([384, 400), 16 products 448 * 3 = 21504) shares group 2's first chunk, whose mask must keep
    it out. Returns (the launch's raw arguments, dW[:, 0, 0] expected)."""
    T, N, K = 784, 16, 16
    dy = torch.zeros(N, T)
    x = torch.zeros(K, T)
    for t0 in (0, 400):  # groups 0 and 2: their first token
        c = (t0 // 128) * 128  # their first chunk, on the global grid
        dy[0, t0], x[0, t0] = 1.0, 1.0                                 # first chunk: 1
        dy[0, c + 128], x[0, c + 128] = 1.0, 1.0                       # second chunk: 1
        dy[0, c + 256:c + 384], x[0, c + 256:c + 384] = 512.0, 256.0   # third chunk: 2^24
    dy[0, 384:400], x[0, 384:400] = 448.0, 3.0                         # group 1
    ones = torch.ones((), device=device)
    offs = torch.tensor([384, 400, 784], dtype=torch.int32, device=device)
    raw = (dy.to(torch.float8_e5m2).to(device), ones, x.to(torch.float8_e4m3fn).to(device), ones.clone(), offs)
    return raw, [2.0**24 + 2, 21504.0, 2.0**24 + 2]


def _check_chunk_order(device, **launch):
    """The wgrad adds a group's chunks in token order ([Note: fp8 wgrad chunks])."""
    raw, expected = _chunk_order_problem(device)
    out = torch.full((len(expected), 16, 16), float("nan"), device=device)
    _kernels()._launch_wgrad(*raw, out, block=0, accumulate=False, table=None, config=None, **launch)
    got = out[:, 0, 0].tolist()
    assert got == expected, f"{launch}: dW[:, 0, 0] = {got}, expected {expected} (2^24: not in token order)"
    assert not bool(out.isnan().any()) and bool((out[:, 1:, :] == 0).all()) and bool((out[:, :, 1:] == 0).all())
