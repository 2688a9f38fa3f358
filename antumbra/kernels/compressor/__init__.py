"""Fused compressor (window softmax + weighted sum + RMSNorm + RoPE + store)."""

from .reference import compress_reference
from .triton import compress_windows

__all__ = ["compress_reference", "compress_windows"]
