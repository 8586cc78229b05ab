"""Tests for the Triton grouped GEMMs (``distwgrad.kernels.grouped_gemm``) against the in-package oracle.

CPU: the kernels run under ``TRITON_INTERPRET=1`` in a child process (this file is also its script:
``python tests/test_grouped_gemm_kernels.py GROUP``), so the variable never leaks into other test
modules that import Triton. Tiny shapes. The interpreter computes bf16 ``tl.dot`` on bit patterns (the
kernels upcast bf16 to fp32 there) and TRUNCATES fp32 -> bf16 stores (the GPU rounds to nearest), so bf16
goes through the interpreter only where the output is fp32 (accumulating wgrad); bf16 outputs are tested
on the GPU (``@pytest.mark.gpu``).

Every comparison uses the bound in [Note: grouped gemm error bound] (kernels/_grouped_gemm_configs.py):
our error against an fp64 oracle must be <= 2x the torch reference's own error at the same precision plus
a 1e-5 relative floor, in both the Frobenius and the max norm. Fresh outputs are poisoned with NaN first,
so an unwritten tile fails; splits are random and include empty groups.
"""

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch
from distwgrad.kernels import current, tuning

from distwgrad.testing import reference as R
from distwgrad.testing import sweep
from distwgrad.testing.stubs import StubKernel

_HERE = os.path.abspath(__file__)
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _kernels():
    from distwgrad.kernels import grouped_gemm
    return grouped_gemm


def _bound():
    from distwgrad.kernels import _grouped_gemm_configs
    return _grouped_gemm_configs.error_vs_oracle


def _random_offsets(T: int, E: int, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """Random split of T tokens into E groups, about a third of them empty."""
    weights = torch.rand(E, generator=gen) * (torch.rand(E, generator=gen) > 0.33)
    if weights.sum() == 0:
        weights[0] = 1.0
    idx = torch.multinomial(weights, T, replacement=True, generator=gen) if T else torch.empty(0).long()
    splits = torch.bincount(idx, minlength=E)
    return splits.cumsum(0).to(torch.int32).to(device)


def _inputs(T, E, K, N, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)
    return dict(x=r(T, K), w=r(E, N, K), b=r(E, N), dy=r(T, N), m=torch.randn(E, N, K, generator=gen)
                .to(device), offs=_random_offsets(T, E, gen, device))


def _check(what, ours, reference, oracle):
    res = _bound()(ours, reference, oracle)
    assert res["ok"], f"{what}: {res}"


def _poisoned(shape, like):
    return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)


def _check_all_ops(T, E, K, N, dtype, device, *, seed=0, use_tma=None, config=None, bias=True,
                   ops=("fprop", "dgrad", "wgrad", "wgrad_acc", "wgrad_acc_list"), splits=None):
    """Runs the launchers on NaN-poisoned outputs and checks each op against the oracle; ``splits``
    (tokens per group) replaces the random split."""
    k = _kernels()
    d = _inputs(T, E, K, N, dtype, device, seed)
    x, w, dy, offs, m = d["x"], d["w"], d["dy"], d["offs"], d["m"]
    if splits is not None:
        assert len(splits) == E and sum(splits) == T
        offs = torch.tensor(splits).cumsum(0).to(device=device, dtype=torch.int32)
    b = d["b"] if bias else None
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    kw = dict(config=config, use_tma=use_tma)
    tag = f"T={T} E={E} K={K} N={N} {dtype} tma={use_tma}"
    if "fprop" in ops:
        y = k._launch_ragged(x, w, offs, b, _poisoned((T, N), x), w_trans=True, **kw)
        _check(f"fprop {tag}", y, R.grouped_fprop(x, w, offs, b),
               R.grouped_fprop(x64, w64, offs, None if b is None else b.double()))
    if "dgrad" in ops:
        dx = k._launch_ragged(dy, w, offs, None, _poisoned((T, K), x), w_trans=False, **kw)
        _check(f"dgrad {tag}", dx, R.grouped_dgrad(dy, w, offs), R.grouped_dgrad(dy64, w64, offs))
    oracle_dw = R.grouped_wgrad(dy64, x64, offs)
    if "wgrad" in ops:
        dw = _poisoned((E, N, K), x)
        k._launch_wgrad(dy, x, offs, dw, accumulate=False, table=None, **kw)
        _check(f"wgrad {tag}", dw, R.grouped_wgrad(dy, x, offs), oracle_dw)
    if "wgrad_acc" in ops:
        out = k._wgrad(dy, x, offs, out=m.clone(), **kw)
        _check(f"wgrad_acc {tag}", out, R.grouped_wgrad(dy, x, offs, out=m.clone()), m.double() + oracle_dw)
    if "wgrad_acc_list" in ops:
        # separate buffers at unrelated addresses, each a strided view (row stride K + 3)
        bufs = [torch.zeros(N, K + 3, device=device)[:, :K] for _ in range(E)]
        for e in range(E):
            bufs[e].copy_(m[e])
        k._wgrad(dy, x, offs, out=bufs, **kw)
        _check(f"wgrad_acc_list {tag}", torch.stack(bufs), R.grouped_wgrad(dy, x, offs, out=m.clone()),
               m.double() + oracle_dw)


