"""The Gumbel race with counter-based noise: one token per row, no generator state; and the race
over sparsely adjusted logits (penalties, logit bias, bans, min_p) in the same two launches."""

from .adjusted import AdjustedWorkspace, entry_segments, race_sample_adjusted
from .reference import (
    adjust_reference,
    as_int32,
    gumbel_reference,
    min_p_floor_reference,
    pack_rows,
    race_sample_adjusted_reference,
    race_sample_reference,
    row_keys_reference,
)
from .triton import RaceWorkspace, race_sample

__all__ = [
    "AdjustedWorkspace",
    "RaceWorkspace",
    "adjust_reference",
    "entry_segments",
    "min_p_floor_reference",
    "race_sample_adjusted",
    "race_sample_adjusted_reference",
    "as_int32",
    "gumbel_reference",
    "pack_rows",
    "race_sample",
    "race_sample_reference",
    "row_keys_reference",
]
