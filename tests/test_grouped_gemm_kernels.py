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
so an unwritten tile fails; splits are random and include empty groups. Elsewhere: the problems and checks
these share (``grouped_gemm_cases.py``), the sm_90a builds, config picks and the Gluon wgrad's dispatch
without a GPU (``test_grouped_gemm_builds.py``) and the GPU tests (``test_grouped_gemm_gpu.py``).
"""

import dataclasses
import os
import re
import sys

import pytest
import torch
from grouped_gemm_cases import _check, _check_all_ops, _inputs, _kernels

from distwgrad.testing import reference as R
from distwgrad.testing.interpreter import run_interpreted

_HERE = os.path.abspath(__file__)
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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
    for mode in ("atomic", "tma_add"):
        cfg = dataclasses.replace(INTERPRETER, add_mode=mode)
        for use_tma in (False, True):
            _check_all_ops(64, 5, 48, 40, torch.float32, "cpu", seed=12, use_tma=use_tma, config=cfg,
                           ops=("wgrad_acc", "wgrad_acc_list"))
    # bf16 operands, fp32 outputs only (see the module docstring)
    _check_all_ops(64, 5, 48, 40, torch.bfloat16, "cpu", seed=9, ops=("wgrad_acc", "wgrad_acc_list"))
    # a fresh fp32 output, empty groups included: the bits of the add into zeros (one config here)
    for dtype in (torch.float16, torch.bfloat16):
        _check_all_ops(64, 5, 48, 40, dtype, "cpu", seed=13, ops=("wgrad_fp32",), exact_fresh=True,
                       splits=[20, 0, 30, 14, 0])
    _check_all_ops(61, 3, 32, 24, torch.bfloat16, "cpu", seed=10, use_tma=True, ops=("wgrad_acc",))


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
    torch.library.opcheck(ops.grouped_wgrad.default, (dy, x, offs, torch.float32))
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
    "e256": _case_e256,
    "layouts_and_offsets": _case_layouts_and_offsets,
    "custom_ops": _case_custom_ops,
}


@pytest.mark.interpret
@pytest.mark.parametrize("case", sorted(_INTERPRETER_CASES))
def test_interpreter(case):
    pytest.importorskip("triton")
    run_interpreted(_HERE, case, timeout=300)


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


if __name__ == "__main__":  # child process of test_interpreter: TRITON_INTERPRET=1 is set
    assert _INTERPRETED, "run through pytest, or set TRITON_INTERPRET=1"
    _INTERPRETER_CASES[sys.argv[1]]()
    print(f"interpreter case {sys.argv[1]}: ok")
