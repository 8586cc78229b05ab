"""Running a test script under Triton's interpreter in a child process.

Triton reads ``TRITON_INTERPRET`` when it is imported, so a test process that has imported it cannot
switch to the interpreter: the CPU tests of a kernel re-run their own file as a child with it set (and,
with ``kernels_on_cpu``, ``DISTWGRAD_KERNELS_ON_CPU=1``: the modules route CPU tensors through the
kernels, [Note: fp8 gemm dispatch]).
"""

from __future__ import annotations

import os
import subprocess
import sys

__all__ = ["run_interpreted"]


def run_interpreted(script: str, *args: object, kernels_on_cpu: bool = False, timeout: float = 600) -> str:
    """``python script *args`` under ``TRITON_INTERPRET=1`` with this process's import path; its stdout.
    Raises AssertionError, with the child's output, if it exits non-zero."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    if kernels_on_cpu:
        env["DISTWGRAD_KERNELS_ON_CPU"] = "1"
    proc = subprocess.run([sys.executable, script, *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    what = f"{os.path.basename(script)} {list(args)}"
    assert proc.returncode == 0, f"{what} failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return proc.stdout