# ---- interpreter cases (run in the child process) -------------------------------------------------


def _case_fprop_dgrad():
    for dtype in (torch.float16, torch.float32):
        for T, E, K, N in ((64, 5, 48, 32), (37, 3, 24, 16)):   # TMA-able: rows 16 B, N % BLOCK_K == 0
            for use_tma in (False, True):
                _check_all_ops(T, E, K, N, dtype, "cpu", seed=T + E, use_tma=use_tma, ops=("fprop", "dgrad"))
        _check_all_ops(50, 4, 45, 33, dtype, "cpu", seed=1, bias=False, ops=("fprop", "dgrad"))  # masked tails


# Tokens per group around BLOCK_M = 32 of the half-tail config: a group's last tile of 1, 16 (half tiles) or
# 17, 32 rows (full ones), groups of one half tile only, and empty groups.
_HALF_TAIL_SPLITS = [0, 16, 17, 33, 48, 49, 0, 64, 1]


def _tail_edges_and_refusals(cfg, field: str, splits: list[int], *, seed: int) -> None:
    """What the half- and wide-tail cases share: ``cfg`` with K, N off the tile (masked pointer loads), the
    config refusing ``field`` on tiles under 32 rows, and the wgrad launcher refusing ``cfg`` by name."""
    from distwgrad.kernels._grouped_gemm_configs import INTERPRETER
    T, E = sum(splits), len(splits)
    _check_all_ops(T, E, 45, 33, torch.float32, "cpu", seed=seed, config=cfg, ops=("fprop", "dgrad"), splits=splits)
    with pytest.raises(ValueError, match=rf"{field} needs block_m >= 32 \(a half tile is a tl.dot of 16 rows"):
        dataclasses.replace(INTERPRETER, **{field: True})
    x, dy, offs = torch.randn(T, 48), torch.randn(T, 32), torch.tensor(splits).cumsum(0).int()
    with pytest.raises(ValueError, match=r"half_tail and wide_tail are for fprop/dgrad \(ragged M\) only, got "
                                         + re.escape(cfg.short())):
        _kernels()._launch_wgrad(dy, x, offs, torch.zeros(E, 32, 48), accumulate=True, table=None, config=cfg,
                                 use_tma=None)


def _case_half_tail():
    """[Note: half tail tiles]: fprop (with bias) and dgrad with ``half_tail`` on the tiles that take it and the
    ones that don't, TMA and pointer loads, against the oracle (NaN-poisoned outputs); the launchers refuse
    it where it does not apply."""
    from distwgrad.kernels._grouped_gemm_configs import INTERPRETER
    cfg = dataclasses.replace(INTERPRETER, block_m=32, half_tail=True)
    T, E = sum(_HALF_TAIL_SPLITS), len(_HALF_TAIL_SPLITS)
    for dtype in (torch.float16, torch.float32):
        for use_tma in (False, True):
            _check_all_ops(T, E, 48, 32, dtype, "cpu", seed=21, use_tma=use_tma, config=cfg, ops=("fprop", "dgrad"),
                           splits=_HALF_TAIL_SPLITS)
    _tail_edges_and_refusals(cfg, "half_tail", _HALF_TAIL_SPLITS, seed=22)


