"""Tests for the FP8 grouped GEMMs (``distwgrad.kernels.grouped_gemm_fp8``) against the in-package oracle
(``distwgrad.testing.reference_fp8``: dequantize to fp32, one fp32 matmul per group).

CPU: the kernels run under ``TRITON_INTERPRET=1`` in a child process (this file is also its script:
``python tests/test_grouped_gemm_fp8_kernels.py CASE``), as in tests/test_grouped_gemm_kernels.py. The
interpreter's own fp8 ``tl.dot`` mis-decodes e5m2 subnormals, so the kernels upcast fp8 to fp32 there
(case interpreter_fp8_dot checks that path on every finite fp8 value, case e5m2_subnormals that the
kernels take it); it truncates fp32 -> bf16 stores, which the bound's bf16 output rounding (2^-7) covers.

Every comparison uses [Note: fp8 grouped gemm error bound] (elementwise, in float64: twice gamma_n times
sum |a||b|, plus the output rounding; on GPUs also the Hopper accumulation term). Fresh fprop/dgrad/wgrad
outputs are NaN-poisoned first, so an unwritten tile fails, and rows at or past ``offs_E[-1]`` must stay
NaN. Shapes: T <= 300 and K, N <= 160, so 128-blocks and partial blocks both occur; splits are random
(about a third empty) or fixed so that a group starts in the middle of a 128-token tile. Inputs vary in
magnitude by up to 2^+-4 between 32x32 patches, so a wrong tile or block scale is visible. Recipes:
per-tensor (e4m3 x and w, e5m2 gradients, one scale per expert weight) and blockwise (e4m3, 1x128 and
128x128 power-of-two scales; also 1x32/32x32 with exact fp32 scales).

Without a GPU: ``test_compiles_for_sm90`` builds the GPU variants for Hopper (triton ships ptxas) and
checks they run on fp8 wgmma; ``test_bench_*`` run qa/bench/fp8.py's grouped GEMM benchmark (--help, and
end to end in the interpreter: rows, FLOPs, ratios). GPU tests (``-m gpu``) repeat the checks at bf16-sourced
realistic shapes and print the worst error/bound ratios (for the provisional Hopper term of the bound).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import types
import warnings

import pytest
import torch
from distwgrad.kernels import current, tuning

from distwgrad.fp8.quantize import quantize_blockwise, quantize_per_tensor, quantize_rowwise_and_columnwise
from distwgrad.fp8.recipe import BlockwiseScaling, MMParams, PerTensorScaling, split_accumulator
from distwgrad.testing import reference_fp8 as RF
from distwgrad.testing import sweep
from distwgrad.testing.sm90 import assemble_or_skip, specialize
from distwgrad.testing.stubs import StubKernel, record_ragged_dispatch

_HERE = os.path.abspath(__file__)
_ROOT = os.path.dirname(os.path.dirname(_HERE))
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
    from distwgrad.kernels import grouped_gemm_fp8
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
    w, w_s = k._weights(op, w_in, pb.block)
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


# ---- interpreter cases (run in the child process) -------------------------------------------------


def _ragged_cases(recipe: str):
    T, E, K, N = SHAPE_TMA
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(E, N, generator=gen)
    fixed = _problem(T, E, K, N, recipe, splits=[0, 100, 20, 168])       # groups 2, 3 start mid-tile; 2 ends in it
    rand = _problem(T, E, K, N, recipe, seed=2)
    for op in ("fprop", "dgrad"):
        b = bias.bfloat16() if op == "fprop" else None
        _run_ragged(op, fixed, bias=b, form="list", use_tma=True)
        _run_ragged(op, rand, out_dtype=torch.float32, form="stacked", use_tma=False)
        _run_ragged(op, fixed, out_dtype=torch.float16, form="kn", use_tma=True)   # the other B layout
        odd = _problem(*SHAPE_ODD, recipe, seed=3)
        _run_ragged(op, odd, bias=bias[:3, :SHAPE_ODD[3]] if op == "fprop" else None)


def _case_ragged_per_tensor():
    _ragged_cases("per_tensor")


def _case_no_split_accumulator():
    """SPLIT_ACC=False builds and computes the same products (the interpreter's dot is exact fp32 either
    way: this pins the plumbing, the GPU tests the precision); blockwise refuses it by name."""
    pb = _problem(*SHAPE_TMA, "per_tensor_fast", splits=[0, 100, 20, 168])
    for op in ("fprop", "dgrad"):
        _run_ragged(op, pb, use_tma=True, form="stacked")
    _run_wgrad(pb, "acc", use_tma=True)
    _run_wgrad(pb, "fresh", use_tma=False)
    k, bw = _kernels(), _problem(*SHAPE_TMA, "blockwise")
    with pytest.raises(ValueError, match="split_accumulator=False applies to per-tensor scaling only"):
        k.grouped_fprop_fp8(bw.x_q, bw.wq, bw.offs, split_accumulator=False)
    with pytest.raises(TypeError, match="split_accumulator must be a bool"):
        k.grouped_dgrad_fp8(pb.dy_q, pb.wq, pb.offs, split_accumulator=0)


def _case_ragged_blockwise():
    _ragged_cases("blockwise")
    pb = _problem(200, 3, 96, 80, "blockwise32", seed=4)  # more blocks than fit in 160 at L=128
    _run_ragged("fprop", pb, out_dtype=torch.float32)
    _run_ragged("dgrad", pb, out_dtype=torch.float32)
    # Tiles wider than a weight block: the column scales of one tile come from two blocks.
    wide = _problem(*SHAPE_TMA, "blockwise", splits=[0, 100, 20, 168])
    _run_ragged("fprop", wide, out_dtype=torch.float32, config=_cfg(block_m=16, block_n=256))
    _run_ragged("dgrad", wide, out_dtype=torch.float32, config=_cfg(block_m=16, block_n=256), use_tma=True)


def _wgrad_cases(recipe: str):
    fixed = _problem(*SHAPE_TMA, recipe, splits=[0, 100, 20, 168])  # [0, 100), [100, 120), [120, 288): mid-tile starts
    for use_tma, low in ((True, torch.bfloat16), (False, torch.float16)):
        _run_wgrad(fixed, "fresh", use_tma=use_tma, out_dtype=low)
        _run_wgrad(fixed, "acc", use_tma=use_tma, config=_cfg(add_mode="atomic"))
    _run_wgrad(fixed, "acc_list", use_tma=True)
    rand = _problem(*SHAPE_TMA, recipe, seed=5)
    _run_wgrad(rand, "acc", use_tma=True)
    _run_wgrad(rand, "acc_list", use_tma=False, config=_cfg(add_mode="atomic"))
    odd = _problem(*SHAPE_ODD, recipe, splits=[150, 0, 150])      # group 2 starts mid-tile [128, 256)
    _run_wgrad(odd, "fresh")
    _run_wgrad(odd, "acc_list")


def _case_wgrad_per_tensor():
    _wgrad_cases("per_tensor")


def _case_wgrad_blockwise():
    _wgrad_cases("blockwise")
    pb = _problem(200, 3, 96, 80, "blockwise32", splits=[40, 0, 160])
    _run_wgrad(pb, "fresh")
    _run_wgrad(pb, "acc", config=_cfg(block_m=64, block_n=16))


def _case_wgrad_tma_edges():
    """The wgrad kernel's TMA path (masked head and tail chunks around the unmasked ones, [Note: fp8 wgrad
    edges]) gives the oracle's result: mid-tile group starts, an empty group, a group inside one chunk, one
    spanning several, offsets past T."""
    for recipe in ("per_tensor", "blockwise"):
        probs = [_problem(*SHAPE_TMA, recipe, splits=[0, 100, 20, 168]), _problem(*SHAPE_TMA, recipe, seed=7),
                 _problem(*SHAPE_TMA, recipe, offs=torch.tensor([10, 10, 200, 400], dtype=torch.int32))]
        for i, pb in enumerate(probs):
            _run_wgrad(pb, "fresh", use_tma=True)
            _run_wgrad(pb, "acc", use_tma=True, config=_cfg(add_mode="atomic") if i else None)


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


def _case_wgrad_chunks():
    """[Note: fp8 wgrad chunks]: both per-tensor paths (pointer loads; TMA with the masked first and last
    chunks around the unmasked ones) add a group's chunks on the same grid in the same order, and so give
    the same bits on a random problem too."""
    _check_chunk_order("cpu", use_tma=True)
    _check_chunk_order("cpu", use_tma=False)
    pb = _problem(*SHAPE_TMA, "per_tensor", offs=torch.tensor([37, 37, 181, 288], dtype=torch.int32))
    for mode in ("fresh", "acc"):
        assert torch.equal(_run_wgrad(pb, mode, use_tma=True), _run_wgrad(pb, mode, use_tma=False)), \
            f"wgrad {mode}: TMA and pointer loads differ"


def _case_edges():
    k = _kernels()
    T, E, K, N = SHAPE_TMA
    for recipe in ("per_tensor", "blockwise"):
        # clamped offsets (past T) and a last offset short of T (the rows after it stay unwritten)
        pb = _problem(T, E, K, N, recipe, offs=torch.tensor([10, 10, 200, T + 50], dtype=torch.int32))
        _run_ragged("fprop", pb, out_dtype=torch.float32)
        _run_wgrad(pb, "fresh")
        short = _problem(T, E, K, N, recipe, offs=torch.tensor([50, 120, 120, 200], dtype=torch.int32))
        _run_ragged("dgrad", short, out_dtype=torch.float32, use_tma=True)
        one = _problem(64, 1, K, N, recipe, splits=[64])
        _run_ragged("fprop", one, use_tma=True)
        _run_wgrad(one, "acc")
        # no tokens at all; and tokens but every group empty
        for pb in (_problem(0, E, K, N, recipe, splits=[0] * E), _problem(T, E, K, N, recipe, splits=[0] * E)):
            raw = (pb.dy_qt.data, pb.dy_qt.scale_inv, pb.x_qt.data, pb.x_qt.scale_inv, pb.offs, pb.block)
            assert bool((k._wgrad(*raw) == 0).all())
            m = torch.randn(E, N, K)
            assert torch.equal(k._wgrad(*raw, m.clone()), m)
            y = k._fprop(pb.x_q.data, pb.x_q.scale_inv, *k._weights("f", pb.wq, pb.block), pb.offs, None, pb.block,
                         torch.float32)
            assert y.shape == (pb.T, N)
    # strided activation data (row stride K + 16): pointer path, and TMA refused by name
    pb = _problem(T, E, K, N, "blockwise", seed=6)
    wide = torch.zeros(T, K + 16, dtype=pb.x_q.data.dtype)
    wide[:, 3:3 + K] = pb.x_q.data
    pb.x_q = dataclasses.replace(pb.x_q, data=wide[:, 3:3 + K])
    _run_ragged("fprop", pb, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="TMA was requested"):
        _run_ragged("fprop", pb, out_dtype=torch.float32, use_tma=True)


def _case_nan_propagation():
    """A non-finite input poisons its scaling unit (NaN scale, see distwgrad.fp8.quantize); outputs that
    use the unit are NaN exactly where the oracle's are, and an empty group next to it stays zero."""
    T, E, K, N = SHAPE_TMA
    gen = torch.Generator().manual_seed(7)
    x, dy = _rough(T, K, gen), _rough(T, N, gen)
    w = torch.stack([_rough(N, K, gen) for _ in range(E)])
    x[5, 130] = float("inf")        # tile (row 5, K block 1)
    w[1, 140, 3] = float("nan")     # expert 1, block (nb 1, kb 0)
    dy[200, 7] = float("inf")       # token tile [128, 256) of out-feature 7 (wgrad), row 200 (dgrad)
    splits = [100, 0, 100, 88]      # group 1 is empty at token 100, inside tile [0, 128)
    for recipe in ("blockwise", "per_tensor"):
        pb = _problem(T, E, K, N, recipe, splits=splits, src=(x, w, dy))
        y = _run_ragged("fprop", pb, out_dtype=torch.float32, use_tma=True)
        dx = _run_ragged("dgrad", pb, out_dtype=torch.float32)
        dw = _run_wgrad(pb, "fresh", use_tma=True)
        assert bool(y.isnan().any() & dx.isnan().any() & dw.isnan().any())
        assert bool((dw[1] == 0).all()), "an empty group must stay zero next to a NaN tile"
        if recipe == "blockwise":
            assert bool(y[5].isnan().all()) and not bool(y[6].isnan().any())


