"""Device-resident penalty state: each penalised request's token counts live on the device.

A request whose sampling adjusts logits (`penalties.py` defines the arithmetic: bias, then the
repetition factor, then the frequency / presence subtraction) or that is still short of
`min_tokens` gets a *slot* the first time it samples: a row of each table in
`kernels/sampling.SlotTables`, on the engine's device:

  * `counts` [slots, V] int32, its generated-token counts, and `seen` [slots, V] uint8, its
    prompt-or-output membership (what the repetition penalty reads). The prompt is scattered
    into `seen` once, when the slot is filled; after that `record` adds each sampled token on the
    device (`index_put_` of +1 at [slot, token]) from the sampled token tensor itself, so no
    token travels to the host and back and the update can follow a draw that stays on the device.
    Memory: V * (4 + 1) bytes per slot (646 KB over the V4 vocabulary), plus its list.
  * its scalars (frequency, presence, repetition factor and inverse, min_tokens) and a sorted
    list of its biased and banned tokens (`logit_bias` and, with `min_tokens`, the stop and
    end-of-sequence ids), uploaded once. A list rather than a dense [slots, V] bias row: a
    request biases a handful of tokens, so the list costs bytes where a row would cost 4 * V
    per slot and a read of 4 * V per step; the kernel looks it up only in the tiles it touches.

Slots are freed when their request finishes, aborts or fails (`release`, from the scheduler's
finish hook) and zeroed when filled again, so a slot's next owner starts clean. The tables start
small and double as slots are taken, up to `max_slots` (the engine passes its `max_num_seqs`, the
most rows a step samples); past it, a slot whose request is not in the step is evicted (least
recently used) and refilled from the request's host history when it samples again. A step with
more penalised rows than `max_slots` is refused with a ValueError.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from antumbra.kernels.sampling import SlotTables, empty_tables, list_segments, search_for
from antumbra.kernels.sampling.counts import count_drawn, count_drawn_reference
from antumbra.kernels.sampling.resident import READS_COUNTS, READS_SEEN

from .sampling_params import SamplingParams

_PENDING = -1  # an output token still on the device (overlap scheduling): counted there, not here
_FIRST_SLOTS = 8
_FIRST_WIDTH = 16


class PenalisedRow(NamedTuple):
    """What a row's slot is filled from: its request's key, params and host token history."""

    key: str
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


class ResidentRows(NamedTuple):
    """A step's rows in the state: `slots` [B] int32 on the host (-1: the row has none) and the
    binary-search depth its slots' lists need (`kernels/sampling.search_for`)."""

    state: PenaltyState
    slots: Tensor
    search: int


