"""HiSparse page-in: a decode step's selected compressed rows, host tier -> the device hot buffers."""

from .reference import gather_rows_reference
from .triton import gather_rows

__all__ = ["gather_rows", "gather_rows_reference"]
