"""The race over logits adjusted from per-slot tables (counts, membership, penalties, bias and ban
lists, min_p) against its PyTorch reference, in the Triton interpreter: lists spread over several
chunks, rows without a slot (which must draw exactly the plain race's tokens), active and spent
bans, greedy rows, a top-k cut, and min_p rows built so that a chunk's superset winner falls short
of the row's floor (the combine launch must race that chunk again)."""

from __future__ import annotations

import math

import pytest
import torch

from antumbra.kernels.sampling import (
    AdjustedWorkspace,
    SlotTables,
    adjust_slots_reference,
    empty_tables,
    list_segments,
    pack_rows,
    race_sample_reference,
    race_sample_slots,
    race_sample_slots_reference,
    search_for,
)
from antumbra.kernels.sampling.triton import BLOCK, CHUNK


def _tables(slots: int, vocab: int, g: torch.Generator, width: int = 320) -> tuple[SlotTables, int]:
    """Random tables: every slot with counts, prompt membership, penalties and a list of biased and
    banned tokens (slot 1 reads no table, slot 2 only its counts, slot 3 only its membership);
    -> (tables, search halvings)."""
    t = empty_tables(slots, vocab, width, torch.device("cpu"))
    for s in range(slots):
        generated = torch.randint(0, vocab, (int(torch.randint(0, 60, (1,), generator=g)),), generator=g)
        t.counts[s] = torch.bincount(generated, minlength=vocab).int()
        prompt = torch.randint(0, vocab, (40,), generator=g)
        t.seen[s, prompt] = 1
        t.seen[s, generated] = 1
        rep = float(torch.rand(1, generator=g)) * 1.5 + 0.5
        f32 = torch.tensor([rep, 1 / rep]).float().double()
        t.scalars[s] = torch.tensor([float(torch.randn(1, generator=g)), float(torch.randn(1, generator=g)),
                                     float(f32[0]), float(f32[1])], dtype=torch.float64)
        t.ints[s] = torch.tensor([int(torch.randint(0, 8, (1,), generator=g)), [3, 0, 1, 2][s % 4]])
        n = int(torch.randint(1, min(vocab, width), (1,), generator=g))
        tokens = torch.randperm(vocab, generator=g)[:n].sort().values
        t.list_tok[s, :n] = tokens.int()
        t.list_val[s, 0, :n] = torch.randn(n, generator=g) * 2
        t.list_val[s, 1, :n] = (torch.rand(n, generator=g) < 0.1).float()
        t.list_seg[s] = list_segments(tokens, vocab)
    return t, search_for(t.list_seg)


def _check(logits, rows_in, cut, slots, tables, search, slack) -> torch.Tensor:
    batch, vocab = logits.shape
    out = torch.full((batch,), -7, dtype=torch.int64)
    got = race_sample_slots(logits, rows_in, cut, slack, slots.int(), tables, search, out=out,
                            workspace=AdjustedWorkspace(batch + 3, vocab, logits.device))
    none = torch.full((batch,), float("-inf"))
    want = race_sample_slots_reference(logits, rows_in, none if cut is None else cut, slots, tables, slack)
    assert got.tolist() == want.tolist()
    return got


