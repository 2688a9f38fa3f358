"""The Gumbel race with counter-based noise: one token per row, no generator state; and the race
over logits adjusted from per-slot device tables (penalties, logit bias, bans, min_p) in the same
two launches."""

from .reference import (
    adjust_reference,
    adjust_slots_reference,
    as_int32,
    gumbel_reference,
    min_p_floor_reference,
    pack_rows,
    race_sample_adjusted_reference,
    race_sample_reference,
    race_sample_slots_reference,
    row_keys_reference,
)
from .resident import (
    AdjustedWorkspace,
    SlotTables,
    empty_tables,
    list_segments,
    race_sample_slots,
    search_for,
    tiles,
)
from .triton import RaceWorkspace, race_sample

__all__ = [
    "AdjustedWorkspace",
    "RaceWorkspace",
    "SlotTables",
    "adjust_reference",
    "adjust_slots_reference",
    "empty_tables",
    "list_segments",
    "min_p_floor_reference",
    "race_sample_slots",
    "race_sample_slots_reference",
    "search_for",
    "tiles",
    "race_sample_adjusted_reference",
    "as_int32",
    "gumbel_reference",
    "pack_rows",
    "race_sample",
    "race_sample_reference",
    "row_keys_reference",
]