# Tokens per group around BLOCK_M = 32 of the wide-tail config: one tile of 1, 16 (half) or 17, 32 rows, a
# tile that absorbed a remainder of 1 or 16 (33, 48 rows), two tiles (49 = 32 + 17, 64), two with the last
# wide (80 = 32 + 48, 65 = 32 + 33), and empty groups.
_WIDE_TAIL_SPLITS = [0, 33, 48, 16, 49, 0, 80, 1, 65, 64, 17, 32]


def _case_wide_tail():
    """[Note: wide tail tiles]: fprop (with bias) and dgrad with ``wide_tail`` (alone and with ``half_tail``), TMA
    and pointer loads, against the oracle (NaN-poisoned outputs); the launchers refuse it where it does not
    apply."""
    from distwgrad.kernels._grouped_gemm_configs import INTERPRETER
    T, E = sum(_WIDE_TAIL_SPLITS), len(_WIDE_TAIL_SPLITS)
    for half in (False, True):
        cfg = dataclasses.replace(INTERPRETER, block_m=32, wide_tail=True, half_tail=half)
        for use_tma in (False, True):
            _check_all_ops(T, E, 48, 32, torch.float16, "cpu", seed=31, use_tma=use_tma, config=cfg,
                           ops=("fprop", "dgrad"), splits=_WIDE_TAIL_SPLITS)
    _tail_edges_and_refusals(cfg, "wide_tail", _WIDE_TAIL_SPLITS, seed=32)


def _case_wgrad():
    for dtype in (torch.float16, torch.float32):
        for use_tma in (False, True):
            _check_all_ops(64, 5, 48, 40, dtype, "cpu", seed=7, use_tma=use_tma,
                           ops=("wgrad", "wgrad_acc", "wgrad_acc_list"))
        _check_all_ops(50, 4, 45, 33, dtype, "cpu", seed=8, ops=("wgrad", "wgrad_acc", "wgrad_acc_list"))
    # the ways of adding into fp32 out ("tma_add" runs as "atomic" in the interpreter)
    from distwgrad.kernels._grouped_gemm_configs import INTERPRETER
    for mode in ("prefetch", "atomic", "tma_add"):
        cfg = dataclasses.replace(INTERPRETER, add_mode=mode)
        for use_tma in (False, True):
            _check_all_ops(64, 5, 48, 40, torch.float32, "cpu", seed=12, use_tma=use_tma, config=cfg,
                           ops=("wgrad_acc", "wgrad_acc_list"))
    # bf16 operands, fp32 outputs only (see the module docstring)
    _check_all_ops(64, 5, 48, 40, torch.bfloat16, "cpu", seed=9, ops=("wgrad_acc", "wgrad_acc_list"))
    _check_all_ops(61, 3, 32, 24, torch.bfloat16, "cpu", seed=10, use_tma=True, ops=("wgrad_acc",))


def _persistent_configs():
    """Persistent variants of the interpreter config: 4 programs (the interpreter's SM count) x 1 or 2,
    each add mode ("tma_add" runs as "atomic" here; "load" also covers the fresh output), both
    epilogue widths, and the warp-specialized loop where this Triton has it."""
    from distwgrad.kernels._grouped_gemm_configs import INTERPRETER
    ws = _kernels()._RANGE_WARP_SPECIALIZE
    return [dataclasses.replace(INTERPRETER, persistent=p, add_mode=mode, subtile=sub, warp_specialize=w)
            for p, mode, sub, w in ((1, "atomic", 1, False), (2, "tma_add", 2, False), (1, "load", 2, False),
                                    (1, "load", 1, ws), (2, "atomic", 2, ws))]


def _case_wgrad_persistent():
    """Tiles per program > 1, so programs cross group boundaries; empty groups in the random splits."""
    ops = ("wgrad", "wgrad_acc", "wgrad_acc_list")
    for i, cfg in sweep.sample(list(enumerate(_persistent_configs())), 3, seed=0):  # --full: all five
        for dtype in (torch.float16, torch.float32):
            for use_tma in (False, True):     # 5 groups x 9 tiles over 4 or 8 programs
                _check_all_ops(64, 5, 48, 40, dtype, "cpu", seed=20 + i, use_tma=use_tma, config=cfg, ops=ops)
        _check_all_ops(50, 4, 45, 33, torch.float32, "cpu", seed=30 + i, config=cfg, ops=ops)  # off the grid


