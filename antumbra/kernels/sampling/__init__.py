"""The Gumbel race with counter-based noise: one token per row, no generator state."""

from .reference import as_int32, gumbel_reference, pack_rows, race_sample_reference, row_keys_reference
from .triton import RaceWorkspace, race_sample

__all__ = [
    "RaceWorkspace",
    "as_int32",
    "gumbel_reference",
    "pack_rows",
    "race_sample",
    "race_sample_reference",
    "row_keys_reference",
]
