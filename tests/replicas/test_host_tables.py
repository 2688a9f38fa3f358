"""The fixed-shape step's host block tables: each row holds its request's pages, -1 past them and on
padded rows; a chunk's consecutive rows share one write; unchanged rows are not rewritten."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from antumbra.replicas.decode_rows import DecodeRow
from antumbra.replicas.host_tables import HostTables


def _request(pages: list[int]) -> SimpleNamespace:
    return SimpleNamespace(kv=SimpleNamespace(vpages=pages))


def _rows(requests: list[SimpleNamespace], counts: list[int]) -> list[DecodeRow]:
    return [DecodeRow(r, position, 0) for r, n in zip(requests, counts, strict=True) for position in range(n)]


def _expected(requests, counts, size: int, width: int) -> torch.Tensor:
    want = torch.full((size, width), -1, dtype=torch.long)
    row = 0
    for r, n in zip(requests, counts, strict=True):
        for _ in range(n):
            want[row, : len(r.kv.vpages)] = torch.tensor(r.kv.vpages)
            row += 1
    return want


def test_rows_hold_their_requests_pages_and_padding_holds_none():
    tables = HostTables(torch.zeros(8, 5, dtype=torch.long))
    a, b = _request([3, 1]), _request([7, 8, 9])
    tables.write(_rows([a, b], [1, 4]), 8)
    assert torch.equal(tables.tables, _expected([a, b], [1, 4], 8, 5))
    device = torch.zeros(8, 5, dtype=torch.long)
    tables.flush(device)
    assert torch.equal(device, tables.tables) and not tables.dirty


def test_unchanged_rows_are_not_rewritten_and_changed_ones_are():
    tables = HostTables(torch.zeros(8, 5, dtype=torch.long))
    a, b = _request([3, 1]), _request([7, 8, 9])
    tables.write(_rows([a, b], [1, 4]), 8)
    tables.flush(torch.zeros(8, 5, dtype=torch.long))
    tables.tables[7, 0] = 42  # a marker a rewrite of the padding would clear
    tables.write(_rows([a, b], [1, 4]), 8)
    assert not tables.dirty and tables.tables[7, 0] == 42
    b.kv.vpages.append(11)  # b crossed into a new page
    tables.write(_rows([a, b], [1, 4]), 8)
    assert tables.dirty
    want = _expected([a, b], [1, 4], 8, 5)
    want[7, 0] = 42
    assert torch.equal(tables.tables, want)
    # The rows move: a chunk of b first, then a; the padding shrinks.
    tables.write(_rows([b, a], [6, 1]), 8)
    want = _expected([b, a], [6, 1], 8, 5)
    want[7, 0] = 42
    assert torch.equal(tables.tables, want)
    tables.write([], 8)  # all padding (as when graphs are captured)
    assert torch.equal(tables.tables, torch.full((8, 5), -1, dtype=torch.long))
