"""The host copy of the fixed-shape step's block tables, rewritten only where a row's pages changed.

Row r of `tables` ([rows, max_pages] int64, pinned on CUDA) holds the virtual pages of the request
whose token is row r of the step, -1 past its pages and for padded rows. A decoding request gains a
page every page_size tokens, so most steps rewrite nothing: comparing page lists is far cheaper than
a tensor write per row. The consecutive rows of one chunk (a verify chunk, or a prompt chunk run as
rows) share one table, written once for all of them.
"""

from __future__ import annotations

import torch

from .decode_rows import DecodeRow


class HostTables:
    def __init__(self, tables: torch.Tensor) -> None:
        self.tables = tables
        self.dirty = True  # the device copy is behind
        self._row_pages: dict[int, list[int]] = {}  # what each row holds

    def write(self, rows: list[DecodeRow], size: int) -> None:
        """The step's rows, then padding up to `size`."""
        first = 0
        for b in range(1, len(rows) + 1):
            if b == len(rows) or rows[b].request is not rows[first].request:
                self._write_span(first, b, rows[first].request.kv.vpages)
                first = b
        self._write_span(len(rows), size, [])

    def flush(self, device_tables: torch.Tensor) -> None:
        """Copy to the device's tables when a row changed since the last copy (asynchronously)."""
        if self.dirty:
            device_tables.copy_(self.tables, non_blocking=True)
            self.dirty = False

    def _write_span(self, start: int, stop: int, pages: list[int]) -> None:
        if all(self._row_pages.get(row) == pages for row in range(start, stop)):
            return
        kept = list(pages)
        for row in range(start, stop):
            self._row_pages[row] = kept
        self.dirty = True
        span = self.tables[start:stop]
        span.fill_(-1)
        if kept:
            span[:, : len(kept)] = torch.tensor(kept, dtype=torch.long)
