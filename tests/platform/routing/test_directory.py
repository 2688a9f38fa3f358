"""The prefix directory against a real redis-server started by a fixture."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest
from redis.asyncio import Redis

from antumbra.cachestore.block_hash import AllCleared, BlockRemoved, BlockStored, EventBatch, block_hashes
from antumbra.platform.launch.redis_server import LocalRedis
from antumbra.platform.routing.circuit_breaker import CircuitBreaker
from antumbra.platform.routing.directory import DirectoryUnavailable, PrefixDirectory

T = TypeVar("T")


@pytest.fixture
def redis_proc() -> Iterator[LocalRedis]:
    """A redis-server of our own that a test can kill and start again on the same port."""
    with LocalRedis() as server:
        yield server


def _client(port: int) -> Redis:
    return Redis(host="127.0.0.1", port=port, socket_timeout=0.5, socket_connect_timeout=0.5)


def run(redis_proc: LocalRedis, body: Callable[[Redis], Awaitable[T]]) -> T:
    async def main() -> T:
        client = _client(redis_proc.port)
        try:
            return await body(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


def _directory(client: Redis, **kwargs: object) -> PrefixDirectory:
    kwargs.setdefault("op_timeout_s", 0.5)  # generous: a loaded CI machine must not trip it here
    return PrefixDirectory(client, "tiny", prefix="t", **kwargs)  # type: ignore[arg-type]


HASHES = block_hashes(list(range(16 * 40)), 16, "tiny:tenant-a")  # 40 chained blocks


def test_apply_stored_removed_cleared_and_lookup(redis_proc: LocalRedis) -> None:
    async def body(client: Redis) -> None:
        d = _directory(client)
        live = {"A", "B"}
        r = await d.apply(EventBatch("A", 0, (BlockStored(tuple(HASHES[:10])),)))
        assert r.applied and r.previous_seq is None and not r.gap
        await d.apply(EventBatch("B", 0, (BlockStored(tuple(HASHES[:4]), "host"),)))
        assert await d.lookup(HASHES, live) == {"A": 10, "B": 4}
        assert await d.lookup(HASHES[:3], live) == {"A": 3, "B": 3}
        assert await client.smembers(d.block_key(HASHES[0])) == {b"A|device", b"B|host"}

        # A loses block 5: its leading run ends at 5 even though it still holds 6..9.
        await d.apply(EventBatch("A", 1, (BlockRemoved((HASHES[5],)),)))
        assert await d.lookup(HASHES, live) == {"A": 5, "B": 4}
        # A lookup whose first block nobody holds matches nothing, whatever follows.
        assert await d.lookup([12345, *HASHES], live) == {}
        assert await d.lookup(block_hashes(list(range(64)), 16, "tiny:tenant-b"), live) == {}

        # Removing from the wrong tier does nothing; a host copy still counts as a match.
        await d.apply(EventBatch("B", 1, (BlockRemoved((HASHES[0],), "device"),)))
        assert (await d.lookup(HASHES, live))["B"] == 4

        await d.apply(EventBatch("A", 2, (AllCleared(),)))
        assert await d.lookup(HASHES, live) == {"B": 4}
        assert await client.exists(d.replica_blocks_key("A")) == 0
        assert await client.smembers(d.block_key(HASHES[7])) == set()
        # Cleared then stored again within one batch: order inside a batch is kept.
        await d.apply(EventBatch("A", 3, (BlockStored(tuple(HASHES[:2])), AllCleared(),
                                          BlockStored(tuple(HASHES[:3])))))
        assert await d.lookup(HASHES, live) == {"A": 3, "B": 4}

    run(redis_proc, body)


def test_stale_and_duplicate_batches_are_ignored(redis_proc: LocalRedis) -> None:
    async def body(client: Redis) -> None:
        d = _directory(client)
        live = {"A"}
        assert (await d.apply(EventBatch("A", 5, (BlockStored(tuple(HASHES[:6])),)))).gap  # no batch 0 seen
        dup = await d.apply(EventBatch("A", 5, (BlockRemoved(tuple(HASHES[:6])),)))
        assert not dup.applied and dup.previous_seq == 5
        old = await d.apply(EventBatch("A", 3, (AllCleared(),)))
        assert not old.applied
        assert await d.lookup(HASHES, live) == {"A": 6}
        nxt = await d.apply(EventBatch("A", 6, (BlockRemoved((HASHES[2],)),)))
        assert nxt.applied and nxt.previous_seq == 5 and not nxt.gap
        assert (await d.apply(EventBatch("A", 9, ()))).gap
        assert await d.last_seq("A") == 9
        assert await d.lookup(HASHES, live) == {"A": 2}
        # Big sequence numbers survive the round trip through Lua exactly.
        assert (await d.apply(EventBatch("A", 10**15 + 1, ()))).applied
        assert await d.last_seq("A") == 10**15 + 1

    run(redis_proc, body)


def test_lookup_is_batched_and_reads_nothing_past_the_first_miss(redis_proc: LocalRedis) -> None:
    async def body(client: Redis) -> None:
        many = block_hashes(list(range(16 * 600)), 16, "tiny:long")
        d = _directory(client, batch_size=16, max_batch_size=64)
        await d.apply(EventBatch("A", 0, (BlockStored(tuple(many[:500])),)))
        await d.apply(EventBatch("B", 0, (BlockStored(tuple(many[:20])),)))
        assert await d.lookup(many[:1], {"A"}) == {"A": 1}  # loads the script

        async def counted(live: set[str]) -> tuple[dict[str, int] | None, int, int]:
            await client.config_resetstat()
            result = await d.lookup(many, live)
            stats = await client.info("commandstats")
            return (result, stats.get("cmdstat_evalsha", {}).get("calls", 0),
                    stats.get("cmdstat_smembers", {}).get("calls", 0))

        # Rounds of 16, 32, then 64 hashes: block 500 (A's first miss) falls in the 10th.
        assert await counted({"A", "B"}) == ({"A": 500, "B": 20}, 10, 501)
        # B alone: the second round stops at block 20, the first B lacks.
        assert await counted({"B"}) == ({"B": 20}, 2, 21)
        # A miss at block 0 costs one round trip and one read.
        assert await counted({"C"}) == ({}, 1, 1)

    run(redis_proc, body)


def test_dead_replica_is_ignored_at_once_and_reaped_when_its_liveness_lapses(redis_proc: LocalRedis) -> None:
    async def body(client: Redis) -> None:
        d = _directory(client, replica_ttl_s=0.3, reap_interval_s=0.0)
        await d.apply(EventBatch("A", 0, (BlockStored(tuple(HASHES[:8])),)))
        await d.apply(EventBatch("B", 0, (BlockStored(tuple(HASHES[:12])),)))
        # B is not live for this caller: ignored at once, but kept while its heartbeat holds.
        assert await d.lookup(HASHES, {"A"}) == {"A": 8}
        await d.drain()
        assert await client.sismember(d.block_key(HASHES[0]), "B|device")
        # A keeps heartbeating; B does not and lapses.
        deadline = time.monotonic() + 5.0
        while await d.is_alive("B"):
            assert time.monotonic() < deadline, "liveness key did not expire"
            await d.heartbeat("A")
            await asyncio.sleep(0.05)
        assert await d.is_alive("A")
        assert await d.lookup(HASHES, {"A"}) == {"A": 8}
        await d.drain()
        assert d.stats().reaped_replicas == 1
        for h in HASHES[:12]:
            assert not await client.sismember(d.block_key(h), "B|device")
        assert await client.exists(d.replica_blocks_key("B")) == 0
        assert await d.lookup(HASHES, {"A", "B"}) == {"A": 8}

    run(redis_proc, body)


def test_forget_replica_and_ttls(redis_proc: LocalRedis) -> None:
    async def body(client: Redis) -> None:
        d = _directory(client, ttl_s=600, replica_ttl_s=20)
        await d.apply(EventBatch("A", 0, (BlockStored(tuple(HASHES[:4])),)))
        await d.apply(EventBatch("B", 0, (BlockStored(tuple(HASHES[:4])),)))
        for h in HASHES[:4]:
            assert 590_000 < await client.pttl(d.block_key(h)) <= 600_000
        assert 0 < await client.pttl(d.replica_key("A")) <= 20_000
        assert 0 < await client.pttl(d.replica_blocks_key("A")) <= 600_000
        await client.pexpire(d.replica_key("A"), 1000)
        await d.heartbeat("A")
        assert await client.pttl(d.replica_key("A")) > 1000
        assert await d.forget_replica("A") == 4
        assert not await d.is_alive("A")
        assert await d.last_seq("A") is None
        assert await d.lookup(HASHES, {"A", "B"}) == {"B": 4}

    run(redis_proc, body)


def test_namespaces_never_share_entries(redis_proc: LocalRedis) -> None:
    async def body(client: Redis) -> None:
        d = _directory(client)
        prompt = list(range(16 * 8))
        await d.apply(EventBatch("A", 0, (BlockStored(tuple(block_hashes(prompt, 16, "tiny:t1"))),)))
        assert await d.lookup(block_hashes(prompt, 16, "tiny:t1"), {"A"}) == {"A": 8}
        assert await d.lookup(block_hashes(prompt, 16, "tiny:t2"), {"A"}) == {}
        other_model = PrefixDirectory(client, "other", prefix="t", op_timeout_s=0.5)
        assert await other_model.lookup(block_hashes(prompt, 16, "tiny:t1"), {"A"}) == {}

    run(redis_proc, body)


def test_works_with_decoded_responses(redis_proc: LocalRedis) -> None:
    async def main() -> None:
        client = Redis(host="127.0.0.1", port=redis_proc.port, decode_responses=True, socket_timeout=0.5)
        try:
            d = _directory(client)
            await d.apply(EventBatch("A", 0, (BlockStored(tuple(HASHES[:3]), "host"),)))
            await d.apply(EventBatch("B", 7, (BlockStored(tuple(HASHES[:2])),)))
            assert await d.lookup(HASHES, {"A", "B"}) == {"A": 3, "B": 2}
            assert await d.last_seq("B") == 7
            assert await d.forget_replica("A") == 3
        finally:
            await client.aclose()

    asyncio.run(main())


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_breaker_state_machine() -> None:
    clock = FakeClock()
    b = CircuitBreaker(failure_threshold=2, cooldown_s=10, clock=clock)
    assert b.allow() and b.state == "closed"
    b.record_failure()
    b.record_success()
    b.record_failure()
    assert b.state == "closed"
    b.record_failure()
    assert b.state == "open" and b.opens == 1 and not b.allow()
    clock.now += 9.9
    assert not b.allow()
    clock.now += 0.1
    assert b.state == "half_open"
    assert b.allow()  # the one trial
    assert not b.allow()  # others wait for its verdict
    b.record_failure()
    assert b.state == "open" and b.opens == 2
    clock.now += 10
    assert b.allow()
    b.abandon()
    assert b.allow()
    b.record_success()
    assert b.state == "closed" and b.allow() and b.allow()
    assert b.rejected == 3


def test_breaker_opens_when_redis_dies_and_closes_when_it_returns(redis_proc: LocalRedis) -> None:
    clock = FakeClock()

    async def body(client: Redis) -> None:
        d = _directory(client, clock=clock, op_timeout_s=0.25, write_timeout_s=0.2, failure_threshold=3,
                       cooldown_s=30)
        await d.apply(EventBatch("A", 0, (BlockStored(tuple(HASHES[:6])),)))
        assert await d.lookup(HASHES, {"A"}) == {"A": 6}

        redis_proc.kill()
        # How fast these answers come is measured in benchmarks/serving/directory_failure.py.
        for i in range(3):  # each fails (refused, or timed out) and counts toward the threshold
            assert await d.lookup(HASHES, {"A"}) is None
            assert d.stats().errors + d.stats().timeouts == i + 1
        assert d.breaker.state == "open"
        for _ in range(100):  # open: answered without touching Redis, so no further failure counts
            assert await d.lookup(HASHES, {"A"}) is None
        stats = d.stats()
        assert stats.fallbacks == 103 and stats.errors + stats.timeouts == 3 and stats.breaker_opens == 1
        assert d.breaker.rejected == 100
        with pytest.raises(DirectoryUnavailable):
            await d.apply(EventBatch("A", 1, ()))

        # Back on the same port, empty (no persistence): the replica notices the gap and resyncs.
        redis_proc.restart()
        assert await d.lookup(HASHES, {"A"}) is None  # still cooling down: no trial yet
        deadline = time.monotonic() + 10.0
        result = None
        while result is None:  # a trial may hit a connection the crash left broken; the next one reconnects
            assert time.monotonic() < deadline, "breaker never closed"
            clock.now += 30
            result = await d.lookup(HASHES, {"A"})
        assert d.breaker.state == "closed"
        assert result == {}
        resync = await d.apply(EventBatch("A", 2, (AllCleared(), BlockStored(tuple(HASHES[:6])))))
        assert resync.applied and resync.gap
        assert await d.lookup(HASHES, {"A"}) == {"A": 6}

    run(redis_proc, body)


def test_slow_redis_counts_as_failure(redis_proc: LocalRedis) -> None:
    clock = FakeClock()

    async def body(client: Redis) -> None:
        d = _directory(client, clock=clock, op_timeout_s=0.05, failure_threshold=1, cooldown_s=5)
        await d.apply(EventBatch("A", 0, (BlockStored(tuple(HASHES[:6])),)))
        admin = _client(redis_proc.port)
        try:
            # Every client's next command waits; 1.5 s outlasts the op timeout even on a loaded machine
            # (a shorter pause could end before the lookup reaches Redis).
            await admin.execute_command("CLIENT", "PAUSE", 1500, "ALL")
            # Given up at the op timeout (a timeout, not an error); benchmarks/serving/directory_failure.py
            # measures how long that takes.
            assert await d.lookup(HASHES, {"A"}) is None
            assert d.stats().timeouts == 1 and d.stats().errors == 0 and d.breaker.state == "open"
        finally:
            await admin.aclose()
        clock.now += 5
        deadline = time.monotonic() + 5.0
        result = None
        while result is None:
            assert time.monotonic() < deadline, "breaker never closed"
            result = await d.lookup(HASHES, {"A"})
            clock.now += 5
        assert result == {"A": 6}

    run(redis_proc, body)