def _case_wgrad_persistent_splits():
    """Edge splits: E=1, all tokens in one group, no tokens at all, many one-tile groups (E=37 over 4
    or 8 programs), bf16 operands into fp32."""
    ops = ("wgrad", "wgrad_acc", "wgrad_acc_list")
    for i, cfg in sweep.sample(list(enumerate(_persistent_configs())), 3, seed=5):  # --full: all five
        _check_all_ops(37, 1, 40, 24, torch.float32, "cpu", seed=40 + i, config=cfg, ops=ops)
        _check_all_ops(33, 4, 48, 40, torch.float16, "cpu", seed=41 + i, use_tma=True, config=cfg, ops=ops,
                       splits=[0, 0, 33, 0])
        _check_all_ops(0, 3, 24, 16, torch.float32, "cpu", seed=42 + i, config=cfg, ops=ops, splits=[0, 0, 0])
        _check_all_ops(90, 37, 16, 16, torch.float16, "cpu", seed=43 + i, config=cfg, ops=ops)
        _check_all_ops(61, 3, 32, 24, torch.bfloat16, "cpu", seed=44 + i, use_tma=True, config=cfg,
                       ops=("wgrad_acc", "wgrad_acc_list"))
    # the config checks
    from distwgrad.kernels._grouped_gemm_configs import INTERPRETER
    for bad in (dict(persistent=-1), dict(persistent=1, subtile=3), dict(subtile=2), dict(warp_specialize=True),
                dict(persistent=1, add_mode="prefetch")):
        with pytest.raises(ValueError, match="TileConfig"):
            dataclasses.replace(INTERPRETER, **bad)
    with pytest.raises(ValueError, match="persistent configs are for wgrad only"):
        _check_all_ops(16, 2, 16, 16, torch.float32, "cpu", config=_persistent_configs()[0], ops=("fprop",))


def _case_e256():
    _check_all_ops(40, 256, 16, 24, torch.float16, "cpu", seed=11)


def _case_layouts_and_offsets():
    k = _kernels()
    gen = torch.Generator().manual_seed(3)
    T, E, K, N = 48, 3, 32, 24
    x = torch.randn(T, K + 8, generator=gen)[:, 4:4 + K]              # row stride K + 8
    w = torch.randn(E, N + 8, K, generator=gen)[:, :N]                # stride_e != N * stride_n
    wt = torch.randn(E, K, N, generator=gen).transpose(1, 2)          # stride_k != 1
    offs = torch.tensor([10, 10, T], dtype=torch.int32)
    for ww in (w, wt):
        _check("fprop strided", k._fprop(x, ww, offs), R.grouped_fprop(x, ww, offs),
               R.grouped_fprop(x.double(), ww.double(), offs))
        dy = torch.randn(T, N, generator=gen)
        _check("dgrad strided", k._dgrad(dy, ww, offs), R.grouped_dgrad(dy, ww, offs),
               R.grouped_dgrad(dy.double(), ww.double(), offs))
    with pytest.raises(ValueError, match="TMA was requested"):
        k._fprop(x, wt, offs, use_tma=True)
    # Offsets past T are clamped: no stray access, and the last group ends at T.
    bad = torch.tensor([10, 10, T + 50], dtype=torch.int32)
    _check("fprop clamped offsets", k._fprop(x, w, bad), R.grouped_fprop(x, w, offs),
           R.grouped_fprop(x.double(), w.double(), offs))
    # T == 0 and a group count of one
    assert k._fprop(x[:0], w, torch.zeros(E, dtype=torch.int32)).shape == (0, N)
    zero = k._wgrad(torch.randn(0, N), x[:0], torch.zeros(E, dtype=torch.int32))
    assert zero.shape == (E, N, K) and bool((zero == 0).all())
    one = torch.tensor([T], dtype=torch.int32)
    _check("fprop E=1", k._fprop(x, w[:1], one), R.grouped_fprop(x, w[:1], one),
           R.grouped_fprop(x.double(), w[:1].double(), one))