def _case_interpreter_fp8_dot():
    """What the kernels rely on in the interpreter: fp8 loads, the fp8 -> fp32 cast and an fp32 ``tl.dot``
    are exact for every finite fp8 value (each meets 1.0 in a one-hot product: one nonzero term per
    output, exact in fp32). The interpreter's own fp8 ``tl.dot`` decodes through fp16 and gets e5m2
    subnormals wrong (2^-16 -> 0; triton 3.9), hence the kernels' UPCAST there; e4m3 is exact."""
    import triton
    import triton.language as tl

    @triton.jit
    def dot_kernel(a_ptr, b_ptr, o_ptr, UPCAST: tl.constexpr):
        m, kk = tl.arange(0, 16), tl.arange(0, 256)
        a = tl.load(a_ptr + m[:, None] * 256 + kk[None, :])
        b = tl.load(b_ptr + kk[:, None] * 16 + m[None, :])
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        tl.store(o_ptr + m[:, None] * 16 + m[None, :], tl.dot(a, b))

    for da, db, upcast in ((E4M3, E4M3, True), (E5M2, E5M2, True), (E5M2, E4M3, True), (E4M3, E4M3, False)):
        vals = torch.arange(256, dtype=torch.uint8).view(da).float()
        vals = torch.where(vals.isfinite(), vals, 0.0)
        a = torch.zeros(16, 256)
        a[torch.arange(256) // 16, torch.arange(256)] = vals             # row i holds values 16i..16i+15
        b = torch.zeros(256, 16)
        b[torch.arange(256), torch.arange(256) % 16] = 1.0               # column j picks value 16i + j
        out = torch.empty(16, 16)
        dot_kernel[(1,)](a.to(da), b.to(db), out, UPCAST=upcast)
        assert torch.equal(out.flatten(), vals), f"interpreter dot {da} x {db} upcast={upcast} is not exact"


def _case_e5m2_subnormals():
    """Gradients whose e5m2 values are mostly subnormal (tiny entries next to one large one)."""
    T, E, K, N = SHAPE_TMA
    gen = torch.Generator().manual_seed(10)
    x, w = _rough(T, K, gen), torch.stack([_rough(N, K, gen) for _ in range(E)])
    dy = torch.randn(T, N, generator=gen) * 1e-9
    dy[0, 0] = 1.0
    pb = _problem(T, E, K, N, "per_tensor", src=(x, w, dy), splits=[0, 100, 20, 168])
    sub = pb.dy_q.data.float().abs()
    assert float(((sub > 0) & (sub < 2.0**-14)).float().mean()) > 0.5
    _run_ragged("dgrad", pb, out_dtype=torch.float32, use_tma=True)
    _run_wgrad(pb, "fresh", use_tma=True)


def _case_gluon_fallback():
    """A Triton whose Gluon cannot build the promoting fprop / dgrad kernel: one warning, then the Triton
    kernel (checked against the oracle), no further attempt; ``gluon=True`` then fails by name."""
    import warnings

    from distwgrad.kernels import _grouped_gemm_fp8_gluon as kg
    from triton.compiler.errors import CompilationError
    k = _kernels()

    class _Unbuildable(CompilationError):
        def __init__(self):
            Exception.__init__(self, "no such Gluon API")
            self.message = "no such Gluon API"

    calls = []

    def launch(grid, *a, **kw):
        calls.append(1)
        raise _Unbuildable()
    saved = k._gluon_ragged, kg.ragged_kernel, kg.descriptor, dict(k._GLUON_FAILED)
    k._gluon_ragged = lambda *a: True
    k._GLUON_FAILED.clear()
    kg.ragged_kernel = StubKernel(launch)
    kg.descriptor = lambda t, block_shape: None
    shallow = dict(ragged_gluon_min_depth_per_tensor=0, ragged_gluon_min_depth_blockwise=0)  # the test's too
    try:
        T, E, K, N = SHAPE_TMA
        pb = _problem(T, E, K, N, "per_tensor", seed=5)
        with warnings.catch_warnings(record=True) as caught, tuning(grouped_gemm_fp8=shallow):
            warnings.simplefilter("always")
            for op in ("fprop", "dgrad", "fprop"):
                _run_ragged(op, pb, form="kn" if op == "dgrad" else "stacked", use_tma=True)
        assert len(calls) == 1 and "no such Gluon API" in k._GLUON_FAILED.get("ragged", ""), k._GLUON_FAILED
        assert sum("does not build" in str(w.message) for w in caught) == 1, [str(w.message) for w in caught]
        try:
            _run_ragged("fprop", pb, form="stacked", use_tma=True, gluon=True)
        except RuntimeError as exc:
            assert "gluon=True, but the Gluon kernel does not build here" in str(exc), exc
        else:
            raise AssertionError("gluon=True after a failed build must raise")
    finally:
        k._gluon_ragged, kg.ragged_kernel, kg.descriptor, failed = saved
        k._GLUON_FAILED.clear()
        k._GLUON_FAILED.update(failed)


def _case_custom_ops():
    """Public API through torch.library: opcheck (schema, fake, autograd registration) and compile."""
    k = _kernels()
    for recipe in sweep.sample(("per_tensor", "per_tensor_fast", "blockwise"), 2):  # --full: per_tensor_fast too
        pb = _problem(96, 3, 160, 144, recipe, seed=8)
        sp = () if recipe != "per_tensor_fast" else (False,)  # the schema's default is True
        (w, w_s), b = _weight_form(pb, "stacked"), torch.randn(3, 144)
        x, xs, dy, dys = pb.x_q.data, pb.x_q.scale_inv, pb.dy_q.data, pb.dy_q.scale_inv
        raw_t = (pb.dy_qt.data, pb.dy_qt.scale_inv, pb.x_qt.data, pb.x_qt.scale_inv, pb.offs, pb.block)
        m = torch.randn(3, 144, 160)
        ops = torch.ops.distwgrad
        # Not "test_schema": its SchemaCheckMode compares the inputs before and after with arithmetic that
        # torch does not implement for CPU float8 ("mul_cpu_reduced_float"); mutation and aliasing are
        # covered by the fake-tensor and AOT-dispatch checks, and by the compile comparison below.
        check = lambda op, args: torch.library.opcheck(op, args, test_utils=_OPCHECK_UTILS)
        check(ops.grouped_fprop_fp8.default, (x, xs, w, w_s, pb.offs, b, pb.block, torch.float32, *sp))
        check(ops.grouped_dgrad_fp8.default, (dy, dys, w, w_s, pb.offs, pb.block, torch.bfloat16, *sp))
        check(ops.grouped_wgrad_fp8.default, (*raw_t, torch.float32, *sp))
        check(ops.grouped_wgrad_fp8.default, (*raw_t, torch.bfloat16, *sp))
        check(ops.grouped_wgrad_fp8_accumulate.default, (*raw_t, m.clone(), *sp))
        check(ops.grouped_wgrad_fp8_accumulate_list.default, (*raw_t, list(m.clone()), *sp))

        def step(acc, bufs, pb=pb, b=b):
            y = k.grouped_fprop_fp8(pb.x_q, pb.wq, pb.offs, b, split_accumulator=pb.split["fprop"])
            dx = k.grouped_dgrad_fp8(pb.dy_q, pb.wq, pb.offs, torch.float32, split_accumulator=pb.split["dgrad"])
            kw = dict(split_accumulator=pb.split["wgrad"])
            k.grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, pb.offs, out=acc, **kw)
            k.grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, pb.offs, out=bufs, **kw)
            return (y, dx, k.grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, pb.offs, **kw),
                    k.grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, pb.offs, out_dtype=torch.bfloat16, **kw))

        eager = step(m.clone(), list(m.clone()))
        acc, bufs = m.clone(), list(m.clone())
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(acc, bufs)
        for a, c in zip(eager, compiled):
            torch.testing.assert_close(c, a, rtol=0, atol=0, equal_nan=True)  # same kernels, same inputs
        assert eager[3].dtype == torch.bfloat16 and torch.equal(eager[3], _rounded(eager[2], torch.bfloat16))
        ref_acc = k.grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, pb.offs, out=m.clone())
        torch.testing.assert_close(acc, ref_acc, rtol=0, atol=0)
        torch.testing.assert_close(torch.stack(bufs), ref_acc, rtol=0, atol=0)


_OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")

_INTERPRETER_CASES = {
    "ragged_per_tensor": _case_ragged_per_tensor,
    "ragged_blockwise": _case_ragged_blockwise,
    "wgrad_per_tensor": _case_wgrad_per_tensor,
    "wgrad_blockwise": _case_wgrad_blockwise,
    "no_split_accumulator": _case_no_split_accumulator,
    "edges": _case_edges,
    "wgrad_tma_edges": _case_wgrad_tma_edges,
    "wgrad_chunks": _case_wgrad_chunks,
    "nan_propagation": _case_nan_propagation,
    "custom_ops": _case_custom_ops,
    "gluon_fallback": _case_gluon_fallback,
    "interpreter_fp8_dot": _case_interpreter_fp8_dot,
    "e5m2_subnormals": _case_e5m2_subnormals,
}


def _child_env() -> dict:
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


@pytest.mark.interpret
@pytest.mark.parametrize("case", sorted(_INTERPRETER_CASES))
def test_interpreter(case):
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, _HERE, case], env=_child_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"interpreter case {case} failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"


# ---- the benchmark's bookkeeping -------------------------------------------------------------------


def test_bench_help():
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, os.path.join(_ROOT, "qa", "bench", "fp8.py"), "--help"],
                          env=_child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--gemm-shapes" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.interpret
