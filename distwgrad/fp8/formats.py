"""The float8 formats the quantizers know: their dtype, largest value, mantissa and exponent range."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Fp8Format", "fp8_format", "FP8_DTYPES"]


@dataclass(frozen=True)
class Fp8Format:
    """The constants of one float8 format that the quantizers need.

    Attributes:
        dtype: the torch float8 dtype.
        max: largest finite value (448 for E4M3FN, 57344 for E5M2).
        mantissa_bits: explicit mantissa bits (3 or 2). Round-to-nearest has relative error at most
            ``2 ** -(mantissa_bits + 1)`` for normal values.
        min_normal_exp: unbiased exponent of the smallest normal value (-6 or -14). Below
            ``2 ** min_normal_exp`` values are subnormal, spaced ``2 ** (min_normal_exp - mantissa_bits)``.
    """

    dtype: torch.dtype
    max: float
    mantissa_bits: int
    min_normal_exp: int

    @property
    def subnormal_step(self) -> float:
        """Spacing of the subnormal values (absolute rounding error is at most half of it)."""
        return 2.0 ** (self.min_normal_exp - self.mantissa_bits)


_FORMATS = {
    torch.float8_e4m3fn: Fp8Format(torch.float8_e4m3fn, 448.0, 3, -6),
    torch.float8_e5m2: Fp8Format(torch.float8_e5m2, 57344.0, 2, -14),
}
FP8_DTYPES = tuple(_FORMATS)


def fp8_format(dtype: torch.dtype) -> Fp8Format:
    """Returns the format constants of ``dtype``; ValueError for anything but E4M3FN / E5M2."""
    try:
        return _FORMATS[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"unsupported fp8 dtype {dtype!r}; expected one of {list(FP8_DTYPES)}") from None
