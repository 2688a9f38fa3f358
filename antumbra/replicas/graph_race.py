"""The race a fixed-shape decode step ends with, over static buffers a CUDA graph replays.

The host stages each step's sampling rows into one [7, B] int32 device buffer (from pinned
memory, in one copy): rows 0-3 the race's keys (`kernels/sampling.pack_rows`), row 4 the min_p
slack's float32 bits (-inf: none), row 5 each row's penalty slot for the step's own draw and row
6 the same slots for a draw taken after the replay (`race(late=True)`: a structured-output step
whose masks come later). A slot is -1 for a row without one, for padded rows, and in row 5 when
the step's draw is not final (its tokens are drawn again outside the graph), so nothing is
counted twice.

Without a penalty state the race is the plain one (`race_sample`). With one it is the slot race
(`race_sample_slots`, which draws exactly the plain race's token for a row without a slot)
followed by the count of the drawn tokens into their rows' slots (`PenaltyState.count`): a
penalised row's draw and its count both happen on the device, inside the replay, with no host
round trip, so penalised rows overlap (`overlap.py`) as plain rows do. The slot tables are
reserved at their cap when a graph is captured, since their addresses are baked into it; a list
widened since moves them, and `stale` tells the graphs to capture again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from antumbra.kernels.sampling import (
    AdjustedWorkspace,
    RaceWorkspace,
    SlotTables,
    race_sample,
    race_sample_reference,
    race_sample_slots,
    race_sample_slots_reference,
)
from antumbra.kernels.sampling.resident import SEARCH_BUCKETS

from .penalty_state import PenaltyState
from .sampler import SamplingRows

_NO_SLACK = torch.tensor(float("-inf"), dtype=torch.float32).view(torch.int32).item()


class GraphRace:
    """Static race buffers for up to `batch` rows of a `vocab`-wide step on `device`; `use_kernel`
    False races with the kernels' PyTorch references (the plan's sampler off CUDA), which draw the
    same tokens."""

    def __init__(self, batch: int, vocab: int, device: torch.device, penalties: PenaltyState | None,
                 use_graphs: bool, use_kernel: bool = True) -> None:
        self.penalties = penalties
        self.use_kernel = use_kernel
        if penalties is not None and use_graphs:
            penalties.reserve()  # the tables a captured graph reads must never move
        self._staged = torch.zeros(7, batch, dtype=torch.int32, device=device)
        # Pinned: a copy from pageable memory may wait for the stream (the graph before it).
        self._host = torch.zeros(7, batch, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._blank = _blank(batch)  # made once: every step starts its slack and slots from it
        self._host[4:] = self._blank
        self._staged.copy_(self._host)
        self.rows = self._staged[:4]
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=device)
        self._no_cut = torch.full((batch,), float("-inf"), dtype=torch.float32, device=device)
        self._race_ws = RaceWorkspace(batch, vocab, device) if use_graphs else None
        self._slot_ws = AdjustedWorkspace(batch, vocab, device) if penalties is not None else None
        self._tables: SlotTables | None = None  # the tables the last race read

    def draws(self, rows: SamplingRows) -> bool:
        """Whether this race can draw the rows' tokens: no row cuts by top-k / top-p, and without a
        penalty state no row adjusts its logits or is cut by min_p (`plain`)."""
        return rows.in_graph if self.penalties is not None else rows.plain

    def stage(self, rows: SamplingRows | None, count: int, final: bool) -> None:
        """Write the rows' keys, slack and slots to the pinned buffer and copy it to the device;
        `final`: the step's own draw is its tokens (else its slots stay -1: nothing counted).
        `rows` None: nobody reads the step's draw (its logits are sampled elsewhere), so its rows
        race with zero keys and no slot."""
        host = self._host
        host[4:] = self._blank
        if rows is None:
            host[:4, :count] = 0
            self._staged.copy_(host, non_blocking=True)
            return
        host[:4, :count] = rows.packed
        if rows.slack is not None:
            host[4, :count] = rows.slack.view(torch.int32)
        if rows.resident is not None:
            host[6, :count] = rows.resident.slots
            if final:
                host[5, :count] = rows.resident.slots
        self._staged.copy_(host, non_blocking=True)

    @staticmethod
    def draws_at(rows: SamplingRows) -> bool:
        """Whether `stage_at` takes the rows: plain (no ban, adjustment or cut), with no penalty slots
        and no min_p slack to stage."""
        return rows.plain and rows.resident is None and rows.slack is None

    def stage_at(self, rows: SamplingRows, at: Sequence[int], count: int) -> None:
        """Rows `draws_at` takes, drawn at positions `at` of a step of `count` rows (a prompt rows
        step's sampling rows); the other positions race with zero keys, unread; nothing is counted."""
        if not self.draws_at(rows):
            raise ValueError("only plain rows without penalty slots or min_p are drawn at chosen positions")
        host = self._host
        host[4:] = self._blank
        host[:4, :count] = rows.spread(at, count)
        self._staged.copy_(host, non_blocking=True)

    def blank(self) -> Tensor:
        """Clear the staged slots (a warm-up run counts nothing); -> what they held, to restore."""
        saved = self._staged[4:].clone()
        self._staged[4:] = _blank(self._staged.shape[1]).to(self._staged.device)
        return saved

    def restore(self, saved: Tensor) -> None:
        self._staged[4:] = saved

    def stale(self) -> bool:
        """Whether the slot tables moved since the last race read them (a captured graph holds the
        old addresses)."""
        state = self.penalties
        return state is not None and self._tables is not None and state.tables is not self._tables

    def race(self, logits: Tensor, size: int, late: bool = False) -> None:
        """Draw rows [:size] of logits [>= size, V] into `tokens`, counting the slotted rows'
        draws; `late`: the draw after the replay (the slots of staged row 6)."""
        state = self.penalties
        out, rows, no_cut = self.tokens[:size], self.rows[:, :size], self._no_cut[:size]
        if state is None:
            if self.use_kernel:
                race_sample(logits, rows, no_cut, out=out, workspace=self._race_ws)
            else:
                out.copy_(race_sample_reference(logits[:size], rows, no_cut))
            return
        tables = self._tables = state.ensure_tables()
        slack = self._staged[4, :size].view(torch.float32)
        slots = self._staged[6 if late else 5, :size]
        if self.use_kernel:
            race_sample_slots(logits, rows, None, slack, slots, tables, SEARCH_BUCKETS[-1],
                              out=out, workspace=self._slot_ws)
        else:
            out.copy_(race_sample_slots_reference(logits[:size], rows, no_cut, slots, tables, slack))
        state.count(out, slots)


def _blank(batch: int) -> Tensor:
    """[3, batch] int32: no slack, no slot."""
    blank = torch.full((3, batch), -1, dtype=torch.int32)
    blank[0] = _NO_SLACK
    return blank