def needs_slot(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a row adjusts its logits this step: penalties or a bias, or a min_tokens ban."""
    return params.adjusts_logits or num_output_tokens < params.min_tokens


def _reads(p: SamplingParams) -> int:
    """Which of the slot's tables its penalties read (`kernels/sampling.SlotTables.ints`)."""
    counts = READS_COUNTS if p.frequency_penalty or p.presence_penalty else 0
    return counts | (READS_SEEN if p.repetition_penalty != 1 else 0)


class PenaltyState:
    """The slot tables of one engine, on `device`, over a `vocab`-token vocabulary. Not
    thread-safe: the engine core's thread owns it."""

    def __init__(
        self, vocab: int, device: torch.device, eos_token_ids: Sequence[int], max_slots: int
    ) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be at least 1, got {max_slots}")
        self.vocab = vocab
        self.device = device
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_slots = max_slots
        self.capacity = 0
        self._tables: SlotTables | None = None
        self._owner: dict[str, int] = {}
        self._free: list[int] = []
        self._used_at: dict[int, int] = {}  # slot -> the last step that used it (eviction order)
        self._search: dict[int, int] = {}  # slot -> halvings its list needs
        self._step = 0
        self.num_fills = 0
        self.num_evictions = 0

    def ensure_tables(self) -> SlotTables:
        """The tables, made at their first size if no slot has been taken yet."""
        if self._tables is None:
            self._grow(min(self.max_slots, _FIRST_SLOTS))
        return self.tables

    def reserve(self) -> None:
        """Take the tables' full size now (a captured graph reads them where they are)."""
        if self.capacity < self.max_slots:
            self._grow(self.max_slots)

    @property
    def tables(self) -> SlotTables:
        if self._tables is None:
            raise RuntimeError("no slot has been filled yet")
        return self._tables

    def slot_of(self, key: str) -> int | None:
        return self._owner.get(key)

    # ------------------------------------------------------------------ a step's rows
    def rows_for(self, rows: Sequence[PenalisedRow | None]) -> ResidentRows | None:
        """Slots for the rows that need one (a slot is filled the first time its key comes);
        None when no row does. rows[i] None: row i needs no slot."""
        if all(r is None for r in rows):
            return None
        wanted = [r for r in rows if r is not None]
        if len({r.key for r in wanted}) > self.max_slots:
            raise ValueError(f"a step with {len(wanted)} penalised rows exceeds the penalty state's "
                             f"{self.max_slots} slots")
        self._step += 1
        keys = {r.key for r in wanted}
        slots = []
        for row in rows:
            if row is None:
                slots.append(-1)
                continue
            slot = self._owner.get(row.key)
            if slot is None:
                slot = self._take(keys)
                try:
                    self._fill(slot, row)
                except Exception:
                    self._free.append(slot)
                    raise
                self._owner[row.key] = slot
            self._used_at[slot] = self._step
            slots.append(slot)
        search = max(self._search[s] for s in slots if s >= 0)
        return ResidentRows(self, torch.tensor(slots, dtype=torch.int32), search)

    def record(self, tokens: Tensor, rows: ResidentRows | None) -> None:
        """Count the step's sampled tokens [B] int64 (on the device) into their rows' slots, on
        the device; rows without a slot write a scratch row no slot reads."""
        if rows is None:
            return
        self.count(tokens, rows.slots.to(self.device, non_blocking=True))

    def count(self, tokens: Tensor, slots: Tensor) -> None:
        """tokens [B] int64 and slots [B] integer (-1: none, counted into the scratch row no slot
        reads), both on the device: device work only, so a captured graph can count from static
        buffers. One launch on CUDA (`count_drawn`), the reference's scatters elsewhere."""
        tables = self.tables
        count = count_drawn if tokens.is_cuda else count_drawn_reference
        count(tokens, slots, tables.counts, tables.seen, self.capacity)

    def release(self, key: str) -> None:
        """Free the key's slot (a no-op without one); its rows are zeroed when it is filled again."""
        slot = self._owner.pop(key, None)
        if slot is not None:
            self._used_at.pop(slot, None)
            self._search.pop(slot, None)
            self._free.append(slot)

    def check_integrity(self, live: Collection[str] | None = None) -> None:
        """Every slot is owned once or free; with `live`, every owner is a live key."""
        owned = sorted(self._owner.values())
        if len(set(owned)) != len(owned) or set(owned) & set(self._free):
            raise AssertionError(f"penalty slots owned twice or owned and free: {owned} / {self._free}")
        if sorted(owned + self._free) != list(range(self.capacity)):
            raise AssertionError(f"penalty slots lost: {len(owned)} owned + {len(self._free)} free "
                                 f"of {self.capacity}")
        if live is not None:
            stale = sorted(set(self._owner) - set(live))
            if stale:
                raise AssertionError(f"penalty slots held by finished requests: {stale}")

    # ------------------------------------------------------------------ slots
    def _take(self, step_keys: set[str]) -> int:
        if not self._free and self.capacity < self.max_slots:
            self._grow(min(self.max_slots, max(_FIRST_SLOTS, 2 * self.capacity)))
        if self._free:
            return self._free.pop()
        by_age = sorted((self._used_at.get(s, 0), s) for k, s in self._owner.items() if k not in step_keys)
        victim = by_age[0][1]
        key = next(k for k, s in self._owner.items() if s == victim)
        self.release(key)
        self.num_evictions += 1
        return self._free.pop()

    def _grow(self, capacity: int) -> None:
        """Tables for `capacity` slots plus the scratch row, the filled slots copied over."""
        old, width = self._tables, _FIRST_WIDTH if self._tables is None else self._tables.list_tok.shape[1]
        new = empty_tables(capacity + 1, self.vocab, width, self.device)
        if old is not None:
            for mine, theirs in zip(new, old, strict=True):
                mine[: self.capacity].copy_(theirs[: self.capacity])
        self._tables = new
        self._free.extend(range(capacity - 1, self.capacity - 1, -1))  # lowest slot taken first
        self.capacity = capacity

    def _widen(self, width: int) -> None:
        old = self.tables
        new_width = old.list_tok.shape[1]
        while new_width < width:
            new_width *= 2
        tok = torch.full((old.list_tok.shape[0], new_width), -1, dtype=torch.int32, device=self.device)
        val = torch.zeros(old.list_val.shape[0], 2, new_width, dtype=torch.float32, device=self.device)
        tok[:, : old.list_tok.shape[1]] = old.list_tok
        val[:, :, : old.list_tok.shape[1]] = old.list_val
        self._tables = old._replace(list_tok=tok, list_val=val)

    def _fill(self, slot: int, row: PenalisedRow) -> None:
        """Zero the slot and write the row's history, scalars and list into it."""
        tokens, bias, ban = self._list_of(row.params)
        if tokens.shape[0] > self.tables.list_tok.shape[1]:
            self._widen(tokens.shape[0])
        tables, device = self.tables, self.device
        tables.counts[slot].zero_()
        tables.seen[slot].zero_()
        prompt = torch.tensor(list(row.prompt_token_ids), dtype=torch.long)
        outputs = torch.tensor([t for t in row.output_token_ids if t != _PENDING], dtype=torch.long)
        history = torch.cat([prompt, outputs]).to(device)
        tables.seen[slot].index_fill_(0, history, 1)
        if outputs.numel():
            tables.counts[slot] += torch.bincount(outputs, minlength=self.vocab).to(device, torch.int32)
        p = row.params
        factor = p.repetition_penalty
        as_f32 = torch.tensor([factor, 1.0 / factor], dtype=torch.float32).double().tolist()
        tables.scalars[slot] = torch.tensor([p.frequency_penalty, p.presence_penalty, *as_f32],
                                            dtype=torch.float64).to(device)
        tables.ints[slot] = torch.tensor([p.min_tokens, _reads(p)], dtype=torch.int32).to(device)
        n = tokens.shape[0]
        tok = torch.full((tables.list_tok.shape[1],), -1, dtype=torch.int32)
        tok[:n] = tokens.to(torch.int32)
        val = torch.zeros(2, tables.list_tok.shape[1], dtype=torch.float32)
        val[0, :n], val[1, :n] = bias, ban
        seg = list_segments(tokens, self.vocab)
        tables.list_tok[slot] = tok.to(device)
        tables.list_val[slot] = val.to(device)
        tables.list_seg[slot] = seg.to(device)
        self._search[slot] = search_for(seg)
        self.num_fills += 1

    def _list_of(self, p: SamplingParams) -> tuple[Tensor, Tensor, Tensor]:
        """(tokens [n] int64 sorted, bias [n] float32, ban [n] float32) of the params' list."""
        biased = dict(p.logit_bias)
        banned = set(self.eos_token_ids).union(p.stop_token_ids) if p.min_tokens > 0 else set()
        tokens = sorted(set(biased) | banned)
        if tokens and tokens[-1] >= self.vocab:
            raise ValueError(f"token id {tokens[-1]} (stop, eos, logit_bias) is outside the vocabulary "
                             f"[0, {self.vocab})")
        bias = torch.tensor([biased.get(t, 0.0) for t in tokens], dtype=torch.float32)
        ban = torch.tensor([1.0 if t in banned else 0.0 for t in tokens], dtype=torch.float32)
        return torch.tensor(tokens, dtype=torch.long), bias, ban

