"""The host tier through its device mapping (`cachestore/host_tier.py`). The alias itself needs a GPU
(skipped without one); the refusals run anywhere."""

from __future__ import annotations

import pytest
import torch

from antumbra.cachestore.host_tier import HostTierError, device_view
from antumbra.kernels.hot_gather import gather_rows, gather_rows_reference

CUDA = torch.device("cuda")
needs_gpu = pytest.mark.gpu


def test_rows_already_on_the_device_are_their_own_view():
    rows = torch.arange(12.0).view(3, 4)
    assert device_view(rows, torch.device("cpu")) is rows


def test_pageable_host_rows_are_refused_for_a_gpu():
    with pytest.raises(HostTierError, match="pinned"):
        device_view(torch.zeros(4, 8), CUDA)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_pinned_rows_alias_on_the_device_both_ways(dtype):
    host = torch.zeros(64, 40, dtype=dtype).pin_memory()
    view = device_view(host, CUDA)
    assert view.device.type == "cuda" and view.data_ptr() == host.data_ptr()
    assert view.shape == host.shape and view.dtype == dtype
    # A device write is seen by the host (after the stream), a host write by the device.
    view[3] = torch.full((40,), 7, dtype=dtype, device=CUDA)
    torch.cuda.synchronize()
    assert torch.equal(host[3], torch.full((40,), 7, dtype=dtype))
    host[5] = 9
    assert torch.equal(view[5].cpu(), torch.full((40,), 9, dtype=dtype))


@needs_gpu
def test_the_page_in_kernel_reads_the_host_tier_through_the_alias():
    g = torch.Generator().manual_seed(0)
    host = torch.randn(300, 96, generator=g).to(torch.bfloat16).pin_memory()
    rows = torch.randint(0, 300, (3, 16), generator=g, dtype=torch.int32)
    rows[1, 5:] = -1
    base = torch.tensor([32, 0, 64])
    want = torch.zeros(96, 96, dtype=torch.bfloat16)
    want_slots = gather_rows_reference(host, rows, base, want)
    got = torch.zeros(96, 96, dtype=torch.bfloat16, device=CUDA)
    counter = torch.zeros(1, dtype=torch.long, device=CUDA)
    slots = gather_rows(device_view(host, CUDA), rows.to(CUDA), base.to(CUDA), got, counter)
    assert torch.equal(slots.cpu(), want_slots)
    assert torch.equal(got.cpu(), want)
    assert counter.item() == int((rows >= 0).sum())
