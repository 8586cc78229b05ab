"""The interpreter cases' fork server changes how fast the interpreter runs a kernel, never what it computes.

``distwgrad/testing/_interpreter_server.py``: [Note: interpreter overflow checks] turns Triton's
``sanitize_overflow`` off because the interpreter's ``device_assert`` drops the check's result,
[Note: interpreter NaN-max reductions] reduces the quantizers' ``_max_nan`` with ``numpy.max``,
[Note: interpreter builtin lists] lists the language's builtins once, and [Note: interpreter helper patches]
skips a helper's language patch that an earlier one of its launch made. This file holds Triton to the first
and last premises, the second to Triton's own reduction, bit for bit, and the third to Triton's own listing,
name for name, in cases forked from the server like every other.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

import pytest
import torch

from distwgrad.testing.interpreter import run_interpreted

_HERE = os.path.abspath(__file__)


def _case_overflow() -> None:
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    @triton.jit
    def add_one(x_ptr, o_ptr):
        offs = tl.arange(0, 4)
        tl.store(o_ptr + offs, tl.load(x_ptr + offs) + 1)  # int32 + int32: a checked add

    builder = interpreter.interpreter_builder
    server = builder.options
    assert server.sanitize_overflow is False and server.debug is False, server
    x = torch.tensor([2**31 - 1, 7, -(2**31), 0], dtype=torch.int32)
    wrapped = torch.tensor([-(2**31), 8, -(2**31) + 1, 1], dtype=torch.int32)
    for sanitize in (True, False):  # Triton's default, then the server's
        builder.options = dataclasses.replace(server, sanitize_overflow=sanitize)
        out = torch.empty_like(x)
        add_one[(1,)](x, out)  # with the check on: the overflow is computed, and no error follows
        assert torch.equal(out, wrapped), (sanitize, out)
    builder.options = server


def _case_nan_max() -> None:
    global _max_nan  # the kernel below reads it from this module's globals, as Triton resolves names
    import triton
    import triton.language as tl
    from distwgrad.kernels._quantize_kernels import _max_nan
    from triton.runtime import interpreter

    @triton.jit
    def reduce_max(x_ptr, rows_ptr, cols_ptr, all_ptr, M: tl.constexpr, N: tl.constexpr):
        m, n = tl.arange(0, M), tl.arange(0, N)
        x = tl.load(x_ptr + m[:, None] * N + n[None, :])
        tl.store(rows_ptr + m, tl.reduce(x, 1, _max_nan))
        tl.store(cols_ptr + n, tl.reduce(x, 0, _max_nan))
        tl.store(all_ptr, tl.reduce(tl.reduce(x, 1, _max_nan), 0, _max_nan))

    ops = interpreter.ReduceOps
    fast, generic = ops.apply_impl, ops._distwgrad_generic
    calls = []

    def counted(self, input):
        calls.append(1)
        return generic(self, input)
    ops._distwgrad_generic = counted

    def run(x: torch.Tensor, impl) -> list[torch.Tensor]:
        ops.apply_impl = impl
        try:
            out = [torch.empty(8), torch.empty(16), torch.empty(1)]
            reduce_max[(1,)](x, *out, M=8, N=16)
            return out
        finally:
            ops.apply_impl = fast

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=gen) * 100
    x[1, 3] = x[5, 0] = float("nan")
    x[2, 7], x[3, 2], x[6] = float("inf"), float("-inf"), -1.0   # a row of negatives
    x[4] = 0.0
    signed = x.clone()
    signed[7, :8], signed[7, 8:] = -0.0, 0.0                   # order-dependent: element by element
    for data, expect_generic in ((x, False), (x.abs(), False), (signed, True)):
        calls.clear()
        got = run(data, fast)
        assert bool(calls) == expect_generic, (expect_generic, len(calls))
        for g, r in zip(got, run(data, generic), strict=True):
            torch.testing.assert_close(g, r, rtol=0, atol=0, equal_nan=True)
            assert torch.equal(g.signbit(), r.signbit()), (g, r)
        assert got[0][1].isnan() and got[1][3].isnan() and got[2].isnan().all()
    ops._distwgrad_generic = generic


def _case_builtin_lists() -> None:
    import triton.language as tl
    from distwgrad.kernels import cast_transpose
    from triton.runtime import interpreter

    ours, triton_s = interpreter._patch_builtin, interpreter._distwgrad_patch_builtin
    assert ours is not triton_s

    def patched(patch, holder) -> list[str]:
        scope = interpreter._LangPatchScope()
        patch(holder, interpreter.interpreter_builder, scope)
        names = [name for _, name, _ in scope._changes]
        scope.restore()
        return names

    def same(when: str) -> None:
        for holder in (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base):
            want = patched(triton_s, holder)
            assert patched(ours, holder) == want, (when, holder, want)

    same("before any patch")
    assert len(patched(ours, tl)) > 50 and "__add__" in patched(ours, tl.tensor)
    launch = interpreter._patch_lang(cast_transpose._cast_transpose_kernel.fn)  # a launch: tl, tl.tensor, tl.math
    same("during a launch's patch")
    helper = interpreter._patch_lang(tl.zeros.fn)  # a helper of tl.core's (Triton never restores these)
    same("during a helper's patch")
    helper.restore()
    launch.restore()
    same("after both")


def _code(value):
    """What a patched attribute runs: its code (and a partial's keywords), else the value itself."""
    if isinstance(value, functools.partial):
        return _code(value.func), tuple(value.args), tuple(sorted(value.keywords.items()))
    if isinstance(value, property):
        return _code(value.fget)
    return getattr(value, "__code__", value)


def _case_helper_patches() -> None:
    import triton.language as tl
    from distwgrad.kernels import cast_transpose
    from triton.runtime import interpreter

    ours, triton_s = interpreter._patch_lang, interpreter._distwgrad_patch_lang
    launch = interpreter.GridExecutor.__call__
    events: list[tuple] = []

    def launching(self, *args, **kwargs):
        events.append(("launch",))
        return launch(self, *args, **kwargs)

    def recording(fn):  # Triton's patch, and whether it changed anything: a builtin wrapped, or other code
        scope = triton_s(fn)
        changes = [(id(obj), name, tl.core.is_builtin(old) or _code(getattr(obj, name)) != _code(old))
                   for obj, name, old in scope._changes]
        events.append(("patch", {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}, changes))
        return scope

    x = (torch.randn(300, 48, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    offs_E = torch.tensor([100, 100, 250], dtype=torch.int32)
    # offs_E afresh: a layout made once is kept on the tensor. A first run rewrites the helpers (which adds to
    # their globals), so that the two runs compared launch the same kernels with the same globals.
    run = lambda: cast_transpose.cast_transpose_per_tensor(x, torch.float8_e4m3fn, offs_E=offs_E.clone())
    run()
    interpreter.GridExecutor.__call__, interpreter._patch_lang = launching, recording
    want = run()  # every patch Triton's
    interpreter._patch_lang = ours
    # The premise: in a launch, a helper's patch of modules earlier patches of the launch covered wraps no
    # builtin, sets only attributes they set, and to the same code.
    skippable = needed = 0
    for event in events:
        if event[0] == "launch":
            covered, keys, first = set(), set(), True
            continue
        _, langs, changes = event
        if not first and langs and langs <= covered:
            assert {(o, n) for o, n, _ in changes} <= keys and not any(changed for _, _, changed in changes), changes
            skippable += 1
        else:
            needed += 1
        first, covered, keys = False, covered | langs, keys | {(o, n) for o, n, _ in changes}
    assert skippable > needed > 0, (skippable, needed)
    # The server's patch runs Triton's exactly where the premise does not hold, with the same results.
    calls = []
    interpreter._distwgrad_patch_lang = lambda fn: calls.append(fn) or triton_s(fn)
    got = run()
    interpreter._distwgrad_patch_lang, interpreter.GridExecutor.__call__ = triton_s, launch
    assert len(calls) == needed, (len(calls), needed)
    bits = lambda t: t.reshape(-1).view(torch.uint8) if t.is_floating_point() else t
    assert all(torch.equal(bits(g), bits(w)) for g, w in zip(got, want, strict=True))


_CASES = {"overflow": _case_overflow, "nan_max": _case_nan_max, "builtin_lists": _case_builtin_lists,
          "helper_patches": _case_helper_patches}


@pytest.mark.interpret
def test_the_server_skips_only_discarded_overflow_checks():
    pytest.importorskip("triton")
    out = run_interpreted(_HERE, "overflow", timeout=120)
    assert "case ok" in out, out


@pytest.mark.interpret
def test_nan_max_reductions_in_numpy_give_tritons_bits():
    pytest.importorskip("triton")
    out = run_interpreted(_HERE, "nan_max", timeout=120)
    assert "case ok" in out, out


@pytest.mark.interpret
def test_builtins_listed_once_are_the_ones_triton_patches():
    pytest.importorskip("triton")
    out = run_interpreted(_HERE, "builtin_lists", timeout=120)
    assert "case ok" in out, out


@pytest.mark.interpret
def test_helper_patches_skipped_only_where_they_would_change_nothing():
    pytest.importorskip("triton")
    out = run_interpreted(_HERE, "helper_patches", timeout=120)
    assert "case ok" in out, out


if __name__ == "__main__":  # the child of the tests above, forked from the interpreter server
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest"
    _CASES[sys.argv[1]]()
    print("case ok", file=sys.stdout)
