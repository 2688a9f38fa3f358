"""The decode-index kernels against their references (Triton interpreter on CPU): random page tables
with holes, SWA pages missing, padded rows, positions at and across page and window boundaries."""

from __future__ import annotations

import pytest
import torch

from antumbra.kernels.decode_index import (
    rate_index,
    rate_index_reference,
    window_index,
    window_index_reference,
)

PAGE, WINDOW, MAX_LEN = 32, 8, 200


def _state(seed: int, rows: int):
    g = torch.Generator().manual_seed(seed)
    max_pages = -(-MAX_LEN // PAGE)
    num_vpages = 40
    tables = torch.randint(0, num_vpages, (rows, max_pages), generator=g)
    lengths = torch.randint(1, max_pages + 1, (rows,), generator=g)
    tables[torch.arange(max_pages)[None, :] >= lengths[:, None]] = -1
    swa_map = torch.randint(0, 30, (num_vpages,), generator=g)
    swa_map[torch.rand(num_vpages, generator=g) < 0.3] = -1  # pages whose SWA rows were released
    positions = torch.randint(0, MAX_LEN, (rows,), generator=g)
    positions[:3] = torch.tensor([0, PAGE - 1, 2 * PAGE])[: min(3, rows)]  # boundaries
    active = torch.rand(rows, generator=g) < 0.8
    return tables, swa_map, positions, active


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("rows", [1, 5, 9])
def test_window_index_matches_reference(seed, rows):
    tables, swa_map, positions, active = _state(seed, rows)
    got = window_index(tables, swa_map, positions, active, PAGE, WINDOW, 999)
    want = window_index_reference(tables, swa_map, positions, active, PAGE, WINDOW, 999)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)
    # Integer active flags (the decode path's packed inputs) mean the same.
    again = window_index(tables, swa_map, positions, active.long(), PAGE, WINDOW, 999)
    assert all(torch.equal(a, b) for a, b in zip(again, want, strict=True))


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("rate", [4, 16, 32])
def test_rate_index_matches_reference(seed, rate):
    tables, swa_map, positions, active = _state(seed, 7)
    # Positions that close a window of this rate, with and without a previous one.
    positions[3], positions[4] = rate - 1, 3 * rate - 1
    args = (tables, swa_map, positions, active, PAGE, rate, MAX_LEN // rate, 999, 555)
    got, want = rate_index(*args), rate_index_reference(*args)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)


def test_take_sources_is_its_reference_on_a_column_slice():
    """The draws of an overlapped launch into the next step's ids: rows with a source take it, rows
    with -1 keep the host's id, columns past the slice stay untouched."""
    from antumbra.kernels.decode_index.sources import take_sources, take_sources_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(2)
    wide = torch.randint(0, 1000, (5, 12), generator=g).to(device)
    wide[3] = torch.tensor([2, -1, 0, 5, -1, 1, 3, -1, 4, 0, -1, 2])
    drawn = torch.randint(0, 1000, (6,), generator=g).to(device)
    want = wide.clone()
    take_sources_reference(want[:, :9], drawn)
    take_sources(wide[:, :9], drawn)
    assert torch.equal(wide, want)
    assert int(wide[0, 0]) == int(drawn[2]) and int(wide[0, 9]) == int(want[0, 9])
