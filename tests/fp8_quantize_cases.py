"""Helpers shared by the FP8 quantization tests (``test_fp8_quantize.py``: recipes and the reference;
``test_fp8_quantize_kernels.py``: the Triton kernels bit-exact against it). Not a test module: the tests
import it (pytest puts tests/ on the path; the interpreter child runs from there too).
"""

from __future__ import annotations

import torch

from distwgrad.fp8 import Quantized

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8S = (E4M3, E5M2)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two fp8 or fp32 tensors, where any NaN equals any NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = torch.uint8 if a.element_size() == 1 else torch.int32
    nan = a.float().isnan() & b.float().isnan()
    return bool(((a.view(view) == b.view(view)) | nan).all())


def assert_same(k: Quantized, r: Quantized, what: str = "") -> None:
    assert k.block == r.block and tuple(k.shape) == tuple(r.shape) and k.orig_dtype == r.orig_dtype, what
    assert k.data.is_contiguous(), what
    assert bits_equal(k.data.cpu(), r.data.cpu()), f"fp8 data differs {what}"
    assert bits_equal(k.scale_inv.cpu(), r.scale_inv.cpu()), f"scale_inv differs {what}"


def wide_range(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random values spanning ~6 decades across columns (exercises per-block scales and subnormals)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if len(shape) == 2:
        x = x * torch.logspace(-3, 3, shape[1])
    return x.to(dtype)
