"""Linears of a few tokens on full-width weights (bf16 / fp16 / fp32): one GEMV launch, split-K
finished in-kernel, for up to two weights that read the same input, written into indexed rows."""

from .reference import gemv_into_reference
from .triton import GEMV_MAX_TOKENS, GemvConfig, gemv, gemv_into, gemv_plan, takes_gemv

__all__ = ["GEMV_MAX_TOKENS", "GemvConfig", "gemv", "gemv_into", "gemv_into_reference", "gemv_plan",
           "takes_gemv"]
