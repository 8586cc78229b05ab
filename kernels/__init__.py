"""Triton kernels, installed as ``distwgrad.kernels`` (setuptools package-dir mapping).

Kept light on purpose: importing this package imports neither Triton nor any kernel. Import the kernel
modules themselves (``from distwgrad.kernels import grouped_gemm``); ``distwgrad.ops`` does that only
for CUDA tensors. The kernels' tuning, one frozen dataclass per kernel family, is here, with the one way
tests and benchmarks override it (``with tuning(...)``; [Note: kernel tuning] in ``_tuning.py``).
"""

from ._tuning import (
    GroupedGemmFp8Tuning,
    GroupedGemmTuning,
    KernelTuning,
    QuantizeTuning,
    TokenLayoutTuning,
    current,
    tuning,
)

__all__ = ["tuning", "current", "KernelTuning", "GroupedGemmTuning", "GroupedGemmFp8Tuning", "QuantizeTuning",
           "TokenLayoutTuning"]
