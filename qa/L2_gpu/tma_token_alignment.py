"""Which innermost (token) box coordinates does a TMA load of fp8 ``[rows, tokens]`` accept? A GPU check.

[Note: fp8 wgrad chunks] (``kernels/grouped_gemm_fp8.py``) rests on it: the wgrad's operands dy^T and x^T
hold tokens innermost, so where a chunk may start is the TMA box's innermost coordinate. Each offset runs
in its own process (a faulting load ends the CUDA context) through a Triton descriptor load and a Gluon
one (``gluon.tma_load``, 128-byte swizzle) of a 128 x 128 box, compared byte for byte with the
torch slice. On an H200 (2026-11-30, Triton 3.6) offsets 0 and 16 loaded right and 1, 5, 17 and 100
raised an illegal instruction, in both. Usage: ``python3 qa/L2_gpu/tma_token_alignment.py [offsets...]``.
"""

from __future__ import annotations

import subprocess
import sys

import torch
import triton
import triton.language as tl
from distwgrad.kernels.gluon import descriptor, fence_async_shared, gl, gluon, mbarrier, tma_load
from triton.tools.tensor_descriptor import TensorDescriptor

BOX = 128


@triton.jit
def _triton_load(desc, out_ptr, r0, c0):
    v = desc.load([r0, c0])
    rows = tl.arange(0, 128)
    tl.store(out_ptr + rows[:, None] * 128 + rows[None, :], v)


@gluon.jit
def _gluon_load(desc, out_ptr, r0, c0):
    B0: gl.constexpr = desc.block_type.shape[0]
    B1: gl.constexpr = desc.block_type.shape[1]
    smem = gl.allocate_shared_memory(desc.dtype, [B0, B1], desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    bar = bars.index(0)
    mbarrier.init(bar, count=1)
    fence_async_shared()
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma_load(desc, [r0, c0], bar, smem)
    mbarrier.wait(bar, 0)
    lay: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [4, 1], [1, 0])
    rows = gl.arange(0, B0, layout=gl.SliceLayout(1, lay))
    cols = gl.arange(0, B1, layout=gl.SliceLayout(0, lay))
    gl.store(out_ptr + rows[:, None] * B1 + cols[None, :], smem.load(lay))
    mbarrier.invalidate(bar)


def _child(kind: str, c0: int) -> str:
    """One load at token offset ``c0`` (rows 7 ..): 'right' or 'WRONG' (a fault raises)."""
    torch.manual_seed(0)
    src = (torch.randn(256, 1024, device="cuda") * 10).to(torch.float8_e4m3fn)
    out = torch.empty(BOX, BOX, device="cuda", dtype=torch.float8_e4m3fn)
    if kind == "gluon":
        _gluon_load[(1,)](descriptor(src, (BOX, BOX)), out, 7, c0, num_warps=4)
    else:
        _triton_load[(1,)](TensorDescriptor.from_tensor(src, [BOX, BOX]), out, 7, c0, num_warps=4)
    torch.cuda.synchronize()
    ref = torch.zeros(BOX, BOX, device="cuda", dtype=torch.float8_e4m3fn)
    blk = src[7:7 + BOX, c0:c0 + BOX]
    ref[:blk.shape[0], :blk.shape[1]] = blk
    return "right" if torch.equal(out.view(torch.uint8), ref.view(torch.uint8)) else "WRONG"


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--child":
        print(_child(argv[1], int(argv[2])))
        return 0
    offsets = [int(a) for a in argv] or [0, 16, 32, 128, 1, 5, 17, 100]
    print(f"{'token offset':>12}  {'triton':>18}  {'gluon':>18}")
    for c0 in offsets:
        cells = []
        for kind in ("triton", "gluon"):
            proc = subprocess.run([sys.executable, __file__, "--child", kind, str(c0)], capture_output=True, text=True,
                                  timeout=300)
            out = proc.stdout.strip().splitlines()
            fault = "illegal instruction" if "illegal instruction" in proc.stderr else "fault"
            cells.append(out[-1] if proc.returncode == 0 and out else fault)
        print(f"{c0:>12}  {cells[0]:>18}  {cells[1]:>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
