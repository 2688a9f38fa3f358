"""The arrival counters of the "last program finishes" kernels: one zeroed buffer per stream (per
thread on the CPU), grown by replacement, left at zero by the kernels that count on them."""

from __future__ import annotations

import threading

import torch

from antumbra.kernels.common.arrivals import MIN_COUNTERS, arrival_counters


def test_a_thread_keeps_its_buffer_and_another_thread_gets_its_own():
    cpu = torch.device("cpu")
    first = arrival_counters(cpu, 8)
    assert first.dtype == torch.int32 and first.shape == (8,) and not first.any()
    again = arrival_counters(cpu, 16)
    assert again.data_ptr() == first.data_ptr(), "the same stream's buffer, not a new fill"
    seen: list[torch.Tensor] = []
    worker = threading.Thread(target=lambda: seen.append(arrival_counters(cpu, 8)))
    worker.start()
    worker.join()
    assert seen[0].data_ptr() != first.data_ptr()


def test_a_larger_request_replaces_the_buffer_with_a_zeroed_one():
    cpu = torch.device("cpu")
    small = arrival_counters(cpu, 4)
    held = small.untyped_storage().nbytes() // small.element_size()  # earlier tests may have grown it
    assert held >= MIN_COUNTERS
    small[:2] = 7  # a kernel that broke the invariant would leave this
    grown = arrival_counters(cpu, held + 1)
    assert grown.numel() == held + 1 and not grown.any()
    assert grown.data_ptr() != small.data_ptr()
    assert small[:2].tolist() == [7, 7], "the old buffer stays alive (a graph may hold its address)"


def test_each_purpose_has_a_buffer_of_its_own():
    cpu = torch.device("cpu")
    split = arrival_counters(cpu, 8)
    topk = arrival_counters(cpu, 8, purpose="indexer_topk")
    assert topk.data_ptr() != split.data_ptr() and not topk.any()
    assert arrival_counters(cpu, 8, purpose="indexer_topk").data_ptr() == topk.data_ptr()
