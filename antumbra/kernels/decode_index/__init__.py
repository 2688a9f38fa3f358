"""The fixed-shape decode step's row indices (window, compressed entries, closing windows)."""

from .reference import rate_index_reference, window_index_reference
from .triton import rate_index, window_index

__all__ = ["rate_index", "rate_index_reference", "window_index", "window_index_reference"]