def test_bench_grouped_gemm_smoke(tmp_path):
    """The benchmark end to end on a tiny shape in the interpreter: rows, FLOPs, ratio columns."""
    pytest.importorskip("triton")
    out = tmp_path / "rows.json"
    cmd = [sys.executable, os.path.join(_ROOT, "qa", "bench", "fp8.py"), "--device", "cpu", "--shape", "64x64",
           "--benchmarks", "grouped_gemm", "--gemm-shapes", "2,64,64,48", "--reps", "1", "--json", str(out)]
    proc = subprocess.run(cmd, env=_child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-6000:]}"
    rows = [r for r in json.loads(out.read_text()) if r["op"].startswith("gg_")]
    impls = {(r["op"], r["impl"]) for r in rows}
    for op in ("fprop", "dgrad", "wgrad", "wgrad_accumulate"):
        for impl in ("bf16", "fp8_per_tensor", "fp8_blockwise"):
            assert (f"gg_{op}", impl) in impls
    assert ("gg_dgrad", "fp8_blockwise_wT") in impls
    bf16_ms = {r["op"]: r["ms"] for r in rows if r["impl"] == "bf16"}
    for r in rows:
        assert r["shape"] == "2,64,64,48"
        assert r["tflops"] == pytest.approx(2 * 64 * 48 * 64 / (r["ms"] * 1e-3) / 1e12, rel=1e-2)
        assert r["vs_bf16"] == pytest.approx(bf16_ms[r["op"]] / r["ms"], rel=1e-2)
        assert r["impl"] == "bf16" or r["worst"] <= 1