@pytest.mark.parametrize("vocab", [37, 9001])
def test_slot_race_matches_reference(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    batch = 6
    logits = torch.randn(batch, vocab, generator=g) * 3
    tables, search = _tables(4, vocab, g)
    slots = torch.tensor([0, -1, 1, 2, 3, 2])
    temperatures = [1.0, 0.7, 0.0, 1.3, 1.0, 0.0]
    slack = torch.tensor([math.log(0.05), -math.inf, -math.inf, 1.3 * math.log(0.2), -math.inf, -math.inf])
    for counter in (0, 9):  # every ban active, then every ban spent (min_tokens < 8)
        rows_in = pack_rows([11 * i for i in range(batch)], [counter] * batch, temperatures)
        _check(logits, rows_in, None, slots, tables, search, slack.float())
    adjusted = logits.clone()
    adjust_slots_reference(adjusted, torch.zeros(batch, dtype=torch.long), slots, tables)
    cut = torch.full((batch,), float("-inf"))
    cut[4] = adjusted[4].topk(5).values[-1]  # a top-5 row: the cut is on the adjusted logits
    _check(logits, pack_rows(list(range(batch)), [0] * batch, temperatures), cut, slots, tables, search,
           slack.float())


def test_rows_without_a_slot_draw_the_plain_race() -> None:
    vocab, batch = CHUNK + 500, 4
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(batch, vocab, generator=g)
    tables, search = _tables(2, vocab, g)
    rows_in = pack_rows([3, 4, 5, 6], [2] * batch, [1.0, 0.0, 0.5, 2.0])
    none = torch.full((batch,), -math.inf)
    got = _check(logits, rows_in, None, torch.full((batch,), -1), tables, search, none)
    assert got.tolist() == race_sample_reference(logits, rows_in, none).tolist()


def test_bans_and_counts_adjust_as_defined() -> None:
    vocab = 2 * BLOCK + 10
    t = empty_tables(1, vocab, 4, torch.device("cpu"))
    t.counts[0, 5], t.seen[0, 5], t.seen[0, 7] = 3, 1, 1  # 5 generated three times, 7 in the prompt
    t.scalars[0] = torch.tensor([0.5, 0.25, 2.0, 0.5], dtype=torch.float64)
    t.ints[0] = torch.tensor([4, 3])  # min_tokens 4, counts and membership read
    tokens = torch.tensor([7, BLOCK + 1])
    t.list_tok[0, :2] = tokens.int()
    t.list_val[0, 0, :2] = torch.tensor([1.0, 0.0])
    t.list_val[0, 1, :2] = torch.tensor([0.0, 1.0])
    t.list_seg[0] = list_segments(tokens, vocab)
    logits = torch.full((2, vocab), 1.0)
    adjust_slots_reference(logits, torch.tensor([3, 4]), torch.tensor([0, 0]), t)
    for row in range(2):
        assert logits[row, 5] == pytest.approx(1.0 / 2.0 - (3 * 0.5 + 0.25))
        assert logits[row, 7] == (1.0 + 1.0) / 2.0
        assert logits[row, 6] == 1.0
    assert logits[0, BLOCK + 1] == -math.inf and logits[1, BLOCK + 1] == 1.0  # the ban ends at 4 tokens


def test_min_p_chunk_raced_again_when_its_winner_misses_the_floor() -> None:
    vocab, batch = 2 * CHUNK + 100, 3
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(batch, vocab, generator=g)
    logits[:, 2 * CHUNK + 17] = 10.0  # the row's best, in the last chunk
    logits[:, CHUNK - 5] = 9.5  # kept by min_p 0.3, at the end of the first chunk
    logits[:, 3:23] = 8.0  # below the floor (10 + ln 0.3 = 8.8), above the first tile's own cut
    t = empty_tables(2, vocab, 4, torch.device("cpu"))
    t.ints[:, 1] = 3
    t.scalars[:, 2:] = 1.0
    t.counts[0, 2 * CHUNK + 17] = 1
    t.scalars[0, 0] = 0.25  # the best loses a quarter
    tokens = torch.tensor([7])
    t.list_tok[1, 0], t.list_val[1, :, 0] = 7, torch.tensor([0.0, 1.0])  # row 2 bans 7
    t.ints[1, 0] = 5
    t.list_seg[1] = list_segments(tokens, vocab)
    slots = torch.tensor([0, 0, 1])
    slack = torch.full((batch,), math.log(0.3), dtype=torch.float32)
    misses = 0
    for counter in range(2):
        rows_in = pack_rows([100 + i for i in range(batch)], [counter] * batch, [1.0] * batch)
        _check(logits, rows_in, None, slots, t, search_for(t.list_seg), slack)
        # The chunk's winner among tokens >= its running cut is one of the 8.0s in most draws.
        plain = logits.clone()
        plain[:, CHUNK:] = float("-inf")
        none = torch.full((batch,), -math.inf)
        first_chunk = race_sample_slots_reference(plain, rows_in, none, slots, t, none)
        misses += int((first_chunk < 23).sum())
    assert misses > 0


def test_list_segments_slice_by_tile() -> None:
    tokens = torch.tensor([3, BLOCK, BLOCK + 1, 2 * CHUNK])
    seg = list_segments(tokens, 2 * CHUNK + 1)  # three chunks: 3 * CHUNK / BLOCK tiles
    tiles = 3 * CHUNK // BLOCK
    assert seg.shape == (tiles + 1,)
    per_tile = (seg[1:] - seg[:-1]).tolist()
    assert per_tile[0] == 1 and per_tile[1] == 2 and per_tile[2 * CHUNK // BLOCK] == 1 and sum(per_tile) == 4
    assert search_for(seg) == 4  # the longest slice holds two entries: 2 halvings, the smallest bucket
