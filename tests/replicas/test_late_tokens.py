"""Token ids on their way from the device behave as the tuple of their values; only their count and
slices of them are known before the host reads them."""

from __future__ import annotations

import pytest
import torch

from antumbra.replicas.late_tokens import LateRead, LateTokenIds
from antumbra.replicas.step_io import Drafts


def late(rows: list[list[int]], row: int, count: int) -> tuple[LateRead, LateTokenIds]:
    read = LateRead.start(torch.tensor(rows, dtype=torch.long))
    return read, LateTokenIds(read, row, count)


def test_count_truthiness_and_slices_do_not_read_the_values() -> None:
    read, ids = late([[5, 6, 7], [8, 9, 10]], row=1, count=3)
    head = ids[:2]
    assert len(ids) == 3 and ids and len(head) == 2 and not LateTokenIds(read, 0, 0)
    assert not read.is_read
    assert tuple(head) == (8, 9) and read.is_read


def test_late_ids_behave_as_the_tuple_of_their_values() -> None:
    _, ids = late([[5, 6, 7, 4], [8, 9, 10, 11]], row=0, count=3)
    values = (5, 6, 7)
    assert ids == values and values == ids and ids != (5, 6) and list(ids) == list(values)
    assert ids[0] == 5 and ids[-1] == 7 and ids[::2] == (5, 7) and ids[1:][1:] == (7,)
    assert 6 in ids and 4 not in ids and ids.index(7) == 2 and hash(ids) == hash(values)
    with pytest.raises(IndexError):
        ids[3]


def test_a_source_overwritten_after_the_copy_started_leaves_the_ids_as_they_were() -> None:
    source = torch.tensor([[1, 2]], dtype=torch.long)
    read = LateRead.start(source)
    source.fill_(0)  # the draft graph's output is rewritten by its next replay
    assert LateTokenIds(read, 0, 2) == (1, 2)


def test_drafts_read_their_late_ids_only_for_their_values() -> None:
    read, ids = late([[3, 4, 5]], row=0, count=3)
    drafts = Drafts(ids, None, num_tokens=9)
    assert len(drafts.token_ids[:2]) == 2 and not read.is_read
    q = drafts.distributions(6, torch.device("cpu"))
    assert q.argmax(dim=-1).tolist() == [3, 4, 5] and read.is_read