@pytest.mark.interpret
def test_bench_gemm_sweep_smoke(tmp_path):
    """``--gemm-sweep`` times every candidate tile config, dgrad on the dispatcher's N-contiguous weight."""
    pytest.importorskip("triton")
    from distwgrad.kernels import _grouped_gemm_fp8_configs as CF
    out = tmp_path / "rows.json"
    cmd = [sys.executable, os.path.join(_ROOT, "qa", "bench", "fp8.py"), "--device", "cpu", "--shape", "64x64",
           "--benchmarks", "grouped_gemm", "--gemm-shapes", "2,64,64,48", "--reps", "1", "--gemm-sweep",
           "--gemm-ops", "wgrad", "dgrad", "--json", str(out)]
    proc = subprocess.run(cmd, env=_child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-6000:]}"
    impls = [r["impl"] for r in json.loads(out.read_text()) if "@" in r["impl"]]
    loads = [c for c in CF.WGRAD_CANDIDATES if c.add_mode == "load"]
    for recipe in ("per_tensor", "blockwise"):
        assert sum(i.startswith(f"fp8_{recipe}@") for i in impls) == len(loads)
        assert sum(i.startswith(f"fp8_{recipe}_wT@") for i in impls) == len(CF.RAGGED_CANDIDATES)


# ---- the GPU build without a GPU: sm_90a compile of the default variants (ptxas ships with triton) -----

_MOE = dict(E=8, T=32768, K=4096, N=14336)


def _sm90_source(op: str, block: int, *, tma: bool, kn: bool = False, add_mode: int = 0, split: bool = True,
                 l2_prefetch: bool = False):
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
                    offs_ptr="*i32", T=T, N=N, K=K, stride_an=T, stride_at=1, stride_bk=T, stride_bt=1,
                    stride_asn=sc(T), stride_asc=1, stride_bsk=sc(T), stride_bsc=1, stride_oe=N * K, stride_on=K,
                    stride_ok=1, stride_o=1,
                    a_desc=f"tensordesc<{grad}[{bm}, {bk}]>", b_desc=f"tensordesc<fp8e4nv[{bn}, {bk}]>")
        consts = dict(BLOCKWISE=block > 0, ADD_MODE=add_mode, PTR_TABLE=False, L2_PREFETCH=l2_prefetch)
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


