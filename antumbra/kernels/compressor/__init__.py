"""Fused compressor (window softmax + weighted sum + RMSNorm + RoPE + store), and the step's writes
of its projections into the compression-state rows."""

from .reference import compress_reference, write_state_reference
from .state import write_state
from .triton import compress_windows

__all__ = ["compress_reference", "compress_windows", "write_state", "write_state_reference"]
