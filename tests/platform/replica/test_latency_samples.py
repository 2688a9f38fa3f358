"""A replica's latency samples: bounded stores, handed out once, the TTFT window (`latency_samples.py`)."""

from __future__ import annotations

from antumbra.platform.replica.latency_samples import LatencySamples, nearest_rank


def test_nearest_rank() -> None:
    assert nearest_rank([3.0, 1.0, 2.0], 0.9) == 3.0
    assert nearest_rank([float(i) for i in range(1, 11)], 0.9) == 9.0
    assert nearest_rank([5.0], 0.5) == 5.0


def test_stores_are_bounded_and_handed_out_once() -> None:
    samples = LatencySamples(max_samples=3, max_gap_samples=4)
    for i in range(5):
        samples.first_token(now_s=100.0 + i, ttft_s=0.1 * i)
        samples.next_chunk(0.01 * i)
        samples.next_chunk(0.02 * i)
    assert samples.take_ttft() == [0.0, 0.1, 0.2]  # past the bound a sample is dropped
    assert samples.take_gaps() == [0.0, 0.0, 0.01, 0.02]
    assert samples.take_ttft() == [] and samples.take_gaps() == []


def test_the_ttft_p90_covers_the_window_only() -> None:
    samples = LatencySamples(window_s=10.0)
    assert samples.ttft_p90(now_s=0.0) is None
    samples.first_token(now_s=0.0, ttft_s=9.0)  # old by the time it is asked about
    for i in range(10):
        samples.first_token(now_s=20.0 + i, ttft_s=float(i + 1))
    assert samples.ttft_p90(now_s=29.0) == 9.0
    assert samples.ttft_p90(now_s=100.0) is None
