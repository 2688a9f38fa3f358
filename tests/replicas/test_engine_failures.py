"""Failures are answered, never hung: a step that raises fails only its requests; a fatal one
stops the engine and says so; a request that can never be admitted fails with a reason; the
driver sleeps when idle and serves many threads at once.

Faults are injected by `tests/faults/injection.py` (a step holding the fault's token raises), which
patches the engine's seams; the product knows nothing of it.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading

import pytest

from antumbra import Engine, SamplingParams
from antumbra.config import CacheConfig, SchedulerConfig
from antumbra.replicas.errors import EngineDeadError, RequestFailedError
from tests.faults.injection import injected
from tests.waiting import wait_until

POISON = 3  # the tiny model's vocabulary holds it; no other prompt here holds it
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[10, 11, 12, 13] * 40, [20, 21] * 3, [30] * 90]


def _engine(tiny_checkpoint, **kwargs) -> Engine:
    return Engine.from_pretrained(
        tiny_checkpoint, scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=1024), **kwargs
    )


def _idle_and_intact(engine: Engine) -> None:
    assert engine.wait_idle(30)
    engine.check_integrity()
    assert not engine.core.requests and not engine.core.has_work()
    engine.clear_cache()
    assert engine.pools.num_free_virtual_pages == engine.pools.layout.num_virtual_pages
    assert engine.pools.num_free_swa_pages == engine.pools.layout.num_swa_pages


@pytest.fixture(scope="module")
def clean(tiny_checkpoint) -> list[list[int]]:
    return [o.token_ids for o in _engine(tiny_checkpoint).generate(PROMPTS, GREEDY)]


def test_a_failing_step_fails_only_its_request(tiny_checkpoint, clean):
    with injected(f"raise={POISON}"):
        _a_failing_step_fails_only_its_request(_engine(tiny_checkpoint), clean)


def _a_failing_step_fails_only_its_request(engine: Engine, clean: list[list[int]]) -> None:

    async def run_all() -> list[object]:
        async def one(prompt: list[int]) -> object:
            try:
                return [out async for out in engine.stream(prompt, GREEDY)][-1].token_ids
            except RequestFailedError as exc:
                return exc

        poisoned = [40, 41, POISON, 42] * 5
        return await asyncio.gather(*(one(p) for p in [PROMPTS[0], poisoned, PROMPTS[1], PROMPTS[2]]))

    results = asyncio.run(run_all())
    assert results[0] == clean[0] and results[2] == clean[1] and results[3] == clean[2]
    failure = results[1]
    assert isinstance(failure, RequestFailedError) and "injected fault" in str(failure)
    assert engine.stats()["num_failed_requests"] == 1.0
    # Its computed pages never entered the cache; the others' did.
    assert engine.cached_block_hashes()
    _idle_and_intact(engine)
    # The engine goes on serving.
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == clean
    engine.health()


def test_the_sync_api_raises_the_failure_and_queues_nothing_else(tiny_checkpoint, clean):
    with injected(f"raise={POISON}"):
        _the_sync_api_raises(_engine(tiny_checkpoint), clean)


def _the_sync_api_raises(engine: Engine, clean: list[list[int]]) -> None:
    with pytest.raises(RequestFailedError, match="injected fault"):
        engine.generate([PROMPTS[1], [POISON, 50, 51]], GREEDY)
    _idle_and_intact(engine)
    assert engine.generate([PROMPTS[1]], GREEDY)[0].token_ids == clean[1]


def test_a_fatal_failure_stops_the_engine_and_answers_everyone(tiny_checkpoint):
    with injected(f"fatal={POISON}"):
        _a_fatal_failure_stops_the_engine(_engine(tiny_checkpoint))


def _a_fatal_failure_stops_the_engine(engine: Engine) -> None:
    engine.generate([PROMPTS[1]], GREEDY)
    engine.health()
    with pytest.raises(EngineDeadError, match="injected fault"):
        engine.generate([PROMPTS[0], [POISON, 50]], GREEDY)
    with pytest.raises(EngineDeadError):
        engine.health()
    with pytest.raises(EngineDeadError):
        engine.generate([PROMPTS[1]], GREEDY)
    engine.check_integrity()
    assert not engine.core.requests


def test_a_request_that_can_never_be_admitted_fails_with_the_reason(tiny_checkpoint):
    # One SWA page: less than a sequence's steady window footprint, so no request is ever admitted.
    engine = _engine(tiny_checkpoint, cache=CacheConfig(num_swa_pages=1))
    assert engine.pools.layout.steady_swa_pages_per_seq > 1
    with pytest.raises(RequestFailedError, match="cannot hold"):
        engine.generate([[9] * 300], GREEDY)
    _idle_and_intact(engine)


def test_the_driver_sleeps_when_idle(tiny_checkpoint):
    engine = _engine(tiny_checkpoint)
    engine.generate([PROMPTS[1]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert engine.wait_idle(10)
    wakeups = engine.driver.num_wakeups
    thread = engine.driver.thread
    assert thread is not None and thread.is_alive()
    # The driver is parked in the condition's wait inside its loop, not spinning.
    wait_until(lambda: _parked(thread), 10, "the driver to wait on its condition")
    assert engine.driver.num_wakeups == wakeups


def test_an_engine_nobody_holds_stops_its_driver(tiny_checkpoint):
    engine = _engine(tiny_checkpoint)
    engine.generate([PROMPTS[1]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    thread = engine.driver.thread
    assert thread is not None
    del engine
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def _parked(thread: threading.Thread) -> bool:
    frame = sys._current_frames().get(thread.ident or -1)
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return "_run" in names and "wait" in names[:2]


def test_many_threads_and_streams_at_once(tiny_checkpoint, clean):
    engine = _engine(tiny_checkpoint)
    results: dict[int, list[int]] = {}

    def worker(i: int) -> None:
        results[i] = engine.generate([PROMPTS[i % 3]], GREEDY)[0].token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()

    async def streams() -> list[list[int]]:
        async def one(p: list[int]) -> list[int]:
            return [out async for out in engine.stream(p, GREEDY)][-1].token_ids

        return await asyncio.gather(*(one(p) for p in PROMPTS))

    assert asyncio.run(streams()) == clean
    for t in threads:
        t.join(60)
    assert all(results[i] == clean[i % 3] for i in range(6))
    _idle_and_intact(engine)


def test_unseeded_temperature_one_works_and_varies(tiny_checkpoint):
    engine = _engine(tiny_checkpoint)
    params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    a, b = engine.generate([PROMPTS[1], PROMPTS[1]], params)
    assert len(a.token_ids) == len(b.token_ids) == 16
    assert a.token_ids != b.token_ids  # each request draws its own seed
    seeded = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True, seed=11)
    alone = engine.generate([PROMPTS[1]], seeded)[0].token_ids
    assert (
        engine.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [GREEDY, seeded, params])[1].token_ids == alone
    )


HELD = ("request_vpages", "request_swa_pages", "locked_cache_pages", "hot_buffers")


def test_stats_count_what_requests_hold_and_an_abandoned_stream_holds_nothing(tiny_checkpoint):
    """`stats()` separates pages requests hold from pages the cache keeps: all 0 once none is left."""
    engine = _engine(tiny_checkpoint, cache=CacheConfig(hisparse_rows_per_request=16))
    shared = [50 + i % 90 for i in range(300)]
    engine.generate([shared], GREEDY)  # leaves 2 cached pages
    assert {k: engine.stats()[k] for k in HELD} == dict.fromkeys(HELD, 0.0)

    async def read_a_few() -> dict[str, float]:
        stream = engine.stream(shared + [7] * 200, SamplingParams(max_tokens=500, ignore_eos=True))
        async for out in stream:
            if len(out.token_ids) >= 2:
                break
        held = engine.stats()
        await stream.aclose()  # the client went away
        return held

    held = asyncio.run(read_a_few())
    assert held["request_vpages"] >= 2 and held["request_swa_pages"] >= 1  # the prompt's own pages
    # The shared prefix's 2 pages (and its buffer); with them, once the engine has put the prompt's
    # prefill into the cache (before or after this snapshot), the prompt's own third full page.
    assert held["locked_cache_pages"] in (2, 3) and held["hot_buffers"] == 1
    assert engine.wait_idle(30)
    stats = engine.stats()
    assert {k: stats[k] for k in HELD} == dict.fromkeys(HELD, 0.0)
    assert stats["cache_nodes"] >= 2 and stats["pool_use_virtual"] > 0  # the cache keeps its pages
    engine.check_integrity()
