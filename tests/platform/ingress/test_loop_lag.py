"""The ingress's loop-lag monitor: a loop held by synchronous work shows as a late wake-up, the
samples are handed over once, and a monitor nobody reads keeps a bounded list."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from antumbra.platform.ingress.loop_lag import GcPauses, LoopLag

HOLD_S = 0.06


def _hold_the_loop(seconds: float) -> int:
    """Synchronous work on the loop's thread, as a long parse or a thread's Python would be;
    -> how many times it looked at the clock."""
    until, looks = time.perf_counter() + seconds, 0
    while time.perf_counter() < until:
        looks += 1
    return looks


def test_a_held_loop_shows_as_lag_and_samples_are_taken_once() -> None:
    async def body() -> tuple[list[float], list[float]]:
        monitor = LoopLag(interval_s=0.002)
        task = asyncio.create_task(monitor.run())
        await asyncio.sleep(0.02)  # a few wake-ups on a free loop
        assert _hold_the_loop(HOLD_S) > 0
        await asyncio.sleep(0.02)
        first = monitor.take()
        second = monitor.take()
        task.cancel()
        return first, second

    first, second = asyncio.run(body())
    assert len(first) >= 3
    assert max(first) >= HOLD_S * 0.8  # the wake-up due during the hold came that much later
    assert second == []  # handed over once (no wake-up could run between the two takes)


def test_the_samples_are_bounded_and_the_interval_positive() -> None:
    ticks = iter(range(10_000))
    monitor = LoopLag(interval_s=1e-6, max_samples=5, clock=lambda: float(next(ticks)))

    async def body() -> None:
        task = asyncio.create_task(monitor.run())
        for _ in range(200):
            await asyncio.sleep(0)
        task.cancel()

    asyncio.run(body())
    samples = monitor.take()
    assert len(samples) == 5 and all(lag == pytest.approx(1 - 1e-6) for lag in samples)
    with pytest.raises(ValueError, match="interval_s"):
        LoopLag(interval_s=0)


def test_gc_pauses_records_each_collection_with_its_generation_once() -> None:
    pauses = GcPauses.installed()
    try:
        gc.collect(0)
        gc.collect(2)
        first = pauses.take()
        second = pauses.take()
    finally:
        pauses.uninstall()
    assert [generation for generation, _ in first][-2:] == [0, 2]
    assert all(seconds >= 0 for _, seconds in first)
    assert second == []
    gc.collect()
    assert pauses.take() == [] and pauses not in gc.callbacks  # uninstalled: no longer called


def test_gc_pauses_time_a_collection_with_the_injected_clock() -> None:
    ticks = iter([10.0, 10.25])
    pauses = GcPauses(clock=lambda: next(ticks))
    pauses("start", {"generation": 2})
    pauses("stop", {"generation": 2, "collected": 0, "uncollectable": 0})
    assert pauses.take() == [(2, 0.25)]
