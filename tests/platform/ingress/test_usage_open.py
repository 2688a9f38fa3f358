"""Open usage entries of running streams against a real redis-server: written within their bound,
folded exactly once by a sweeper when their ingress is gone (never after a close), one sweeper at a
time, none right after an outage; a stream never waits on Redis while it is away, and one past half
its bound hurries the writer without waiting."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from antumbra.platform.ingress.usage import UsageRecord, write_records
from antumbra.platform.ingress.usage_meter import UsageMeter
from antumbra.platform.ingress.usage_open import (
    MAX_UNWRITTEN_TOKENS,
    OpenEntries,
    RequestUsage,
    write_progress,
)
from antumbra.platform.ingress.usage_query import UsageWindow, query_usage
from antumbra.platform.ingress.usage_sweep import Sweeper, fold_stale
from antumbra.platform.launch.redis_server import LocalRedis
from tests.platform.ingress.test_usage import KEYS, rec, run


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    with LocalRedis(data_dir=tmp_path_factory.mktemp("usage-open-redis")) as server:
        yield server


async def totals(client: Redis, tenant: str = "alpha") -> dict[str, int]:
    answer = await query_usage(client, KEYS, tenant, UsageWindow(0, time.time() + 7200))
    return dict(answer["totals"].get(tenant, {}))


async def entry_tokens(client: Redis, request_id: str, tenant: str = "alpha") -> int:
    return int(await client.hget(KEYS.open_entry(tenant, request_id), "completion_tokens") or 0)


def test_an_open_entry_is_folded_once_and_its_late_close_adds_nothing(redis_server: LocalRedis) -> None:
    async def body(client: Redis) -> None:
        assert await write_progress(client, KEYS, [rec("s1", prompt=11, cached=4, completion=7, reasoning=2)])
        assert await fold_stale(client, KEYS, stale_after_s=60) == 0  # its ingress may be alive
        await asyncio.sleep(0.05)
        assert await fold_stale(client, KEYS, stale_after_s=0.01) == 1
        assert await fold_stale(client, KEYS, stale_after_s=0.01) == 0
        folded = await totals(client)
        assert {k: folded[k] for k in ("requests", "prompt_tokens", "cached_tokens", "completion_tokens",
                                       "reasoning_tokens")} == {"requests": 1, "prompt_tokens": 11,
                                                                "cached_tokens": 4, "completion_tokens": 7,
                                                                "reasoning_tokens": 2}
        # The ingress was alive after all: its close and later progress find the request counted.
        assert await write_records(client, KEYS, [rec("s1", prompt=11, completion=9)]) == [False]
        assert await write_progress(client, KEYS, [rec("s1", completion=12)]) == [False]
        assert await totals(client) == folded
        assert not await client.exists(KEYS.open_entry("alpha", "s1"))

    run(redis_server, body)


def test_a_closed_stream_is_never_folded(redis_server: LocalRedis) -> None:
    async def body(client: Redis) -> None:
        assert await write_progress(client, KEYS, [rec("s2", completion=3)])
        assert await write_records(client, KEYS, [rec("s2", completion=5)]) == [True]
        assert not await client.exists(KEYS.open_entry("alpha", "s2"))
        assert await write_progress(client, KEYS, [rec("s2", completion=8)]) == [False]  # landed late
        await asyncio.sleep(0.05)
        assert await fold_stale(client, KEYS, stale_after_s=0.01) == 0
        assert (await totals(client))["completion_tokens"] == 5
        # Writes only raise an entry's counts: one landing out of order does not undo another.
        assert await write_progress(client, KEYS, [rec("s3", completion=9), rec("s3", completion=4)])
        assert await entry_tokens(client, "s3") == 9

    run(redis_server, body)


@dataclass
class Acc:
    """What `RequestUsage` reads of a response builder, through the record maker."""

    prompt_tokens: int = 20


def stream_record(request_id: str) -> Callable[[Acc, int], UsageRecord]:
    def make(acc: Acc, completion_tokens: int) -> UsageRecord:
        return UsageRecord(request_id, "alpha", "tiny", time.time(), acc.prompt_tokens, 0, completion_tokens)

    return make


def test_a_stream_runs_at_most_the_bound_ahead_of_its_entry_and_a_sweep_counts_it(
    redis_server: LocalRedis,
) -> None:
    """A fast stream (no pause between chunks) is held to `MAX_UNWRITTEN_TOKENS` ahead of Redis; a
    slow one is written within the interval; once the ingress is gone, a sweep folds what was written."""

    async def body(client: Redis) -> None:
        meter = UsageMeter(client)
        usage = meter.request(stream_record("fast"))
        acc = Acc()
        await usage.open(acc)
        assert await entry_tokens(client, "fast") == 0 and await client.hget(
            KEYS.open_entry("alpha", "fast"), "prompt_tokens") == b"20"
        sent = 0
        for size in [1] * 60 + [3] * 10 + [MAX_UNWRITTEN_TOKENS + 5]:  # the last chunk alone exceeds it
            await usage.before_send(sent, size)
            sent += size
            usage.sent(acc, sent)
            assert sent - await entry_tokens(client, "fast") <= max(MAX_UNWRITTEN_TOKENS, size), sent
        assert meter.streams.rounds < sent  # batched: far fewer round trips than chunks
        slow = meter.request(stream_record("slow"))
        await slow.open(acc)
        for n in range(1, 4):
            slow.sent(acc, n)
            await asyncio.sleep(meter.streams.write_interval_s * 3)
            assert await entry_tokens(client, "slow") == n
        await meter.streams.close()  # the ingress dies: nothing more is written or closed
        lagging = sent - await entry_tokens(client, "fast")
        await asyncio.sleep(0.3)
        sweeper = Sweeper(client, KEYS, "other-ingress", every_s=0.05, stale_after_s=0.2)
        assert await sweeper.sweep() == 2
        counted = await totals(client)
        assert counted["requests"] == 2 and counted["prompt_tokens"] == 40
        assert counted["completion_tokens"] == sent - lagging + 3
        assert 0 <= lagging <= MAX_UNWRITTEN_TOKENS + 5

    run(redis_server, body)


def test_one_sweeper_at_a_time_and_none_right_after_an_outage(redis_server: LocalRedis) -> None:
    async def body(client: Redis) -> None:
        now = [0.0]
        first = Sweeper(client, KEYS, "a", every_s=1.0, stale_after_s=0.05, clock=lambda: now[0])
        second = Sweeper(client, KEYS, "b", every_s=1.0, stale_after_s=0.05, clock=lambda: now[0])
        await write_progress(client, KEYS, [rec("x1", at=time.time())])
        await asyncio.sleep(0.1)
        assert await first.sweep() == 1
        await write_progress(client, KEYS, [rec("x2", at=time.time())])
        await asyncio.sleep(0.1)
        assert await second.sweep() == 0  # the lease is a's for a second
        await client.delete(KEYS.sweep_lease)
        redis_server.kill()
        try:
            with pytest.raises(RedisConnectionError):
                await second.sweep()
        finally:
            redis_server.start()
        assert await second.sweep() == 0  # Redis is back: live ingresses get time to stamp entries
        await client.delete(KEYS.sweep_lease)
        now[0] += 0.1
        assert await second.sweep() == 1
        assert (await totals(client))["requests"] == 2

    run(redis_server, body)


def test_a_stream_does_not_wait_on_redis_while_it_is_away(redis_server: LocalRedis) -> None:
    async def body(client: Redis) -> None:
        meter = UsageMeter(client)
        acc = Acc()
        before = meter.request(stream_record("before"))
        await before.open(acc)
        redis_server.kill()
        try:
            during = meter.request(stream_record("during"))
            started = time.monotonic()
            await during.open(acc)
            for n in range(1, 4 * MAX_UNWRITTEN_TOKENS):
                await before.before_send(n - 1, 1)
                before.sent(acc, n)
                await during.before_send(n - 1, 1)
                during.sent(acc, n)
            waited_s = time.monotonic() - started
            assert not meter.streams.writing
            before.finish(acc, 4 * MAX_UNWRITTEN_TOKENS - 1)
            during.finish(acc, 4 * MAX_UNWRITTEN_TOKENS - 1)
        finally:
            redis_server.start()
        # One failed write at most, never one per chunk (the client's timeout is 0.5 s).
        assert waited_s < 2 * 0.5, waited_s
        assert await meter.flush(10)
        counted = await totals(client)
        assert counted["requests"] == 2 and counted["completion_tokens"] == 2 * (4 * MAX_UNWRITTEN_TOKENS - 1)
        assert await client.zcard(KEYS.open_index("alpha")) == 0
        await meter.close()

    run(redis_server, body)


def test_a_stream_past_half_its_bound_hurries_the_writer_without_waiting(redis_server: LocalRedis) -> None:
    """With rounds otherwise due only every minute (the interval and the heartbeat), a stream more
    than half `MAX_UNWRITTEN_TOKENS` ahead of its written entry gets it written within the hurry
    interval, and the chunk it is about to send is not held for that write; a stream at half its
    bound or less starts no round."""

    async def body(client: Redis) -> None:
        entries = OpenEntries(client, KEYS, write_interval_s=60.0, heartbeat_s=60.0, hurry_interval_s=0.02)
        usage = RequestUsage(entries, lambda rec: None, stream_record("hurry"))
        acc = Acc()
        await usage.open(acc)
        rounds = entries.rounds
        half = MAX_UNWRITTEN_TOKENS // 2
        usage.sent(acc, half - 1)
        await usage.before_send(half - 1, 1)  # half the bound ahead: no hurry
        await asyncio.sleep(0.3)
        assert entries.rounds == rounds and await entry_tokens(client, "hurry") == 0
        usage.sent(acc, half)
        await usage.before_send(half, 1)  # past half: hurried, and back without a round
        assert entries.rounds == rounds

        async def written() -> None:
            while entries.rounds == rounds:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(written(), 10.0)
        assert await entry_tokens(client, "hurry") == half
        usage.finish(acc, half)
        await entries.close()

    run(redis_server, body)


def test_closing_stops_the_writer_while_streams_hurry_it(redis_server: LocalRedis) -> None:
    """Streams still open when the ingress goes keep hurrying the writer up to the end; `close`
    returns and nothing is written after it (a cancellation that meets the writer's wake-up must not
    leave the writer running)."""

    async def body(client: Redis) -> None:
        entries = OpenEntries(client, KEYS)
        acc = Acc()

        async def stream(index: int) -> None:
            usage = RequestUsage(entries, lambda rec: None, stream_record(f"open-{index}"))
            await usage.open(acc)
            for sent in range(60):
                await asyncio.sleep(0.005)
                await usage.before_send(sent, 1)
                usage.sent(acc, sent + 1)

        await asyncio.gather(*(stream(i) for i in range(8)))
        await asyncio.wait_for(entries.close(), 10.0)
        rounds = entries.rounds
        entries.put(stream_record("late")(acc, 1))
        await asyncio.sleep(0.3)
        assert entries.rounds == rounds and not await client.exists(KEYS.open_entry("alpha", "late"))

    run(redis_server, body)
