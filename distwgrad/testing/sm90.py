"""Building Hopper (sm_90a) kernels on a machine without a GPU, for tests that inspect what the
compiler made of them: the PTX (which instructions, how many waits) and ptxas's report (registers,
spills, and its warnings, e.g. C7514 "wgmma.mma_async instructions are serialized"). Triton ships a
ptxas; when it accepts newer PTX than the one that runs the GPU kernels, this one is what a test can use."""

from __future__ import annotations

import os
import subprocess
import tempfile


def specialize(fn, vals: dict, consts: dict, nospec) -> tuple[dict, dict]:
    """(signature, attributes) of ``fn`` as the JIT would build them for arguments ``vals`` (type strings
    for pointers and descriptors, ints otherwise, or a tuple of those for a tuple argument): unit ints become
    constants and 16-divisible ones get the divisibility hint, except the ``nospec`` names; ``consts``
    (updated in place, keyed by name or, inside a tuple, by path) are constexprs."""
    sig, attrs = {}, {}

    def leaf(path: tuple[int, ...], v, spec: bool):
        if isinstance(v, tuple):
            return tuple(leaf(path + (j,), x, spec) for j, x in enumerate(v))
        if isinstance(v, str):
            attrs.update({path: [["tt.divisibility", 16]]} if v.startswith("*") else {})
            return v
        if not isinstance(v, int):
            raise TypeError(f"specialize: argument {path} needs a type string or an int, got {v!r}")
        if v == 1 and spec:
            consts[path if len(path) > 1 else fn.arg_names[path[0]]] = 1
            return "constexpr"
        attrs.update({path: [["tt.divisibility", 16]]} if v % 16 == 0 and spec else {})
        return "i32"

    for i, name in enumerate(fn.arg_names):
        sig[name] = "constexpr" if name in consts else leaf((i,), vals.get(name), name not in nospec)
    return sig, attrs


def assemble_or_skip(ptx: str) -> str:
    """ptxas's -v messages for ``ptx`` (sm_90a), for a test: skips it where this Triton ships no ptxas or one
    older than the PTX, and fails it (the messages) where ptxas rejects the PTX."""
    import pytest
    report = ptxas_report(ptx)
    if report is None:
        pytest.skip("this Triton ships no ptxas")
    rc, info = report
    if rc != 0 and "Unsupported .version" in info:
        pytest.skip(f"this ptxas is older than the PTX: {info[:200]}")
    assert rc == 0, info
    return info


def ptxas_report(ptx: str) -> tuple[int, str] | None:
    """(return code, ptxas -v messages) of assembling ``ptx`` for sm_90a; None if Triton ships no ptxas."""
    import triton
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = next((os.path.join(bin_dir, n) for n in ("ptxas-blackwell", "ptxas")
                  if os.path.exists(os.path.join(bin_dir, n))), None)
    if ptxas is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True)
    return info.returncode, info.stderr
