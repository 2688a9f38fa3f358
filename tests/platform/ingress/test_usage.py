"""Usage metering against a real redis-server: each request counted once, kept through an outage,
read back by tenant, model and hour; a stream's open entry kept within its bound, folded once by a
sweeper if its ingress dies; and authentication through an outage longer than its cache."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest
from redis.asyncio import Redis
from starlette.requests import Request

from antumbra.platform.ingress.auth import Authenticator
from antumbra.platform.ingress.openai_errors import ApiError
from antumbra.platform.ingress.redis_health import RedisHealth
from antumbra.platform.ingress.tenant_spec import TenantSpec
from antumbra.platform.ingress.tenants import TenantStore
from antumbra.platform.ingress.usage import HOUR_S, UsageKeys, UsageRecord, write_records
from antumbra.platform.ingress.usage_meter import UsageMeter
from antumbra.platform.ingress.usage_query import UsageWindow, parse_time, query_usage
from antumbra.platform.launch.redis_server import LocalRedis
from antumbra.platform.redis_client import redis_client

T = TypeVar("T")
KEYS = UsageKeys("antumbra")
HOUR = 1_780_000_000 // HOUR_S * HOUR_S  # an hour start in 2026


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    with LocalRedis(data_dir=tmp_path_factory.mktemp("usage-redis")) as server:
        yield server


def run(server: LocalRedis, body: Callable[[Redis], Awaitable[T]]) -> T:
    """Run `body` with a fail-fast client (the ingress's) on an empty database, empty on disk too: the
    bodies kill the server, and one restarted from an append-only file that missed the flush (Redis
    postpones its writes while a slow fsync runs) would bring back the earlier tests' records."""

    async def main() -> T:
        client = redis_client(server.url, timeout_s=0.5)
        try:
            await client.flushdb()
            await empty_on_disk(client)
            return await body(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


async def empty_on_disk(client: Redis, timeout_s: float = 30.0) -> None:
    """Rewrite the append-only file from the (empty) dataset and wait until the rewrite is done."""
    await client.bgrewriteaof()
    deadline = time.monotonic() + timeout_s
    while True:
        info = await client.info("persistence")
        if not info["aof_rewrite_in_progress"] and not info["aof_rewrite_scheduled"]:
            return
        assert time.monotonic() < deadline, "the append-only file was not rewritten"
        await asyncio.sleep(0.01)


def rec(request_id: str, tenant: str = "alpha", model: str = "tiny", at: float = HOUR + 60,
        prompt: int = 10, cached: int = 0, completion: int = 5, reasoning: int = 0) -> UsageRecord:
    return UsageRecord(request_id, tenant, model, at, prompt, cached, completion, reasoning)


def test_a_record_written_twice_counts_once(redis_server: LocalRedis) -> None:
    async def body(client: Redis) -> None:
        first = rec("r1", prompt=7, cached=3, completion=4, reasoning=2)
        assert await write_records(client, KEYS, [first, rec("r2"), first]) == [True, True, False]
        assert await write_records(client, KEYS, [first]) == [False]  # a retry after a lost reply
        answer = await query_usage(client, KEYS, "alpha", UsageWindow(HOUR, HOUR + HOUR_S))
        (row,) = answer["data"]
        assert row == {"tenant": "alpha", "model": "tiny", "hour": "2026-05-28T20:00:00Z", "hour_s": HOUR,
                       "requests": 2, "prompt_tokens": 17, "cached_tokens": 3, "completion_tokens": 9,
                       "reasoning_tokens": 2, "total_tokens": 26}
        assert answer["totals"]["alpha"]["total_tokens"] == 26

    run(redis_server, body)


def test_query_by_tenant_model_and_hour_window(redis_server: LocalRedis) -> None:
    async def body(client: Redis) -> None:
        records = [rec("a1", at=HOUR + 10), rec("a2", at=HOUR + HOUR_S + 10, model="other:model"),
                   rec("a3", at=HOUR + 2 * HOUR_S + 10), rec("b1", tenant="beta", at=HOUR + 10, prompt=1)]
        assert all(await write_records(client, KEYS, records))
        # [HOUR + 30 min, HOUR + 90 min) overlaps the first two hours, not the third.
        answer = await query_usage(client, KEYS, "alpha", UsageWindow(HOUR + 1800, HOUR + 5400))
        assert [(r["hour_s"], r["model"]) for r in answer["data"]] == [(HOUR, "tiny"),
                                                                       (HOUR + HOUR_S, "other:model")]
        everyone = await query_usage(client, KEYS, None, UsageWindow(0, HOUR + 10 * HOUR_S))
        assert {t: v["requests"] for t, v in everyone["totals"].items()} == {"alpha": 3, "beta": 1}
        assert (await query_usage(client, KEYS, "nobody", UsageWindow(0, HOUR)))["data"] == []

    run(redis_server, body)


def test_times_are_iso_or_epoch_and_bad_ones_are_400() -> None:
    assert parse_time("2026-05-28T20:00:00Z", "from") == HOUR
    assert parse_time("2026-05-28T20:00:00", "from") == HOUR  # no zone: UTC
    assert parse_time("2026-05-28T22:00:00+02:00", "from") == HOUR
    assert parse_time(str(HOUR), "from") == HOUR
    for bad in ("yesterday", "-5", "nan", "2026-13-01"):
        with pytest.raises(ApiError) as err:
            parse_time(bad, "from")
        assert err.value.status == 400 and err.value.param == "from"
    with pytest.raises(ApiError) as err:
        UsageWindow.parse(str(HOUR), str(HOUR - 1))
    assert err.value.status == 400 and err.value.param == "to"


def test_records_queued_through_an_outage_are_written_in_order_once(redis_server: LocalRedis) -> None:
    async def body(client: Redis) -> None:
        meter = UsageMeter(client)
        meter.record(rec("before"))
        assert await meter.flush(5)
        redis_server.kill()
        try:
            for i in range(5):
                meter.record(rec(f"during-{i}", completion=i))
            await asyncio.sleep(0.5)  # the writer fails and waits
            assert meter.pending == 5
        finally:
            redis_server.start()  # persisted: "before" is still there
        assert await meter.flush(10)
        assert meter.dropped == 0
        totals = (await query_usage(client, KEYS, "alpha", UsageWindow(0, HOUR + HOUR_S)))["totals"]["alpha"]
        assert totals["requests"] == 6 and totals["completion_tokens"] == 5 + sum(range(5))
        await meter.close()

    run(redis_server, body)


def test_a_full_queue_drops_new_records_and_counts_them(redis_server: LocalRedis) -> None:
    async def body(client: Redis) -> None:
        meter = UsageMeter(client, max_pending=2)
        redis_server.kill()
        try:
            for i in range(4):
                meter.record(rec(f"r{i}"))
            assert (meter.pending, meter.dropped) == (2, 2)
        finally:
            redis_server.start()
        assert await meter.flush(10)
        assert (await query_usage(client, KEYS, "alpha", UsageWindow(0, HOUR + HOUR_S)))["totals"]["alpha"][
            "requests"] == 2
        await meter.close()

    run(redis_server, body)


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def bearer_request(key: str) -> Request:
    return Request({"type": "http", "headers": [(b"authorization", f"Bearer {key}".encode())]})


def test_known_keys_work_through_an_outage_longer_than_the_cache(redis_server: LocalRedis) -> None:
    """Confirmed shortly before the outage: accepted however long it lasts; confirmed long before
    it, or never: 503."""

    async def body(client: Redis) -> None:
        store = TenantStore(client, namespace_secret=b"s")
        _, recent_key = await store.create(TenantSpec(id="recent"))
        _, old_key = await store.create(TenantSpec(id="old"))
        clock = Clock()
        health = RedisHealth("platform", clock=clock)
        auth = Authenticator(store, stale_s=300, health=health)
        assert (await auth.authenticate(bearer_request(old_key))).id == "old"
        clock.now_s += 400
        assert (await auth.authenticate(bearer_request(recent_key))).id == "recent"
        clock.now_s += 10
        redis_server.kill()
        try:
            for _ in range(3):  # an hour into the outage, and more
                assert (await auth.authenticate(bearer_request(recent_key))).id == "recent"
                clock.now_s += 1800
            assert health.state()["redis"] == "unavailable" and health.state()["auth"] == "known_keys"
            for key in (old_key, "sk-ant-never-seen"):
                with pytest.raises(ApiError) as err:
                    await auth.authenticate(bearer_request(key))
                assert err.value.status == 503
        finally:
            redis_server.start()
        assert (await auth.authenticate(bearer_request(old_key))).id == "old"
        assert health.up

    run(redis_server, body)


def test_usage_keys_share_one_slot_per_tenant() -> None:
    from redis.crc import key_slot

    slots = {key_slot(k.encode()) for k in (KEYS.done("alpha", "r"), KEYS.hours("alpha"),
                                           KEYS.hour("alpha", f"{HOUR}:tiny"))}
    assert len(slots) == 1