@pytest.mark.parametrize("variant", [
    "fprop/128/tma", "fprop/0/tma", "fprop/128/ptr", "dgrad/128/tma", "dgrad/0/tma", "dgrad/128/tma/kn",
    "wgrad/128/tma/add3", "wgrad/0/tma/add0", "wgrad/128/ptr/add1",
    "fprop/0/tma/nosplit", "dgrad/0/tma/kn/nosplit", "wgrad/0/tma/add3/nosplit",
    "wgrad/0/tma/add3/l2pf", "wgrad/128/ptr/add3/l2pf",
])
def test_compiles_for_sm90(variant):
    """The GPU path of the default configs compiles for Hopper (sm_90a) and runs its products on fp8
    wgmma (no fallback to mma.sync or an upcast). Registers and spills are in the message, for tuning."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    op, block, load, *rest = variant.split("/")
    add = next((int(r[3:]) for r in rest if r.startswith("add")), 0)
    src, cfg, a_dt = _sm90_source(op, int(block), tma=load == "tma", kn="kn" in rest, add_mode=add,
                                  split="nosplit" not in rest, l2_prefetch="l2pf" in rest)
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
    from distwgrad.kernels import _grouped_gemm_fp8_gluon as kg
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


@pytest.mark.parametrize("variant", ["per_tensor/e4m3", "per_tensor/e5m2", "blockwise/e4m3", "per_tensor/e4m3/64",
                                     "blockwise/e4m3/64"])
def test_gluon_kernel_keeps_the_mma_pipeline(variant):
    """[Note: promotion under the next MMA]: the Gluon kernel (128- and 64-row tiles; warp-specialized,
    persistent, each epilogue after the next tile's step 0) builds for sm_90a with fp8 wgmma, waits for
    all but the newest MMA group in the loop (``wait_group 1``, once per step), and ptxas neither
    serializes the wgmmas (C7514: a non-wgmma instruction reading an in-flight accumulator; C7512:
    registers) nor spills."""
    pytest.importorskip("triton")
    from distwgrad.kernels import _grouped_gemm_fp8_gluon as kg
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


@pytest.mark.parametrize("variant", ["fresh", "load", "atomic", "atomic/table", "fresh/e5m2",
                                     "atomic/s5", "atomic/s5/epi", "fresh/epi/s5", "load/epi",
                                     "atomic/table/epi/s5", "atomic/epi/s5/trace", "dry/epi/s5/trace",
                                     "dry/trace", "dry/epi/s5/trace/unzeroed", "fresh/epi/s5/bf16", "fresh/epi/s5/fp16",
                                     "fresh/epi/s6/bf16",
                                     "fresh/bf16"])
def test_gluon_wgrad_kernel_keeps_the_mma_pipeline(variant):
    """[Note: fp8 wgrad under the next MMA]: the Gluon wgrad kernel builds for sm_90a at the second MoE
    shape with fp8 wgmma, one ``wait_group 1`` per step of the shared promoting loop, no serialized wgmma
    (C7514, C7512) and no spill; the MMA warps fence their zeroing of edge chunks for the async proxy
    ([Note: a group's edge chunks in shared memory]); the epilogue writes 16 bytes per instruction (fp32 reductions
    likewise into a stacked output; 8 elements of a fresh bf16 / fp16 output)."""
    pytest.importorskip("triton")
    from distwgrad.kernels import _grouped_wgrad_fp8_gluon as kw
    if not kw.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    from triton.experimental.gluon import language as gl
    mode, *rest = variant.split("/")
    stages = int(next((r[1:] for r in rest if r.startswith("s")), 4))  # "s5": a ring of 5 stages
    E, T, K, N, L = 64, 65536, 7168, 2048, kw.BLOCK
    a_ty = "fp8e5" if "e5m2" in rest else "fp8e4nv"
    a_lay = gl.NVMMASharedLayout.get_default_for([L, L], gl.float8e5 if "e5m2" in rest else gl.float8e4nv)
    b_lay = gl.NVMMASharedLayout.get_default_for([L, L], gl.float8e4nv)
    vals = dict(a_desc=f"tensordesc<{a_ty}[{L},{L}],{a_lay!r}>", b_desc=f"tensordesc<fp8e4nv[{L},{L}],{b_lay!r}>",
                as_ptr="*fp32", bs_ptr="*fp32", offs_ptr="*i32",
                out_ptr="*i64" if "table" in rest else "*bf16" if "bf16" in rest else "*fp16" if "fp16" in rest
                else "*fp32",
                T=T, E=E, N=N, K=K, stride_oe=N * K, stride_on=K, stride_ok=1, stride_o=1, trace_ptr="*i64",
                TRACE_TILES=435, a_ptr=f"*{a_ty}", b_ptr="*fp8e4nv", stride_at="i32", stride_bt="i32")
    consts = dict(ADD_MODE={"fresh": 0, "load": 1, "atomic": 3, "dry": -1}[mode], PTR_TABLE="table" in rest,
                  GROUP_M=8, NUM_STAGES=stages,
                  EPI_WARPS=2 if "epi" in rest else 0, EPI_ROWS=kw.EPI_ROWS, EPI_REGS=kw.EPI_REGS, num_warps=8,
                  TRACE="trace" in rest, ZERO_EDGES="unzeroed" not in rest, TOKENS_OUTER=False,
                  GROUP_DESC=False, CHAIN=False)
    kernel, ptx, info = _sm90_gluon_build(kw.wgrad_kernel, vals, consts, ("T",))
    a_name = "e5m2" if "e5m2" in rest else "e4m3"
    assert f"wgmma.mma_async.sync.aligned.m64n128k32.f32.{a_name}.e4m3" in ptx, "no fp8 wgmma"
    assert ptx.count("wgmma.wait_group.sync.aligned 1;") == 4, "peeled step + two loop steps + tail step"
    assert "C7514" not in info and "C7512" not in info and "serialized" not in info, info
    assert " 0 bytes spill stores" in info, info
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
        assert not stores and reductions and all((".v4.f32" in r) == wide for r in reductions), (stores, reductions)
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


@pytest.mark.parametrize("variant", ["atomic", "atomic/zero", "atomic/table", "load", "load/zero"])
def test_gluon_wgrad_bf16_kernel_builds(variant):
    """[Note: the bf16 wgrad in the fp8 kernel]: the TOKENS_OUTER build (bf16 dy and x as [tokens, rows]
    stages) for sm_90a at the second MoE shape: bf16 wgmma with both operands read transposed (MN-major),
    no serialized wgmma, no spill, the epilogue
    partition's shared memory; a group's tail rows either left to TMA (per-group descriptors built in the
    kernel, published to the TMA unit through the tensormap proxy fences, no zeroing) or zeroed by the MMA
    warps and fenced for the async proxy ("zero"; [Note: a group's tail zero-filled by TMA]); chained, one
    wait per step and no promotion ([Note: chained bf16 accumulation])."""
    pytest.importorskip("triton")
    from distwgrad.kernels import _grouped_wgrad_fp8_gluon as kw
    if not kw.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    from triton.experimental.gluon import language as gl
    mode, *rest = variant.split("/")
    E, T, K, N = 64, 65536, 7168, 2048
    lay = gl.NVMMASharedLayout.get_default_for([kw.BLOCK_K_16, kw.BLOCK], gl.bfloat16)
    desc = f"tensordesc<bf16[{kw.BLOCK_K_16},{kw.BLOCK}],{lay!r}>"
    vals = dict(a_desc=desc, b_desc=desc, as_ptr="*fp32", bs_ptr="*fp32",
                out_ptr="*i64" if "table" in rest else "*fp32", offs_ptr="*i32",
                T=T, E=E, N=N, K=K,
                stride_oe=N * K, stride_on=K, stride_ok=1, stride_o=1, trace_ptr="*i32", TRACE_TILES=0,
                a_ptr="*bf16", b_ptr="*bf16", stride_at="i32", stride_bt="i32")
    zero = "zero" in rest
    consts = dict(ADD_MODE={"load": 1, "atomic": 3}[mode], PTR_TABLE="table" in rest,
                  GROUP_M=8, NUM_STAGES=5, EPI_WARPS=2, EPI_REGS=kw.EPI_REGS, EPI_ROWS=kw.EPI_ROWS, num_warps=8,
                  TRACE=False, ZERO_EDGES=zero, TOKENS_OUTER=True, GROUP_DESC=not zero, CHAIN=True)
    kernel, ptx, info = _sm90_gluon_build(kw.wgrad_kernel, vals, consts, ("T",))
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16 \{[^}]*\}, [^;]*;", ptx)
    assert mmas and all(m.endswith(", 1, 1, 1, 1;") for m in mmas), "bf16 wgmma, both operands transposed"
    # the peeled step 0 and one step per iteration, then one full wait per tile
    assert ptx.count("wgmma.wait_group.sync.aligned 1;") == 2, "peeled step + the chained loop's step"
    assert "C7514" not in info and "C7512" not in info and "serialized" not in info, info
    assert " 0 bytes spill stores" in info, info
    assert ("fence.proxy.async.shared::cta" in ptx) is zero, "zeroed tail rows fenced, and only when zeroed"
    # a descriptor written in the kernel reaches the TMA unit only through the tensormap proxy's fences
    assert ("fence.proxy.tensormap" in ptx) is not zero, "per-group descriptors published"
    assert (kernel.metadata.global_scratch_size > 0) is not zero, kernel.metadata.global_scratch_size
    # the handed-off tile: 64 KB in fp32
    assert ptx.count(".reqntid 384") == 1 and kernel.metadata.shared >= 5 * 32768 + 65536, kernel.metadata.shared
    assert kernel.metadata.shared <= 232448, kernel.metadata.shared


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

    from distwgrad.kernels import _grouped_gemm_fp8_gluon as kg
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
    from distwgrad.kernels import _grouped_gemm_fp8_gluon as kg
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


def test_gluon_wgrad_only_where_it_applies(monkeypatch):
    """``_gluon_wgrad``: Hopper only, per-tensor with the split accumulator, TMA-aligned operands; never in
    the interpreter or off CUDA."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from distwgrad.kernels import _grouped_wgrad_fp8_gluon as kw
    k = _kernels()
    a, cap = _pretend_hopper(monkeypatch, k)
    assert k._gluon_wgrad(a, 0, True, True) == kw.AVAILABLE
    assert not k._gluon_wgrad(a, 128, True, True)      # blockwise: the Triton kernel
    assert not k._gluon_wgrad(a, 0, False, True)       # no split accumulator
    assert not k._gluon_wgrad(a, 0, True, False)       # not TMA-aligned
    assert not k._gluon_wgrad(SimpleNamespace(is_cuda=False, device="cpu"), 0, True, True)
    cap[0] = (10, 0)
    assert not k._gluon_wgrad(a, 0, True, True)        # Blackwell: no wgmma
    cap[0] = (9, 0)
    monkeypatch.setattr(k, "_interpreting", lambda: True)
    assert not k._gluon_wgrad(a, 0, True, True)


@pytest.mark.parametrize("gluon,config,use_tma,block,expected", [
    (None, None, None, 0, "gluon"), (False, None, None, 0, "triton"), (None, "cfg", None, 0, "triton"),
    (None, None, False, 0, "triton"), (None, None, None, 128, "triton"), (True, None, None, 0, "gluon"),
])
def test_gluon_wgrad_dispatch(monkeypatch, gluon, config, use_tma, block, expected):
    """``_launch_wgrad``: where the Gluon wgrad can run, the default takes it (``wgrad_gluon``) unless a
    config is given, TMA is refused, or ``gluon=False``; blockwise stays on the Triton kernel."""
    pytest.importorskip("triton")
    k = _kernels()
    taken = []
    monkeypatch.setattr(k, "_gluon_wgrad", lambda a, blk, split, tma: blk == 0 and split and tma)
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
    from distwgrad.kernels import _grouped_wgrad_fp8_gluon_launch as kl
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
    """``_grouped_wgrad_fp8_gluon_launch.launch``: min(tiles, SMs) programs; the module's launch choices
    (``GroupedGemmFp8Tuning.wgrad_gluon_*``) and the output form reach the kernel."""
    pytest.importorskip("triton")
    from distwgrad.kernels import _grouped_wgrad_fp8_gluon as kw
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
    assert kws["TRACE"] is False and args[15] == 0  # untraced: no trace buffer, nothing of it built
    assert args[4] is (tbl if table else out)
    strides = args[10:13]
    assert strides == ((0, K, 1) if table else (N * K, K, 1))


def test_gluon_wgrad_trace_launch(monkeypatch):
    """[Note: tracing the MMA warps' tile phases]: ``launch(..., trace=)`` hands the kernel the buffer and
    its tiles per program, and refuses a buffer of another shape, naming both."""
    pytest.importorskip("triton")
    from distwgrad.kernels import _grouped_wgrad_fp8_gluon as kw
    from distwgrad.kernels import _grouped_wgrad_fp8_gluon_launch as kl
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
    assert g == (5,) and args[14] is trace and args[15] == 3 and kws["TRACE"] is True
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


# ---- argument checks (no launch; run in-process) ---------------------------------------------------


def test_checks_name_the_bad_argument():
    pytest.importorskip("triton")
    k = _kernels()
    pb = _problem(64, 2, 160, 144, "blockwise", seed=9)
    pt = _problem(64, 2, 160, 144, "per_tensor", seed=9)
    offs, w = pb.offs, _weight_form(pb, "stacked")
    with pytest.raises(TypeError, match=r"x_q must be a distwgrad.fp8.quantize.Quantized, got Tensor"):
        k.grouped_fprop_fp8(pb.x_q.data, pb.wq, offs)
    with pytest.raises(ValueError, match=r"w_qs\[0\] has block None"):
        k.grouped_fprop_fp8(pb.x_q, pt.wq, offs)
    with pytest.raises(TypeError, match=r"w_qs must be a non-empty sequence"):
        k.grouped_fprop_fp8(pb.x_q, w[0], offs)
    with pytest.raises(ValueError, match=r"w's scale_inv has shape \(2,\), expected \(2, 2, 2\)"):
        k.grouped_fprop_fp8(pb.x_q, (w[0], torch.ones(2)), offs)
    with pytest.raises(TypeError, match=r"x must be float8_e4m3fn or float8_e5m2, got torch.float32"):
        k._fprop(pb.x_q.data.float(), pb.x_q.scale_inv, *w, offs, None, pb.block, torch.bfloat16)
    with pytest.raises(TypeError, match=r"w's scale_inv must be a float32 tensor"):
        k.grouped_fprop_fp8(pb.x_q, (w[0], w[1].double()), offs)
    with pytest.raises(ValueError, match=r"x \(64, 160\) and w \(2, 160, 144\) disagree on the contraction"):
        k.grouped_fprop_fp8(pb.x_q, (w[0].transpose(1, 2), w[1]), offs)
    with pytest.raises(TypeError, match=r"int32 end offsets, got torch.int64"):
        k.grouped_fprop_fp8(pb.x_q, w, offs.long())
    with pytest.raises(ValueError, match=r"offs_E has 3 entries, expected one per group \(2\)"):
        k.grouped_dgrad_fp8(pb.dy_q, w, torch.tensor([1, 2, 64], dtype=torch.int32))
    with pytest.raises(TypeError, match=r"out_dtype must be one of"):
        k.grouped_fprop_fp8(pb.x_q, w, offs, out_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"bias_EN must be a bf16/fp16/fp32 \[E, N\] = \(2, 144\)"):
        k.grouped_fprop_fp8(pb.x_q, w, offs, torch.randn(2, 143))
    with pytest.raises(ValueError, match=r"dy_q must be quantized per tensor or in 1xL tiles"):
        k.grouped_dgrad_fp8(dataclasses.replace(pb.dy_q, block=(128, 128), scale_inv=torch.ones(1, 2)), w, offs)
    with pytest.raises(ValueError, match=r"scale block must be 0 \(per-tensor\) or a power of two >= 32"):
        k.grouped_fprop_fp8(dataclasses.replace(pb.x_q, scale_inv=torch.ones(64, 10), block=(1, 16)), w, offs)
    with pytest.raises(ValueError, match=r"dy_qt and x_qt must share one recipe"):
        k.grouped_wgrad_fp8(pb.dy_qt, pt.x_qt, offs)
    with pytest.raises(ValueError, match=r"disagree on T"):
        k.grouped_wgrad_fp8(pb.dy_qt, pb.x_q, offs)
    with pytest.raises(TypeError, match=r"out must be float32"):
        k.grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, offs, out=torch.zeros(2, 144, 160, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"out must be \[E, N, K\] = \(2, 144, 160\)"):
        k.grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, offs, out=torch.zeros(2, 160, 144))
    with pytest.raises(ValueError, match=r"out has 1 buffers"):
        k.grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, offs, out=[torch.zeros(144, 160)])
    with pytest.raises(ValueError, match=r"out_dtype=torch.bfloat16 is a fresh output's dtype; an out to add"):
        k.grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, offs, out=torch.zeros(2, 144, 160), out_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"grouped_wgrad_fp8: out_dtype must be one of .*got torch.int32"):
        k.grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, offs, out_dtype=torch.int32)
    shared = torch.zeros(144, 160)
    with pytest.raises(ValueError, match=r"share memory"):
        k.grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, offs, out=[shared, shared])
    with pytest.raises(ValueError, match=r"groups overlap"):
        k.grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, offs, out=torch.zeros(144, 160).expand(2, 144, 160))
    with pytest.raises(ValueError, match=r"fp8 configs need block_k >= 32, add_mode in"):
        k._config("grouped_fprop_fp8", _cfg(block_k=16), 0, False, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"fp8 configs need block_k >= 32, add_mode in"):
        k._config("grouped_wgrad_fp8", _cfg(add_mode="prefetch"), 128, True, torch.device("cpu"))
    for tail, short in (("half_tail", "half"), ("wide_tail", "wide")):
        with pytest.raises(ValueError, match=rf"no half_tail or wide_tail \(bf16 fprop/dgrad only\), got "
                                             rf"32x32x32/g2/w1/s1/{short}"):
            k._config("grouped_fprop_fp8", _cfg(**{tail: True}), 0, False, torch.device("cpu"))
    if not _INTERPRETED:
        with pytest.raises(ValueError, match=r"need CUDA tensors \(or TRITON_INTERPRET=1\)"):
            k.grouped_fprop_fp8(pb.x_q, w, offs)


