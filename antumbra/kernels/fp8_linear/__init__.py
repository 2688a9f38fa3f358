"""Dense linear with a DeepSeek-V4 FP8-block weight (e4m3 + UE8M0 per 128 x 128): dequantised in-kernel,
or at prefill sizes expanded to bf16 once and multiplied by cuBLAS."""

from .dequant import DEQUANT_CONFIG, DEQUANT_SWEEP, Fp8DequantConfig, dequant_fp8_into
from .reference import FP8_BLOCK, dequant_fp8_weight, fp8_linear_reference
from .triton import (
    DECODE_16_CONFIG,
    DECODE_32_CONFIG,
    DECODE_64_CONFIG,
    DENSE_MIN_TOKENS,
    GEMV_CONFIG,
    MID_CONFIG,
    PREFILL_CONFIG,
    Fp8LinearConfig,
    fp8_linear,
    fp8_linear_pair,
    pick_config,
    split_count,
    uses_dense,
)

__all__ = [
    "DECODE_16_CONFIG",
    "DECODE_32_CONFIG",
    "DECODE_64_CONFIG",
    "DENSE_MIN_TOKENS",
    "DEQUANT_CONFIG",
    "DEQUANT_SWEEP",
    "FP8_BLOCK",
    "GEMV_CONFIG",
    "MID_CONFIG",
    "PREFILL_CONFIG",
    "Fp8DequantConfig",
    "Fp8LinearConfig",
    "dequant_fp8_into",
    "dequant_fp8_weight",
    "fp8_linear",
    "fp8_linear_pair",
    "fp8_linear_reference",
    "pick_config",
    "split_count",
    "uses_dense",
]
