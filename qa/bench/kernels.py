"""The kernel benchmarks: the grouped GEMMs against their peers, and the FP8 quantization and FP8 grouped GEMMs.

    PYTHONPATH=. python qa/bench/kernels.py gemm --json out.json          # bf16 grouped GEMMs (fprop, dgrad, wgrad)
    PYTHONPATH=. python qa/bench/kernels.py fp8 --json out.json           # FP8 quantization and grouped GEMMs

``qa/bench/kernels.py KIND --help`` lists a kind's options; what each measures and the rows it writes:
``_gemm_kernels.py`` and ``_fp8_kernels.py``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from qa.bench._dispatch import run  # noqa: E402

KINDS = {"gemm": "qa.bench._gemm_kernels", "fp8": "qa.bench._fp8_kernels"}

if __name__ == "__main__":
    rc = run("kernels.py", KINDS)
    sys.exit(rc if isinstance(rc, int) else 0)
