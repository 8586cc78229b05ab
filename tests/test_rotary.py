"""The model's rotary embedding (``distwgrad.ops.rotary``) and its fused kernel (``kernels/rotary.py``).

Under the interpreter the kernel's fp32 arithmetic is numpy's, operation by operation, so it must equal the formula
computed in fp32 and rounded once (bf16: truncated, as the interpreter converts), bit for bit, forward and backward
(backward: the rotation by the opposite angle, whose sums autograd forms from the same two products). On a GPU the
compiler may contract a product and a sum into one FMA, so there the bound is the output's rounding plus the fp32
work's worst case. The routes: the kernel only where nothing traces the call.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from distwgrad.ops import rotary
from distwgrad.testing.interpreter import run_interpreted

_HERE = os.path.abspath(__file__)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _tables(S: int, half: int, dtype: torch.dtype, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.outer(torch.arange(S, dtype=torch.float64), torch.rand(half, dtype=torch.float64) * 3)
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def _q(B: int, S: int, H: int, D: int, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """q as the model makes it: a [B, H, S, D] view of a qkv projection's first third (strided, not contiguous)."""
    qkv = (torch.randn(B, S, 3 * H * D, device=device) * 4).to(dtype)
    return qkv[..., : H * D].view(B, S, H, D).transpose(1, 2)


def _fp32_once(x, cos, sin, dy):
    """The formula in fp32, rounded once to ``x``'s dtype: (output, the input's gradient for ``dy``)."""
    x32 = x.detach().float().requires_grad_()
    y32 = rotary.rotate_halves_formula(x32, cos.float(), sin.float())
    y32.backward(dy.float())
    return _rounded(y32.detach(), x.dtype), _rounded(x32.grad, x.dtype)


