"""HiSparse: the C4 pool on a host tier, with a small per-request hot buffer on the device.

With HiSparse on, every CSA layer's compressed rows (`slot // 4`) live in host
memory (pinned when a GPU is present): the *host tier* is the pool itself, so
ShadowRadix keeps cached prefixes' C4 rows there and any request can page them in.
The indexer keys stay on the device, whole: they are small and the top-k reads
all of them.

Each running request owns one *hot buffer* of `rows_per_request` device rows per
CSA layer. A decode step's indexer top-k names the C4 rows the attention will
read; `gather` makes them resident:
  1. rows already in the buffer are hits and become most recently used;
  2. each miss takes the least recently used slot not needed by this step and is
     copied host -> device;
  3. the attention reads the buffer through the returned slot indices (the
     indirection table), never the host tier.
New compressed rows are written to the host tier only (write-through, off the
compute stream: `host_tier.HostTierWriter`); a row is brought in the first time a
top-k asks for it. Prefill chunks, whose tokens together may select more rows than
a buffer holds, bypass the buffers: a general step stages each long chunk's rows
on the device in bulk, once per CSA layer (`replicas/model/hot_stage.py`), and a
chunk of 2 to 31 tokens reads its selected rows from the host tier directly.

The fixed-shape decode step (CUDA graphs) pages rows in on the device instead, with no host
bookkeeping: after each CSA layer's top-k, `kernels/hot_gather` copies the selected rows from
the host tier (through its device mapping, `host_tier.py`) into the first `index_topk` rows of
the request's buffer, in top-k order, and the attention reads them there. Such a step leaves the
buffer's host-side residency maps stale; it marks the buffer (`mark_overwritten`) and the next
`gather` forgets what the maps held before trusting them. Rows it copies are counted on the
device (`rows_copied_on_device`), so counting never waits for the step.

Invariants (checked by `check_integrity`): in every buffer and layer, the
row -> slot map and the slot -> row array agree, and no two slots hold one row.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .row_format import RowFormat


@dataclass
class HiSparseCounters:
    hits: int = 0
    misses: int = 0
    rows_copied: int = 0


class HotBuffers:
    def __init__(
        self,
        layers: tuple[int, ...],
        row_format: RowFormat,
        rows_per_request: int,
        max_requests: int,
        device: torch.device,
    ) -> None:
        """`row_format`: the CSA pools' (rows are copied as stored, never decoded here)."""
        self.layers = layers
        self.row_format = row_format
        self.rows_per_request = rows_per_request
        self.max_requests = max_requests
        total = rows_per_request * max_requests
        self.rows = {
            layer: torch.zeros(total, row_format.width, dtype=row_format.dtype, device=device)
            for layer in layers
        }
        self._free = list(range(max_requests - 1, -1, -1))
        # (buffer, layer) -> OrderedDict host_row -> slot, in LRU order (oldest first)
        self._resident: dict[tuple[int, int], OrderedDict[int, int]] = {}
        self._slot_row: dict[tuple[int, int], list[int]] = {}
        # Times each buffer was allocated: another rank mirroring these buffers resets one whose
        # generation changed (replicas/parallel/step.py).
        self.generation = [0] * max_requests
        self.counters = HiSparseCounters()
        # Buffers a fixed-shape decode step wrote since their maps were last reset.
        self._overwritten = [False] * max_requests
        # [1] int64 on the buffers' device: rows the fixed-shape step's page-ins copied.
        self.rows_copied_on_device = torch.zeros(1, dtype=torch.long, device=device)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.rows.values())

    def base(self, buffer: int) -> int:
        """First row of `buffer` in each layer's `rows`."""
        return buffer * self.rows_per_request

    def mark_overwritten(self, buffer: int) -> None:
        """A device-side page-in is about to rewrite `buffer`'s rows (O(1): the maps reset lazily)."""
        self._overwritten[buffer] = True

    def rows_copied(self) -> int:
        """Rows paged in so far by both paths (reads the device counter: synchronises)."""
        return self.counters.rows_copied + int(self.rows_copied_on_device.item())

    def allocate(self) -> int:
        buffer = self._free.pop()
        self.generation[buffer] += 1
        self.reset(buffer)
        return buffer

    def reset(self, buffer: int) -> None:
        """Empty `buffer`'s residency maps (no row resident); its owner is unchanged."""
        for layer in self.layers:
            self._resident[(buffer, layer)] = OrderedDict()
            self._slot_row[(buffer, layer)] = [-1] * self.rows_per_request
        self._overwritten[buffer] = False

    def release(self, buffer: int) -> None:
        for layer in self.layers:
            del self._resident[(buffer, layer)]
            del self._slot_row[(buffer, layer)]
        self._free.append(buffer)

    def gather(
        self, layer: int, buffer: int, host_rows: torch.Tensor, tier: torch.Tensor
    ) -> torch.Tensor:
        """Make `host_rows` (any shape, int64, -1 = unused) resident; -> device slots, same shape.

        tier: [R, W] the layer's host tier as the buffers' device addresses it (`device_view`); misses
        are copied from it by the device, in stream order, so the caller orders pending writes of
        the tier first (`CompressorPool.order_reads`). Unused entries map to slot 0 of the buffer;
        callers mask them.
        """
        wanted = [r for r in dict.fromkeys(host_rows.flatten().tolist()) if r >= 0]
        if len(wanted) > self.rows_per_request:
            raise ValueError(
                f"{len(wanted)} rows wanted at once, the hot buffer holds {self.rows_per_request}"
            )
        if self._overwritten[buffer]:
            self.reset(buffer)  # a fixed-shape step replaced the rows the maps describe
        resident = self._resident[(buffer, layer)]
        slot_row = self._slot_row[(buffer, layer)]
        needed = set(wanted)
        misses = [r for r in wanted if r not in resident]
        self.counters.hits += len(wanted) - len(misses)
        self.counters.misses += len(misses)
        if misses:
            free_slots = [s for s, r in enumerate(slot_row) if r == -1]
            victims = [r for r in resident if r not in needed]  # LRU order, oldest first
            slots = []
            for _ in misses:
                if free_slots:
                    slots.append(free_slots.pop(0))
                else:
                    victim = victims.pop(0)
                    slots.append(resident.pop(victim))
            for row, slot in zip(misses, slots, strict=True):
                resident[row] = slot
                slot_row[slot] = row
            base = buffer * self.rows_per_request
            src = torch.tensor(misses, dtype=torch.long, device=tier.device)
            dst = torch.tensor(slots, dtype=torch.long, device=self.rows[layer].device) + base
            self.rows[layer][dst] = tier[src]
            self.counters.rows_copied += len(misses)
        for row in wanted:
            resident.move_to_end(row)
        base = buffer * self.rows_per_request
        lookup = {row: base + slot for row, slot in resident.items()}
        flat = [lookup.get(r, base) for r in host_rows.flatten().tolist()]
        return torch.tensor(flat, dtype=torch.long, device=self.rows[layer].device).view(host_rows.shape)

    def check_integrity(self) -> None:
        for key, resident in self._resident.items():
            slot_row = self._slot_row[key]
            assert len(set(resident.values())) == len(resident), f"{key}: two rows share a slot"
            for row, slot in resident.items():
                assert slot_row[slot] == row, f"{key}: slot table disagrees for row {row}"
            assert sum(1 for r in slot_row if r >= 0) == len(resident), f"{key}: stale slot entries"
        assert len(set(self._free)) == len(self._free), "a hot buffer is free twice"
        in_use = {buffer for buffer, _ in self._resident}
        assert not in_use & set(self._free), "a hot buffer is both free and in use"
        assert len(in_use) + len(self._free) == self.max_requests, "hot buffers leaked"
