"""The drawn-token count kernel against its reference (the penalty state's scatters).

Runs in the Triton interpreter on CPU, compiled where a CUDA device is present; counts are integers,
so the tables are compared exactly."""

from __future__ import annotations

import pytest
import torch

from antumbra.kernels.sampling.counts import count_drawn, count_drawn_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_counts_match_the_scatters_with_padded_and_repeated_rows(slot_dtype):
    g = torch.Generator().manual_seed(3)
    slots_n, vocab = 3, 50
    counts = torch.randint(0, 5, (slots_n + 1, vocab), generator=g, dtype=torch.int32).to(DEVICE)
    seen = torch.randint(0, 2, (slots_n + 1, vocab), generator=g, dtype=torch.uint8).to(DEVICE)
    # two rows of one slot drawing one token, rows without a slot (the scratch row), a last token
    tokens = torch.tensor([7, 7, 3, vocab - 1, 0, 12], dtype=torch.int64, device=DEVICE)
    slots = torch.tensor([1, 1, -1, 2, -1, 0], dtype=slot_dtype, device=DEVICE)
    before = int(counts[1, 7])
    want_counts, want_seen = counts.clone(), seen.clone()
    count_drawn_reference(tokens, slots, want_counts, want_seen, slots_n)
    count_drawn(tokens, slots, counts, seen, slots_n)
    assert torch.equal(counts, want_counts) and torch.equal(seen, want_seen)
    assert int(counts[1, 7]) == before + 2 and int(seen[slots_n, 3]) == 1


def test_an_empty_step_counts_nothing_and_bad_tables_are_refused():
    counts = torch.zeros(2, 8, dtype=torch.int32, device=DEVICE)
    seen = torch.zeros(2, 8, dtype=torch.uint8, device=DEVICE)
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    count_drawn(empty, empty, counts, seen, 1)
    assert not counts.any() and not seen.any()
    with pytest.raises(AssertionError):
        count_drawn(empty, empty, counts.long(), seen, 1)
