"""Dense linear with a DeepSeek-V4 FP8-block weight (e4m3 + UE8M0 per 128 x 128), dequantised in-kernel."""

from .reference import FP8_BLOCK, dequant_fp8_weight, fp8_linear_reference
from .triton import (
    DECODE_16_CONFIG,
    DECODE_32_CONFIG,
    DECODE_64_CONFIG,
    GEMV_CONFIG,
    MID_CONFIG,
    PREFILL_CONFIG,
    Fp8LinearConfig,
    fp8_linear,
    pick_config,
    split_count,
)

__all__ = [
    "DECODE_16_CONFIG",
    "DECODE_32_CONFIG",
    "DECODE_64_CONFIG",
    "FP8_BLOCK",
    "GEMV_CONFIG",
    "MID_CONFIG",
    "PREFILL_CONFIG",
    "Fp8LinearConfig",
    "dequant_fp8_weight",
    "fp8_linear",
    "fp8_linear_reference",
    "pick_config",
    "split_count",
]
