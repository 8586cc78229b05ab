"""FP8 numerics: recipes (which format, which scaling) and the torch quantization reference.

``recipe`` says what to do; ``quantize`` does it in plain torch on any device (the oracle of the
Triton kernels in ``distwgrad.kernels.quantize`` and the CPU emulation path of FP8 GEMMs).
"""

from distwgrad.fp8.quantize import (
    Quantized,
    QuantizedExperts,
    compute_amax,
    compute_scale,
    dequantize,
    fp8_matmul_reference,
    quantize_blockwise,
    quantize_per_tensor,
    quantize_rowwise_and_columnwise,
    roundtrip_error_bound,
    transpose_quantized,
)
from distwgrad.fp8.recipe import (
    FP8_DTYPES,
    BlockwiseScaling,
    Fp8Format,
    MMParams,
    PerTensorScaling,
    Recipe,
    current_first_microbatch,
    current_recipe,
    fp8_autocast,
    fp8_format,
    microbatch,
    split_accumulator,
)

__all__ = [
    "PerTensorScaling", "BlockwiseScaling", "MMParams", "Recipe", "split_accumulator", "fp8_autocast",
    "current_recipe", "microbatch", "current_first_microbatch",
    "Fp8Format", "fp8_format", "FP8_DTYPES",
    "Quantized", "QuantizedExperts", "compute_amax", "compute_scale", "quantize_per_tensor", "quantize_blockwise",
    "quantize_rowwise_and_columnwise", "dequantize", "transpose_quantized", "fp8_matmul_reference",
    "roundtrip_error_bound",
]