def _case_custom_ops():
    """Public API through torch.library: opcheck (schema, fake, autograd registration) and compile."""
    k = _kernels()
    d = _inputs(32, 3, 16, 24, torch.float32, "cpu", seed=5)
    x, w, b, dy, offs, m = d["x"], d["w"], d["b"], d["dy"], d["offs"], d["m"]
    ops = torch.ops.distwgrad
    torch.library.opcheck(ops.grouped_fprop.default, (x, w, offs, b))
    torch.library.opcheck(ops.grouped_dgrad.default, (dy, w, offs))
    torch.library.opcheck(ops.grouped_wgrad.default, (dy, x, offs))
    torch.library.opcheck(ops.grouped_wgrad_accumulate.default, (dy, x, offs, m.clone()))
    torch.library.opcheck(ops.grouped_wgrad_accumulate_list.default, (dy, x, offs, list(m.clone())))

    def step(x, w, b, dy, offs, acc, bufs):
        y = k.grouped_fprop(x, w, offs, b)
        dx = k.grouped_dgrad(dy, w, offs)
        k.grouped_wgrad(dy, x, offs, out=acc)
        k.grouped_wgrad(dy, x, offs, out=bufs)
        return y, dx, k.grouped_wgrad(dy, x, offs)

    eager = step(x, w, b, dy, offs, m.clone(), list(m.clone()))
    acc, bufs = m.clone(), list(m.clone())
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(x, w, b, dy, offs, acc, bufs)
    for a, c in zip(eager, compiled):
        torch.testing.assert_close(c, a, rtol=0, atol=0)  # same kernels, same inputs: bit-exact
    ref_acc = k.grouped_wgrad(dy, x, offs, out=m.clone())
    torch.testing.assert_close(acc, ref_acc, rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(bufs), ref_acc, rtol=0, atol=0)
    # [Note: custom op bypass]: eager calls run the implementation directly, with the same bits as the op
    # and the op's version-counter bump of the buffer it adds into; under FakeTensorMode the op runs.
    from distwgrad.kernels._dispatch import direct_call_ok
    from torch._subclasses.fake_tensor import FakeTensorMode
    assert direct_call_ok((x, w, offs, [m]))
    torch.testing.assert_close(k.grouped_fprop(x, w, offs, b), ops.grouped_fprop(x, w, offs, b), rtol=0, atol=0)
    via_op = m.clone()
    ops.grouped_wgrad_accumulate(dy, x, offs, via_op)
    direct, bufs = m.clone(), list(m.clone())
    versions = direct._version, [t._version for t in bufs]
    k.grouped_wgrad(dy, x, offs, out=direct)
    k.grouped_wgrad(dy, x, offs, out=bufs)
    torch.testing.assert_close(direct, via_op, rtol=0, atol=0)
    assert direct._version > versions[0] and all(t._version > v for t, v in zip(bufs, versions[1]))
    with FakeTensorMode() as mode:
        fx, fw, foffs = (mode.from_tensor(t) for t in (x, w, offs))
        assert not direct_call_ok((fx,))
        assert k.grouped_fprop(fx, fw, foffs).shape == (x.shape[0], w.shape[1])


_INTERPRETER_CASES = {
    "fprop_dgrad": _case_fprop_dgrad,
    "half_tail": _case_half_tail,
    "wide_tail": _case_wide_tail,
    "wgrad": _case_wgrad,
    "wgrad_persistent": _case_wgrad_persistent,
    "wgrad_persistent_splits": _case_wgrad_persistent_splits,
    "e256": _case_e256,
    "layouts_and_offsets": _case_layouts_and_offsets,
    "custom_ops": _case_custom_ops,
}


@pytest.mark.interpret
@pytest.mark.parametrize("case", sorted(_INTERPRETER_CASES))
def test_interpreter(case):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, _HERE, case], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"interpreter case {case} failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"


# ---- argument checks (no launch; run in-process) ---------------------------------------------------