def test_default_picks(monkeypatch):
    """The launchers' default configs are the tuned table's (the launcher names map onto pick's ops):
    accumulating wgrad sends fp32 atomics, per-tensor fprop/dgrad take 256-row tiles only for large groups."""
    pytest.importorskip("triton")
    k = _kernels()
    monkeypatch.setattr(k, "_interpreting", lambda: False)
    cpu = torch.device("cpu")
    acc = k._config("grouped_wgrad_fp8", None, 0, True, cpu)
    assert (acc.block_m, acc.block_n, acc.add_mode) == (64, 128, "atomic")
    assert k._config("grouped_wgrad_fp8", None, 128, False, cpu).add_mode == "load"
    assert k._config("grouped_fprop_fp8", None, 0, False, cpu, 4096.0).block_m == 256
    assert k._config("grouped_dgrad_fp8", None, 0, False, cpu, 128.0).block_m == 128
    assert k._config("grouped_fprop_fp8", None, 128, False, cpu, 4096.0).block_m == 128  # blockwise: spills
    fast = k._config("grouped_dgrad_fp8", None, 0, False, cpu, 4096.0, split_acc=False)  # one accumulator
    assert (fast.block_m, fast.block_n, fast.num_stages) == (128, 256, 3)
    from distwgrad.kernels import _grouped_gemm_fp8_configs as CF
    with pytest.raises(ValueError, match="op must be"):
        CF.pick("grouped_fprop_fp8", block=0, accumulate=False, smem_limit=None)


