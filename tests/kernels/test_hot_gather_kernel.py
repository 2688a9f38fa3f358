"""The HiSparse page-in kernel against its reference (Triton interpreter on CPU): -1 holes, padded
rows that select nothing, widths that are not a power of two, stored formats of other dtypes."""

from __future__ import annotations

import pytest
import torch

from antumbra.kernels.hot_gather import gather_rows, gather_rows_reference


def _case(seed: int, batch: int, k: int, width: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    n, per_buffer = 97, k + 3
    if dtype.is_floating_point:
        src = torch.randn(n, width, generator=g).to(dtype)
    else:
        src = torch.randint(0, 255, (n, width), generator=g).to(dtype)
    rows = torch.randint(0, n, (batch, k), generator=g, dtype=torch.int32)
    rows[torch.rand(batch, k, generator=g) < 0.3] = -1
    rows[-1] = -1  # a padded row: nothing selected
    # Buffers out of order, as requests take them.
    base = torch.randperm(batch + 2, generator=g)[:batch].to(torch.long) * per_buffer
    dst = torch.full(((batch + 2) * per_buffer, width), 7, dtype=dtype)
    return src, rows, base, dst


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("batch", "k", "width", "dtype"), [
    (1, 8, 32, torch.float32), (3, 13, 40, torch.bfloat16), (4, 6, 584, torch.uint8),
])
def test_gather_rows_matches_reference(seed, batch, k, width, dtype):
    src, rows, base, dst = _case(seed, batch, k, width, dtype)
    want_dst, got_dst = dst.clone(), dst.clone()
    want_count, got_count = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    want = gather_rows_reference(src, rows, base, want_dst, want_count)
    got = gather_rows(src, rows, base, got_dst, got_count)
    assert torch.equal(got, want)
    assert torch.equal(got_dst, want_dst)  # rows outside the selected slots untouched
    assert got_count.item() == want_count.item() == int((rows >= 0).sum())
    valid = want >= 0
    assert torch.equal(got_dst[want[valid].long()], src[rows[valid].long()])


def test_gather_rows_without_counter_and_refuses_mismatched_rows():
    src, rows, base, dst = _case(3, 2, 5, 16, torch.float32)
    slots = gather_rows(src, rows, base, dst)
    assert torch.equal(slots, gather_rows_reference(src, rows, base, dst.clone()))
    with pytest.raises(ValueError, match="cannot go to a buffer"):
        gather_rows(src, rows, base, dst.to(torch.bfloat16))