def _rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``t`` as the kernel's ``.to(dtype)`` writes it: round to nearest even, except that Triton's interpreter
    converts fp32 to bf16 by truncating the low 16 bits (the GPU test bounds the rounding)."""
    if dtype == torch.bfloat16 and _INTERPRETED:
        return (t.view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return t.to(dtype)


# ---- interpreter cases (run in the child process) -------------------------------------------------


def _case_bits():
    """Each dtype of activations and tables, a strided q, positions off the block, a head width off a power of two:
    forward and backward equal the fp32 formula rounded once; an eval forward and a retained graph's two backwards;
    the route takes the kernel (a contiguous result whose bits the bf16 formula does not give)."""
    torch.manual_seed(0)
    for dtype in DTYPES:
        for table_dtype in (dtype, torch.float32):
            for B, S, H, D in ((2, 37, 3, 16), (1, 5, 2, 24)):
                x = _q(B, S, H, D, dtype).requires_grad_()
                cos, sin = _tables(S, D // 2, table_dtype)
                y = rotary.rotate_halves(x, cos, sin)
                dy = torch.randn(y.shape).to(dtype)
                y.backward(dy)
                want_y, want_dx = _fp32_once(x, cos, sin, dy)
                what = f"{dtype} tables {table_dtype} {(B, S, H, D)}"
                assert y.is_contiguous() and y.dtype == dtype, what
                assert torch.equal(y, want_y), what
                assert torch.equal(x.grad, want_dx), what
    x = _q(2, 40, 2, 64, torch.bfloat16)
    cos, sin = _tables(40, 32, torch.bfloat16)
    with torch.no_grad():  # an eval forward between steps: the same bits, no graph
        y_eval = rotary.rotate_halves(x, cos, sin)
    assert y_eval.grad_fn is None
    x.requires_grad_()
    y = rotary.rotate_halves(x, cos, sin)
    assert torch.equal(y.detach(), y_eval)
    dy = torch.randn(y.shape).to(y.dtype)
    y.backward(dy, retain_graph=True)  # a retained graph, two backwards: the gradients add
    once = x.grad.clone()
    y.backward(dy)
    assert torch.equal(x.grad, once + once)
    x = x.detach()
    assert not torch.equal(rotary.rotate_halves_formula(x, cos, sin), rotary.rotate_halves(x, cos, sin)), \
        "the bf16 formula rounds each operation: the kernel's single rounding must differ somewhere"


_INTERPRETER_CASES = {"bits": _case_bits}


@pytest.mark.interpret
@pytest.mark.parametrize("case", sorted(_INTERPRETER_CASES))
def test_interpreter(case):
    pytest.importorskip("triton")
    run_interpreted(_HERE, case, kernels_on_cpu=True, timeout=300)


# ---- in-process: the routes -----------------------------------------------------------------------


def test_the_formula_on_the_cpu():
    """Without the interpreter the CPU takes torch's formula, in the activations' dtype, as the model always did."""
    x = _q(2, 9, 2, 8, torch.bfloat16)
    cos, sin = _tables(9, 4, torch.bfloat16)
    x1, x2 = x.chunk(2, dim=-1)
    want = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    assert torch.equal(rotary.rotate_halves(x, cos, sin), want)


def test_the_routes(monkeypatch):
    """Where the kernel could run: differentiable tables and compile tracing take the formula; fake tensors the
    kernel's custom op, whose fake gives the result's shape and dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(rotary, "kernels_available", lambda t: True)
    x = _q(1, 4, 2, 8, torch.float32)
    cos, sin = _tables(4, 4, torch.float32)
    assert rotary._fused_ok(x, cos, sin)
    assert not rotary._fused_ok(x, cos.clone().requires_grad_(), sin)
    with FakeTensorMode() as mode:
        fake = rotary.rotate_halves(mode.from_tensor(x), mode.from_tensor(cos), mode.from_tensor(sin))
        assert fake.shape == x.shape and fake.dtype == x.dtype and fake.is_contiguous()
    seen = []

    def traced(x, cos, sin):
        seen.append(rotary._fused_ok(x, cos, sin))
        return rotary.rotate_halves(x, cos, sin)

    torch.compile(traced, backend="eager", fullgraph=True)(x, cos, sin)
    assert seen == [False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_within_the_fp32_bound_on_a_gpu(dtype):
    """The model's shapes at ``large`` (16 heads of 128, 2048 positions, bf16 tables): the kernel's route, forward
    and backward, within the output's rounding (one ulp of ``dtype``: a rounding boundary may fall either side) plus
    the fp32 work's worst case (two products and a sum: 3 ulps of fp32 of the terms' magnitudes) of the formula in
    float64."""
    torch.manual_seed(0)
    x = _q(2, 2048, 16, 128, dtype, "cuda").requires_grad_()
    cos, sin = _tables(2048, 64, torch.bfloat16 if dtype != torch.float32 else dtype, "cuda")
    y = rotary.rotate_halves(x, cos, sin)
    dy = torch.randn(y.shape, device="cuda").to(dtype)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    y64 = rotary.rotate_halves_formula(x64, cos.double(), sin.double())
    y64.backward(dy.double())
    for got, want, operand in ((y, y64, x.detach()), (x.grad, x64.grad, dy)):
        bound = (torch.finfo(dtype).eps * want.abs() + 3 * 2.0**-24 * _magnitude(operand, cos, sin)
                 + torch.finfo(dtype).tiny)
        assert ((got.double() - want).abs() <= bound).all(), ((got.double() - want).abs() - bound).max().item()


def _magnitude(t, cos, sin):
    """The terms' magnitudes of a rotation of ``t`` (by either angle): |t1||cos| + |t2||sin|, |t1||sin| + |t2||cos|."""
    t1, t2 = t.double().abs().chunk(2, dim=-1)
    c, s = cos.double().abs(), sin.double().abs()
    return torch.cat([t1 * c + t2 * s, t1 * s + t2 * c], dim=-1)


if __name__ == "__main__":  # child process of test_interpreter: TRITON_INTERPRET=1 is set
    assert _INTERPRETED, "run through pytest, or set TRITON_INTERPRET=1"
    sys.path.insert(0, os.path.dirname(_HERE))
    _INTERPRETER_CASES[sys.argv[1]]()
    print(f"interpreter case {sys.argv[1]}: ok")