# ---- GPU (bf16 sources quantized to fp8, realistic shapes) ------------------------------------------

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
    from distwgrad.kernels import _grouped_gemm_fp8_gluon as kg
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
    from distwgrad.kernels import _grouped_wgrad_fp8_gluon as kw
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
@pytest.mark.parametrize("path", ["gluon", "triton", "pointer"])
def test_gpu_wgrad_chunk_order(path):
    """[Note: fp8 wgrad chunks] on the GPU: the Gluon kernel and the Triton kernel's paths add a group's
    chunks in token order (the Hopper fp8 MMA sums these powers of two exactly)."""
    if path == "gluon":
        from distwgrad.kernels import _grouped_wgrad_fp8_gluon as kw
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
    from distwgrad.kernels import _grouped_wgrad_fp8_gluon as kw
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
    k = _kernels()
    T, E, K, N = 2048, 8, 256, 512
    pb = _problem(T, E, K, N, "blockwise", device="cuda", seed=4)
    m = torch.randn(E, N, K, device="cuda")
    bufs = [m[e].clone() for e in range(E)]
    w = _weight_form(pb, "stacked")

    def step():
        return (k.grouped_fprop_fp8(pb.x_q, w, pb.offs), k.grouped_dgrad_fp8(pb.dy_q, w, pb.offs),
                k.grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, pb.offs, out=bufs))
    step()  # warm-up: compile, pointer table
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, dx, _ = step()
    pb.offs.copy_(_offsets(T, E, torch.Generator().manual_seed(99)).cuda())
    for e in range(E):
        bufs[e].copy_(m[e])
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, k.grouped_fprop_fp8(pb.x_q, w, pb.offs), rtol=0, atol=0)
    torch.testing.assert_close(dx, k.grouped_dgrad_fp8(pb.dy_q, w, pb.offs), rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(bufs), k.grouped_wgrad_fp8(pb.dy_qt, pb.x_qt, pb.offs, out=m.clone()),
                               rtol=0, atol=0)


if __name__ == "__main__":  # child process of test_interpreter: TRITON_INTERPRET=1 is set
    assert _INTERPRETED, "run through pytest, or set TRITON_INTERPRET=1"
    _INTERPRETER_CASES[sys.argv[1]]()
    print(f"interpreter case {sys.argv[1]}: ok")
