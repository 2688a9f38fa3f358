"""The cache-event publisher: a real engine on the tiny checkpoint feeding a real Redis directory."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from redis.asyncio import Redis

from antumbra import Engine, SamplingParams
from antumbra.cachestore.block_hash import AllCleared, BlockRemoved, BlockStored, EventBatch, block_hashes
from antumbra.platform.launch.redis_server import LocalRedis
from antumbra.platform.redis_client import redis_client
from antumbra.platform.replica.publisher import Publisher, _compact, attach, engine_tier
from antumbra.platform.routing.directory import PrefixDirectory
from tests.waiting import wait_until

MODEL = "tiny"
NAMESPACE = f"{MODEL}:tenant-a"
FAST = {"flush_interval_s": 0.01, "heartbeat_interval_s": 0.1, "retry_interval_s": 0.1}


@pytest.fixture(scope="module")
def redis_server() -> Iterator[LocalRedis]:
    with LocalRedis() as server:
        yield server


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> Engine:
    return Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="float32")


def _tokens(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 + 5 for i in range(n)]


async def _alookup(url: str, hashes: list[int], replica_id: str) -> int:
    """Leading blocks of `hashes` the directory says `replica_id` holds (a fresh client each time)."""
    redis = Redis.from_url(url)
    try:
        found = await PrefixDirectory(redis, MODEL, op_timeout_s=1.0).lookup(hashes, {replica_id})
    finally:
        await redis.aclose()
    assert found is not None
    return found.get(replica_id, 0)


def _lookup(url: str, hashes: list[int], replica_id: str) -> int:
    return asyncio.run(_alookup(url, hashes, replica_id))


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    wait_until(predicate, timeout_s, "the directory to catch up", poll_s=0.02)


def _generate(engine: Engine, prompt: list[int]) -> None:
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0), namespace=NAMESPACE)


def test_directory_follows_generation_clear_and_redis_restart(
    engine: Engine, redis_server: LocalRedis
) -> None:
    page = engine.model_config.page_size
    publisher = attach(engine, "replica-1", MODEL, redis_server.url, **FAST)
    try:
        prompt = _tokens(3 * page + 10, seed=1)
        hashes = block_hashes(prompt, page, NAMESPACE)
        _generate(engine, prompt)
        _wait_for(lambda: _lookup(redis_server.url, hashes, "replica-1") == 3)
        # Another namespace's hashes of the same tokens are not there.
        assert _lookup(redis_server.url, block_hashes(prompt, page, f"{MODEL}:tenant-b"), "replica-1") == 0

        engine.clear_cache()
        _wait_for(lambda: _lookup(redis_server.url, hashes, "replica-1") == 0)

        # Redis restarts empty while the replica is idle: the publisher notices and resyncs.
        _generate(engine, prompt)
        _wait_for(lambda: _lookup(redis_server.url, hashes, "replica-1") == 3)
        snapshots = publisher.snapshots
        redis_server.restart()
        # The publisher counts a snapshot after Redis answers it, so the lookup can see it first.
        _wait_for(lambda: _lookup(redis_server.url, hashes, "replica-1") == 3
                  and publisher.snapshots > snapshots)

        # Redis down while the cache changes: events are kept, and the full set arrives after.
        redis_server.kill()
        second = _tokens(2 * page + 3, seed=2)
        _generate(engine, second)
        _wait_for(lambda: publisher.failures > 0 and not publisher.healthy)
        redis_server.start()
        # Healthy once the write's answer is read, which can follow the lookup that sees the write.
        _wait_for(lambda: _lookup(redis_server.url, block_hashes(second, page, NAMESPACE), "replica-1") == 2
                  and publisher.healthy)
        assert _lookup(redis_server.url, hashes, "replica-1") == 3
    finally:
        publisher.close()
    # Closing forgets the replica's entries.
    assert _lookup(redis_server.url, hashes, "replica-1") == 0


class FakeTree:
    def __init__(self) -> None:
        self.hashes: list[int] = []

    def _nodes(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(block_hash=h, depth=i + 1) for i, h in enumerate(self.hashes)]


def _fake_engine(hot: bool = False) -> SimpleNamespace:
    """Just the engine surface the publisher reads, with a tree whose hashes a test sets directly."""
    tree = FakeTree()
    return SimpleNamespace(
        kv=SimpleNamespace(tree=tree),
        pools=SimpleNamespace(hot=object() if hot else None),
        subscribe=None,
        cached_block_hashes=lambda: [n.block_hash for n in sorted(tree._nodes(), key=lambda n: n.depth)],
    )


def test_stale_seq_gap_and_tier_handling(redis_server: LocalRedis) -> None:
    async def main() -> None:
        now = [0.0]
        url = redis_server.url
        engine = _fake_engine(hot=True)
        assert engine_tier(engine) == "host" and engine_tier(_fake_engine()) == "device"
        # An earlier publisher with this id left seq 41 behind.
        redis = Redis.from_url(url)
        await PrefixDirectory(redis, MODEL).apply(EventBatch("replica-2", 41, (BlockStored((7,)),)))
        publisher = Publisher(
            engine, "replica-2", MODEL, lambda: redis_client(url), clock=lambda: now[0], **FAST
        )
        engine.kv.tree.hashes = [1, 2, 3]
        assert await publisher.flush_once()  # snapshot at seq 0: stale, so jump past 41
        assert publisher.gaps == 1
        assert await publisher.flush_once()  # snapshot at seq 42
        assert await PrefixDirectory(redis, MODEL).last_seq("replica-2") == 42
        assert await _alookup(url, [1, 2, 3], "replica-2") == 3
        assert await _alookup(url, [7], "replica-2") == 0

        # Events are re-tagged with the replica's tier; removals match the stored entries.
        publisher.on_event(0, BlockStored((4,), "device"))
        publisher.on_event(1, BlockRemoved((1,), "device"))
        assert await publisher.flush_once()
        members = await redis.smembers(PrefixDirectory(redis, MODEL).block_key(4))
        assert members == {b"replica-2|host"}
        assert not await redis.exists(PrefixDirectory(redis, MODEL).block_key(1))
        await publisher._redis.aclose()
        await redis.aclose()

    asyncio.run(main())


def test_batches_are_bounded_and_heartbeats_spot_a_lost_directory(redis_server: LocalRedis) -> None:
    async def main() -> None:
        now = [0.0]
        url = redis_server.url
        engine = _fake_engine()
        publisher = Publisher(
            engine,
            "replica-3",
            MODEL,
            lambda: redis_client(url),
            clock=lambda: now[0],
            max_batch_events=2,
            **FAST,
        )
        assert await publisher.flush_once()  # the first snapshot (empty tree)
        for i in range(3):
            publisher.on_event(i, BlockStored((100 + i,)))
            engine.kv.tree.hashes.append(100 + i)
        assert await publisher.flush_once() and publisher.pending == 1
        assert await publisher.flush_once() and publisher.pending == 0
        assert await _alookup(url, [100, 101, 102], "replica-3") == 3
        # The directory loses everything while the replica is idle: the next heartbeat resyncs.
        redis = Redis.from_url(url)
        await redis.flushall()
        now[0] += 1.0
        assert await publisher.flush_once()
        assert publisher.gaps == 1 and publisher.snapshots == 2
        assert await _alookup(url, [100, 101, 102], "replica-3") == 3
        await redis.aclose()
        await publisher._redis.aclose()

    asyncio.run(main())


def test_compact_merges_runs_in_order() -> None:
    events = [
        BlockStored((1,)),
        BlockStored((2,)),
        BlockRemoved((1,)),
        AllCleared(),
        BlockStored((3,), "host"),
    ]
    assert _compact(events) == (
        BlockStored((1, 2)),
        BlockRemoved((1,)),
        AllCleared(),
        BlockStored((3,), "host"),
    )


def test_attach_hook_is_picklable() -> None:
    import pickle

    from antumbra.platform.replica.publisher import on_start_hook

    hook = pickle.loads(pickle.dumps(on_start_hook(MODEL, "redis://127.0.0.1:1/0", flush_interval_s=0.05)))
    assert callable(hook)
