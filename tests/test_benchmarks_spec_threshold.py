"""The speculation threshold a spec_decode measurement supports (`speculation_threshold`)."""

from __future__ import annotations

from benchmarks.engine.spec_decode import speculation_threshold


def test_the_threshold_is_the_last_batch_of_the_run_of_speedups_from_batch_1() -> None:
    assert speculation_threshold({1: 1.9, 8: 1.2, 32: 0.8}) == 8
    assert speculation_threshold({1: 1.9, 8: 0.9, 32: 1.1}) == 1  # a later speedup does not count
    assert speculation_threshold({1: 0.3, 8: 1.6}) == 0
    assert speculation_threshold({32: 1.05, 1: 2.0, 8: 1.4}) == 32
    assert speculation_threshold({1: 0.97, 8: 0.96}, floor=0.95) == 8
