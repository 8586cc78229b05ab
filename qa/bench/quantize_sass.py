"""Static cost of the FP8 quantize kernels on Hopper, without a GPU: registers, shared memory and SASS
instructions per element of each kernel variant, compiled for sm_90a with the specializations a launch
on 16-divisible shapes gets (Triton's own ptxas and cuobjdump do the work).

The rows + columns kernel is bound by instruction issue rather than by memory (docs/benchmarks.md), so
its instructions per element are the number to watch when changing it; the GB/s come from
``qa/bench/fp8.py`` on a GPU. The kernels are straight-line code (no loops), so the static count is the
executed count::

    python qa/bench/quantize_sass.py          # from the repository root, package installed or on the path
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

if __package__ in (None, ""):  # run as a script: the repository root on the path, for ``qa.bench``
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from qa.bench import results  # noqa: E402

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_E4M3 = dict(NUM=448.0, FP8=tl.float8e4nv, FP8_MAX=448.0, MANT=3, EMIN_BIASED=-6 + 127, HW_CAST=True)


def _tools() -> tuple[str, str]:
    ptxas = next((os.path.join(_BIN, n) for n in ("ptxas-blackwell", "ptxas")
                  if os.path.exists(os.path.join(_BIN, n))), None)
    cuobjdump = os.path.join(_BIN, "cuobjdump")
    if ptxas is None or not os.path.exists(cuobjdump):
        raise FileNotFoundError(f"ptxas and cuobjdump are expected under {_BIN} (shipped with Triton)")
    return ptxas, cuobjdump


def variants() -> dict[str, tuple]:
    """name -> (kernel, constexprs, num_warps, maxnreg, elements per program); bf16 input, e4m3 output,
    power-of-two scales, L = 128 (the blockwise recipe's defaults)."""
    from distwgrad.kernels import quantize as kq
    from distwgrad.kernels.gluon import quantize_rowcol as kg
    rowcol = dict(_E4M3, POW2=True, L=128)
    gluon = {} if not kg.AVAILABLE else {  # [Note: rows and columns without a transpose]
        "rowcol gluon": (kg.rowcol_kernel, dict(NUM=448.0, FP8=tl.float8e4nv), kg.NUM_WARPS.value, None, 128 * 128)}
    return {**gluon,
        "rowcol w8 maxnreg128 (default)": (kq._quantize_rowcol_kernel, rowcol, 8, 128, 128 * 128),
        "rowcol w8 maxnreg128, divisions": (kq._quantize_rowcol_kernel, dict(rowcol, POW2=False), 8,
                                             128, 128 * 128),  # power_of_two=False: the scales need IEEE divisions
        "rowcol w4": (kq._quantize_rowcol_kernel, rowcol, 4, None, 128 * 128),
        "rows 1x128, 32 rows w4": (kq._quantize_rows_kernel, dict(_E4M3, POW2=True, TILE_M=32, L=128), 4, None,
                                   32 * 128),
        "blocks 128x128 w8": (kq._quantize_blocks_kernel, dict(_E4M3, POW2=True, TRANSPOSE=False, BLOCK_M=128,
                                                                 BLOCK_N=128), 8, None,
                              128 * 128),
    }


def measure(fn, consts: dict, num_warps: int, maxnreg: int | None, elements: int) -> dict:
    """Registers, shared bytes, SASS instructions (total, per element, by opcode) of one sm_90a build."""
    ptxas, cuobjdump = _tools()
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        sig[name] = ("*bf16" if name == "x_ptr" else "*u8" if name in ("q_ptr", "qt_ptr") else "*i32"
                     if name == "qt32_ptr" else "*fp32" if name.endswith("_ptr") else "i32")
        attrs[(i,)] = [["tt.divisibility", 16]]
    # enable_fp_fusion: a launch's default, said explicitly (Triton 3.9 warns when it is left to the default)
    options = dict(num_warps=num_warps, enable_fp_fusion=True, **({"maxnreg": maxnreg} if maxnreg else {}))
    source = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():  # the Gluon rows + columns kernel
        from triton.experimental.gluon._runtime import GluonASTSource as source
    kernel = triton.compile(source(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", cubin], capture_output=True, text=True,
                              check=True).stderr
        sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    ops = collections.Counter(m.group(2) for m in re.finditer(r"\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass))
    total = sum(ops.values())
    return {"registers": int(re.search(r"Used (\d+) registers", info).group(1)),
            "spill_bytes": int(re.search(r"(\d+) bytes spill stores", info).group(1)),
            "shared_bytes": kernel.metadata.shared, "instructions": total,
            "per_element": total * 32 * num_warps / elements, "ops": ops}


def main(argv: list[str] | None = None) -> dict[str, dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", default=None, help="variant names to build (default all)")
    results.add_arguments(p)
    args = p.parse_args(argv)
    found = {}
    for name, (fn, consts, warps, maxnreg, elements) in variants().items():
        if args.only and name not in args.only:
            continue
        r = found[name] = measure(fn, consts, warps, maxnreg, elements)
        print(f"{name:32s} {r['registers']:4d} regs  {r['spill_bytes']:4d} B spilled  {r['shared_bytes']:6d} B shared  "
              f"{r['per_element']:5.1f} instructions/element  ({r['ops']['LDS.U8']} single-byte shared loads/thread)",
              flush=True)
    results.record([results.row(bench="quantize_sass", case=name, impl="distwgrad", precision="fp8_e4m3", world=1,
                                metric=metric, value=r[key], unit=unit, target="sm_90a")
                    for name, r in found.items()
                    for key, metric, unit in (("registers", "registers", "per thread"),
                                              ("spill_bytes", "spill_bytes", "B"),
                                              ("per_element", "instructions_per_element", "SASS instructions"))],
                   args)
    return found


if __name__ == "__main__":
    main()
