"""Host cost per call of the FP8 quantize kernels' Python entry points, the GPU launch stubbed out.

The quantize kernels take ~100 µs of device time at 8192 x 16384 on an H200, so the host's share (argument
checks, the ``torch.library.custom_op`` dispatch, output allocation) decides whether a launch-bound
caller waits on the CPU (docs/benchmarks.md). This times that share on any machine: the Triton kernels
are replaced by no-ops, and the public functions (which call the custom op's implementation directly in
plain eager mode, [Note: custom op bypass] in kernels/_dispatch.py) are compared with the same work
through the ``torch.ops`` dispatcher and with the implementation alone. CPU under ``TRITON_INTERPRET=1``
(the kernels' device checks accept CPU tensors there)::

    TRITON_INTERPRET=1 PYTHONPATH=. python qa/bench/quantize_host.py
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from distwgrad.fp8.recipe import BlockwiseScaling

if __package__ in (None, ""):  # run as a script: the repository root on the path, for ``qa.bench``
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from qa.bench import results  # noqa: E402


class _NoLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _us_per_call(fn: Callable[[], object], calls: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    results.add_arguments(p)
    args = p.parse_args(argv)
    from distwgrad.kernels import quantize as kq

    from distwgrad.ops import quantize as q8  # the entry points the runtime calls: Quantized out
    for name in ("_amax_kernel", "_cast_per_tensor_kernel", "_quantize_rows_kernel", "_quantize_blocks_kernel",
                 "_quantize_rowcol_kernel"):
        setattr(kq, name, _NoLaunch())
    x = torch.randn(256, 512, device=args.device)
    e4m3 = torch.float8_e4m3fn
    rows = {
        "quantize_per_tensor": lambda: q8.quantize_per_tensor(x, e4m3),
        "quantize_blockwise 1x128": lambda: q8.quantize_blockwise(x, (1, 128), e4m3),
        "  the same through the custom op (torch.ops)": lambda: torch.ops.distwgrad.fp8_quantize_blockwise(
            x, 1, 128, e4m3, True),
        "  the custom op's implementation alone": lambda: kq._blockwise_impl(x, 1, 128, e4m3, True),
        "quantize_rowwise_and_columnwise": lambda: q8.quantize_rowwise_and_columnwise(x, BlockwiseScaling()),
        "  two output allocations (torch.empty)": lambda: (torch.empty(x.shape, dtype=e4m3, device=x.device),
                                                           torch.empty(256, 4, device=x.device)),
    }
    result = {name: _us_per_call(fn, args.calls) for name, fn in rows.items()}
    for name, us in result.items():
        print(f"{name:52s} {us:8.1f} µs/call")
    results.record([results.row(bench="quantize_host", case=f"{name.strip()} 256x512", impl="distwgrad",
                                precision="fp8_per_tensor" if "per_tensor" in name else "fp8_blockwise", world=1,
                                metric="host_us", value=us, unit="us", device=args.device, calls=args.calls)
                    for name, us in result.items()], args)
    return result


if __name__ == "__main__":
    main()
