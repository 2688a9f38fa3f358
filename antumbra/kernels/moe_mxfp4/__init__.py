"""Routed MoE experts with MXFP4 weights dequantised in-kernel (gate/up + SwiGLU, down, combine)."""

from .grouped import DEQUANT_CONFIG, DEQUANT_SWEEP, Mxfp4DequantConfig, dequant_mxfp4_into
from .reference import dequant_mxfp4, moe_mxfp4_reference, sum_slots_reference
from .slots import sum_slots
from .triton import (
    DECODE_TILES,
    PAIR_TILES,
    PREFILL_TILES,
    SMALL_BATCH_TILES,
    MoeTiles,
    align_pairs,
    moe_mxfp4,
    pick_tiles,
)

__all__ = [
    "DECODE_TILES",
    "DEQUANT_CONFIG",
    "DEQUANT_SWEEP",
    "PAIR_TILES",
    "PREFILL_TILES",
    "SMALL_BATCH_TILES",
    "MoeTiles",
    "Mxfp4DequantConfig",
    "align_pairs",
    "dequant_mxfp4",
    "dequant_mxfp4_into",
    "moe_mxfp4",
    "moe_mxfp4_reference",
    "pick_tiles",
    "sum_slots",
    "sum_slots_reference",
]