def test_checks_name_the_bad_argument():
    pytest.importorskip("triton")
    k = _kernels()
    x, w, offs = torch.randn(8, 16), torch.randn(2, 24, 16), torch.tensor([3, 8], dtype=torch.int32)
    dy = torch.randn(8, 24)
    with pytest.raises(ValueError, match=r"disagree on K"):
        k.grouped_fprop(torch.randn(8, 12), w, offs)
    with pytest.raises(TypeError, match=r"w_ENK is torch.float16 but x_TK is torch.float32"):
        k.grouped_fprop(x, w.half(), offs)
    with pytest.raises(TypeError, match=r"must be bfloat16, float16 or float32"):
        k.grouped_fprop(x.double(), w.double(), offs)
    with pytest.raises(TypeError, match=r"int32 end offsets, got torch.int64"):
        k.grouped_fprop(x, w, offs.long())
    with pytest.raises(ValueError, match=r"offs_E has 3 entries, expected one per group \(2\)"):
        k.grouped_dgrad(dy, w, torch.tensor([1, 2, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"bias_EN must be \[E, N\]"):
        k.grouped_fprop(x, w, offs, torch.randn(2, 23))
    with pytest.raises(ValueError, match=r"disagree on N"):
        k.grouped_dgrad(torch.randn(8, 23), w, offs)
    with pytest.raises(ValueError, match=r"disagree on T"):
        k.grouped_wgrad(dy[:7], x, offs)
    with pytest.raises(TypeError, match=r"out must be float32"):
        k.grouped_wgrad(dy, x, offs, out=torch.zeros(2, 24, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"out must be \[E, N, K\] = \(2, 24, 16\)"):
        k.grouped_wgrad(dy, x, offs, out=torch.zeros(2, 16, 24))
    with pytest.raises(ValueError, match=r"groups overlap"):
        k.grouped_wgrad(dy, x, offs, out=torch.zeros(24, 16).expand(2, 24, 16))
    with pytest.raises(ValueError, match=r"out has 1 buffers"):
        k.grouped_wgrad(dy, x, offs, out=[torch.zeros(24, 16)])
    with pytest.raises(ValueError, match=r"out\[1\] has shape \(24, 16\) and strides \(1, 24\)"):
        k.grouped_wgrad(dy, x, offs, out=[torch.zeros(24, 16), torch.zeros(16, 24).t()])
    shared = torch.zeros(24, 16)
    with pytest.raises(ValueError, match=r"share memory"):
        k.grouped_wgrad(dy, x, offs, out=[shared, shared])
    with pytest.raises(TypeError, match=r"got dict"):
        k.grouped_wgrad(dy, x, offs, out={})
    if not _INTERPRETED:
        with pytest.raises(ValueError, match=r"need CUDA tensors \(or TRITON_INTERPRET=1\)"):
            k.grouped_fprop(x, w, offs)


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


@pytest.mark.parametrize("mode", ["load", "atomic", "tma_add"])
def test_wgrad_l2_prefetch_builds_for_sm90(mode):
    """[Note: L2 prefetch of the accumulated tile]: with ``l2_prefetch`` the accumulating wgrad kernel
    (E=64 pick: 128x128x32, 4 warps) issues one ``prefetch.global.L2::evict_last`` per 128-byte line of its
    fp32 tile (128 rows x 4 lines over 128 threads: 4 each) before its first MMA; without it, none."""
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
                    x_ptr="*bf16", out_ptr="*fp32", offs_ptr="*i32", T=T, N=N, K=K, stride_dt=N, stride_dn=1,
                    stride_xt=K, stride_xk=1, stride_oe=N * K, stride_on=K, stride_ok=1, stride_o=1)
        consts = dict(ADD_MODE=add, PTR_TABLE=False, USE_TMA=True, UPCAST=False, PRECISION="tf32", BLOCK_M=bm,
                      BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, L2_PREFETCH=prefetch)
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


# ---- GPU (bf16, realistic shapes) -------------------------------------------------------------------

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
@pytest.mark.parametrize("mode", ["load", "prefetch", "atomic", "tma_add"])
def test_gpu_wgrad_add_modes(mode):
    """Every way of adding into fp32 out, on the tile grid and off it (rows past N dropped per group)."""
    from distwgrad.kernels._grouped_gemm_configs import TileConfig
    cfg = TileConfig(128, 128, 32, num_warps=8 if mode == "prefetch" else 4, num_stages=4, add_mode=mode)
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


def _gpu_persistent_configs():
    """The persistent sweep candidates (imported lazily: the configs module sits under kernels/)."""
    try:
        from distwgrad.kernels._grouped_gemm_configs import WGRAD_ACC_CANDIDATES
    except ImportError:
        return []
    return [c for c in WGRAD_ACC_CANDIDATES if c.persistent]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cfg", _gpu_persistent_configs(), ids=lambda c: c.short())
def test_gpu_wgrad_persistent(cfg):
    """The persistent kernel: fresh and accumulating, on and off the tile grid, more tiles than programs
    (every program loops, across group boundaries), E=64 with ~5 tokens per group, all in one group."""
    if cfg.warp_specialize and not _kernels()._RANGE_WARP_SPECIALIZE:
        pytest.skip("this Triton's tl.range has no warp_specialize")
    ops = ("wgrad", "wgrad_acc", "wgrad_acc_list")
    for T, E, K, N in ((4096, 8, 1024, 1536), (3000, 5, 1000, 1304), (300, 64, 256, 384)):
        _check_all_ops(T, E, K, N, torch.bfloat16, "cuda", seed=T, config=cfg, ops=ops)
    _check_all_ops(2048, 4, 512, 256, torch.bfloat16, "cuda", seed=1, config=cfg, ops=ops,
                   splits=[0, 2048, 0, 0])


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
    chained ([Note: chained bf16 accumulation]); every call ran in the Gluon kernel, and a fresh wgrad in
    the Triton kernel."""
    from distwgrad.kernels import _grouped_wgrad_fp8_gluon as kw
    if not kw.AVAILABLE or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel runs on Hopper with a Triton that has Gluon")
    k = _kernels()
    kernel_tuning(grouped_gemm=dict(wgrad_gluon=True, wgrad_gluon_min_tokens=0, wgrad_gluon_tail=tail))
    calls = []
    real = k._launch_gluon_wgrad
    monkeypatch.setattr(k, "_launch_gluon_wgrad", lambda *a: calls.append(a[0].dtype) is None and real(*a))
    for dtype in (torch.bfloat16, torch.float16):
        _check_all_ops(T, E, K, N, dtype, "cuda", seed=T + K, ops=("wgrad", "wgrad_acc", "wgrad_acc_list"),
                       splits=splits)
    assert len(calls) == 4 and "wgrad16" not in k._GLUON_FAILED, (calls, k._GLUON_FAILED)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tail", ["tma", "zero"])
def test_gpu_gluon_wgrad_tail_ignores_other_tokens(tail, kernel_tuning):
    """A group's last chunk reaches past its end into the next group's tokens or, after the last group,
    into unrouted rows: those must count as zeros, even where they are NaN ([Note: a group's tail
    zero-filled by TMA]). The unrouted rows of dy and x are NaN here; the sums must match the oracle over
    the routed rows alone."""
    from distwgrad.kernels import _grouped_wgrad_fp8_gluon as kw
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


def test_gluon_wgrad_reaches_tritons_allocator_setting():
    """[Note: a group's tail zero-filled by TMA]: the per-group descriptors need Triton's global scratch,
    which ``launch_tokens_outer`` supplies for its launch through Triton's allocator setting (a
    ContextVar, restored after the launch); a Triton that moved it would silently lose the TMA tail, so
    the installed one must expose it, and an invalid ``tail`` names itself."""
    pytest.importorskip("triton")
    from contextvars import ContextVar

    from distwgrad.kernels import _grouped_wgrad_fp8_gluon as kw
    from distwgrad.kernels import _grouped_wgrad_fp8_gluon_launch as kl
    if not kw.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    assert isinstance(kl._allocator(), ContextVar)
    with pytest.raises(ValueError, match=r"tail must be one of \('tma', 'zero'\), got 'nan'"):
        kl.launch_tokens_outer(None, None, None, None, None, add_mode=3, stages=5, epilogue_warps=2, num_sms=132,
                               tail="nan")


@pytest.mark.gpu
@gpu
def test_gpu_gluon_wgrad_restores_the_callers_allocator(kernel_tuning):
    """The Gluon wgrad's scratch comes from torch for its own launch only: a caller's Triton allocator is
    neither called nor replaced ([Note: a group's tail zero-filled by TMA])."""
    from distwgrad.kernels import _grouped_wgrad_fp8_gluon as kw
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


def test_gluon_wgrad_dispatch_and_refusals(monkeypatch, kernel_tuning):
    """The default dispatch tries the Gluon wgrad for accumulating calls whose groups hold
    ``wgrad_gluon_min_tokens`` tokens or more on average, unless a config or ``use_tma=False`` asks for a
    Triton kernel or ``wgrad_gluon`` is off (``GroupedGemmTuning``); it never runs off Hopper or in the
    interpreter, and ``gluon=True`` where it cannot run names why."""
    pytest.importorskip("triton")
    k = _kernels()
    t = current().grouped_gemm
    assert t.wgrad_gluon is True and t.wgrad_gluon_min_tokens == 256
    pick = k._gluon_wgrad_by_default
    assert pick(65536, 64, True, None, None) and pick(256 * 8, 8, True, None, True)
    assert not pick(256 * 8 - 1, 8, True, None, None)
    assert not pick(16384, 128, True, None, None)                       # 128 tokens per group
    assert not pick(65536, 64, False, None, None)                       # a fresh output
    assert not pick(65536, 64, True, k._cfg.INTERPRETER, None)          # a config: the Triton kernel
    assert not pick(65536, 64, True, None, False)                       # no TMA: the Triton kernel
    with tuning(grouped_gemm=dict(wgrad_gluon=False)):
        assert not pick(65536, 64, True, None, None)
    dy, x = torch.randn(64, 32).bfloat16(), torch.randn(64, 48).bfloat16()
    out = torch.zeros(2, 32, 48)
    offs = torch.tensor([30, 64], dtype=torch.int32)
    assert not k._gluon_wgrad(dy, x, out)
    with pytest.raises(ValueError, match=r"gluon=True, but the Gluon kernel needs a Hopper GPU.*torch.bfloat16.*cpu"):
        k._launch_wgrad(dy, x, offs, out, accumulate=True, table=None, config=None, use_tma=None, gluon=True)
    # where it applies but does not build: gluon=True raises, the default dispatch runs the Triton kernel
    kernel_tuning(grouped_gemm=dict(wgrad_gluon=True, wgrad_gluon_min_tokens=0))
    monkeypatch.setattr(k, "_gluon_wgrad", lambda *a: True)
    monkeypatch.setattr(k, "_launch_gluon_wgrad", lambda *a: False)
    monkeypatch.setattr(k, "_GLUON_FAILED", {"wgrad16": "CompilationError: no such op"})
    with pytest.raises(RuntimeError, match=r"grouped_wgrad: gluon=True, but the Gluon kernel does not build here: "
                                           r"\{'wgrad16': 'CompilationError: no such op'\}"):
        k._launch_wgrad(dy, x, offs, out, accumulate=True, table=None, config=None, use_tma=None, gluon=True)
    taken = []
    monkeypatch.setattr(k, "_wgrad_kernel", StubKernel(lambda grid, *a, **kws: taken.append("triton")))
    k._launch_wgrad(dy, x, offs, out, accumulate=True, table=None, config=None, use_tma=None)
    assert taken == ["triton"]


@pytest.mark.gpu
@gpu
def test_gpu_e256():
    _check_all_ops(3000, 256, 64, 96, torch.bfloat16, "cuda", seed=256)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("wgrad", ["default", "triton", "gluon/tma", "gluon/zero"])
def test_gpu_cuda_graph_and_compile(wgrad, kernel_tuning):
    """Captured once, replayed with new routing (offsets on the device change, the graph does not); the
    accumulating wgrad as the default dispatch picks it (256 tokens per group: the Gluon kernel on Hopper),
    through the Triton kernel, and through the Gluon kernel with either tail, whose per-group descriptors
    live in scratch allocated at capture ([Note: a group's tail zero-filled by TMA])."""
    k = _kernels()
    if wgrad == "triton":
        kernel_tuning(grouped_gemm=dict(wgrad_gluon=False))
    elif wgrad != "default":
        from distwgrad.kernels import _grouped_wgrad_fp8_gluon as kw
        if not kw.AVAILABLE or torch.cuda.get_device_capability()[0] != 9:
            pytest.skip("the Gluon kernel runs on Hopper with a Triton that has Gluon")
        kernel_tuning(grouped_gemm=dict(wgrad_gluon_min_tokens=0, wgrad_gluon_tail=wgrad.split("/")[1]))
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


if __name__ == "__main__":  # child process of test_interpreter: TRITON_INTERPRET=1 is set
    assert _INTERPRETED, "run through pytest, or set TRITON_INTERPRET=1"
    _INTERPRETER_CASES[sys.argv[1]]()
    print(f"interpreter case {sys.argv[1]}: ok")
