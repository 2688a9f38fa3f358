"""The race over adjusted logits (penalties, bias, bans, min_p) against its reference, in the Triton
interpreter: entries spread over several chunks, rows without entries, bans, greedy rows, a
top-k cut, and min_p rows built so that a chunk's superset winner falls short of the row's floor
(the combine launch must race that chunk again)."""

from __future__ import annotations

import math

import pytest
import torch

from antumbra.kernels.sampling import (
    AdjustedWorkspace,
    adjust_reference,
    entry_segments,
    pack_rows,
    race_sample_adjusted,
    race_sample_adjusted_reference,
)
from antumbra.kernels.sampling.triton import CHUNK


def _entries(batch: int, vocab: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorted (rows, tokens, values [4, E]) with every kind of entry; row 1 has none."""
    rows, tokens = [], []
    for row in range(batch):
        if row == 1:
            continue
        count = int(torch.randint(1, min(vocab, 300), (1,), generator=g))
        picked = torch.randperm(vocab, generator=g)[:count].sort().values.tolist()
        rows += [row] * len(picked)
        tokens += picked
    n = len(tokens)
    bias = torch.where(torch.rand(n, generator=g) < 0.05, float("-inf"), torch.randn(n, generator=g) * 2)
    rep = torch.rand(n, generator=g) * 1.5 + 0.5
    sub = torch.rand(n, generator=g) * 3 - 1
    values = torch.stack([bias, (1 / rep.double()).float(), rep, sub])
    return torch.tensor(rows), torch.tensor(tokens), values


def _check(logits, rows_in, cut, entries, slack) -> None:
    batch, vocab = logits.shape
    seg, search = entry_segments(entries[0], entries[1], batch, vocab)
    out = torch.full((batch,), -7, dtype=torch.int64)
    got = race_sample_adjusted(
        logits, rows_in, cut, slack, seg, entries[1].to(torch.int32), entries[2], search, out=out,
        workspace=AdjustedWorkspace(batch + 3, vocab, logits.device),
    )
    none = torch.full((batch,), float("-inf"))
    want = race_sample_adjusted_reference(logits, rows_in, none if cut is None else cut, entries, slack)
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("vocab", [37, 9001])
def test_adjusted_race_matches_reference(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    batch = 5
    logits = torch.randn(batch, vocab, generator=g) * 3
    entries = _entries(batch, vocab, g)
    temperatures = [1.0, 0.7, 0.0, 1.3, 1.0]
    slack = torch.tensor([math.log(0.05), -math.inf, -math.inf, 1.3 * math.log(0.2), -math.inf]).float()
    _check(logits, pack_rows([11 * i for i in range(batch)], [3] * batch, temperatures), None, entries, slack)
    adjusted = logits.clone()
    adjust_reference(adjusted, *entries)
    cut = torch.full((batch,), float("-inf"))
    cut[4] = adjusted[4].topk(5).values[-1]  # a top-5 row: the cut is on the adjusted logits
    _check(logits, pack_rows(list(range(batch)), [0] * batch, temperatures), cut, entries, slack)


def test_min_p_chunk_raced_again_when_its_winner_misses_the_floor() -> None:
    vocab, batch = 2 * CHUNK + 100, 3
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(batch, vocab, generator=g)
    logits[:, 2 * CHUNK + 17] = 10.0  # the row's best, in the last chunk
    logits[:, CHUNK - 5] = 9.5  # kept by min_p 0.3, at the end of the first chunk
    logits[:, 3:23] = 8.0  # below the floor (10 + ln 0.3 = 8.8), above the first tile's own cut
    rows = torch.tensor([0, 0, 2])
    tokens = torch.tensor([1, 2 * CHUNK + 17, 7])
    values = torch.tensor([[0.0, 0.0, -math.inf], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.25, 0.0]])
    slack = torch.full((batch,), math.log(0.3), dtype=torch.float32)
    misses = 0
    for counter in range(2):
        rows_in = pack_rows([100 + i for i in range(batch)], [counter] * batch, [1.0] * batch)
        _check(logits, rows_in, None, (rows, tokens, values), slack)
        # The chunk's winner among tokens >= its running cut is one of the 8.0s in most draws.
        plain = logits.clone()
        plain[:, CHUNK:] = float("-inf")
        none = torch.full((batch,), -math.inf)
        first_chunk = race_sample_adjusted_reference(plain, rows_in, none, (rows, tokens, values), none)
        misses += int((first_chunk < 23).sum())
    assert misses > 0


def test_entry_segments_slice_by_row_and_tile() -> None:
    from antumbra.kernels.sampling.triton import BLOCK

    rows = torch.tensor([0, 0, 0, 2, 2])
    tokens = torch.tensor([3, BLOCK, BLOCK + 1, 0, CHUNK])
    seg, search = entry_segments(rows, tokens, 3, CHUNK + 1)  # two chunks: 2 * CHUNK / BLOCK tiles
    tiles = 2 * CHUNK // BLOCK
    assert seg.shape == (3, tiles + 1)
    assert seg[0, :3].tolist() == [0, 1, 3] and set(seg[0, 3:].tolist()) == {3}
    assert set(seg[1].tolist()) == {3}
    per_tile = (seg[2, 1:] - seg[2, :-1]).tolist()
    assert per_tile[0] == 1 and per_tile[CHUNK // BLOCK] == 1 and sum(per_tile) == 2
    assert search == 4  # the longest slice holds two entries: 2 halvings, the smallest bucket
