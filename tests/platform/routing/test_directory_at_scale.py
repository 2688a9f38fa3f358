"""The directory's paths for many replicas, against real redis-servers: a lookup over more live
replicas than `max_candidates` (walked for the first block's holders), `apply_many`, and the
directory sharded by replica over three servers."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest
from redis.asyncio import Redis

from antumbra.cachestore.block_hash import BlockRemoved, BlockStored, EventBatch, block_hashes
from antumbra.platform.launch.redis_server import LocalRedis
from antumbra.platform.routing.directory import PrefixDirectory
from antumbra.platform.routing.sharded_directory import ShardedDirectory

REPLICAS = [f"r{i:03d}" for i in range(200)]
CHAINS = [block_hashes(list(range(k, k + 16 * 40)), 16, "tiny:scale") for k in range(6)]


@pytest.fixture(scope="module")
def servers() -> Iterator[list[LocalRedis]]:
    started = [LocalRedis() for _ in range(3)]
    try:
        for server in started:
            server.start()
        yield started
    finally:
        for server in started:
            server.stop()


def holdings(seed: int = 5) -> dict[str, tuple[int, int]]:
    """Replica -> (chain, leading blocks it holds), for a quarter of the replicas."""
    rng = random.Random(seed)
    return {r: (rng.randrange(len(CHAINS)), rng.randrange(1, 40)) for r in rng.sample(REPLICAS, 50)}


def expected(held: dict[str, tuple[int, int]], chain: int, live: set[str]) -> dict[str, int]:
    return {r: n for r, (c, n) in held.items() if c == chain and r in live}


async def _fill(directory: PrefixDirectory | ShardedDirectory, held: dict[str, tuple[int, int]]) -> None:
    batches = [
        EventBatch(r, 0, (BlockStored(tuple(CHAINS[c][:n])), BlockStored(tuple(CHAINS[c][n + 1 : n + 3]))))
        for r, (c, n) in held.items()
    ]
    results = await directory.apply_many(batches)
    assert all(r.applied and r.seq == 0 for r in results)


def _flush(clients: list[Redis]) -> None:
    async def flush() -> None:
        for c in clients:
            await c.flushall()

    asyncio.run(flush())


def test_many_live_replicas_get_the_answer_of_the_candidate_walk(servers: list[LocalRedis]) -> None:
    async def body() -> None:
        client = Redis(host="127.0.0.1", port=servers[0].port)
        try:
            await client.flushall()
            held = holdings()
            by_list = PrefixDirectory(client, "m", op_timeout_s=2.0, max_candidates=10_000)
            by_holders = PrefixDirectory(client, "m", op_timeout_s=2.0, max_candidates=8)
            await _fill(by_list, held)
            live = set(REPLICAS) - set(list(held)[:10])  # some holders are dead
            for chain in range(len(CHAINS)):
                want = expected(held, chain, live)
                assert await by_list.lookup(CHAINS[chain], live) == want
                assert await by_holders.lookup(CHAINS[chain], live) == want
            # A removed block ends a holder's match there, on both paths.
            r, (c, n) = next((r, h) for r, h in held.items() if r in live and h[1] > 3)
            await by_list.apply(EventBatch(r, 1, (BlockRemoved((CHAINS[c][2],)),)))
            assert (await by_holders.lookup(CHAINS[c], live))[r] == 2
            assert await by_holders.lookup([12345], live) == {}
        finally:
            await client.aclose()

    asyncio.run(body())


def test_sharded_directory_answers_as_one_and_spreads_replicas(servers: list[LocalRedis]) -> None:
    async def body() -> None:
        clients = [Redis(host="127.0.0.1", port=s.port) for s in servers]
        single_client = clients[0]
        try:
            for c in clients:
                await c.flushall()
            held = holdings(seed=9)
            shards = ShardedDirectory([PrefixDirectory(c, "m", op_timeout_s=2.0) for c in clients])
            await _fill(shards, held)
            live = set(REPLICAS)
            # Every replica's keys live on its one shard, and every shard got some replicas.
            per_shard = [sum(1 for r in held if shards.shard_of(r) is s) for s in shards.shards]
            assert min(per_shard) > 0 and sum(per_shard) == len(held)
            for c, shard in zip(clients, shards.shards, strict=True):
                on_it = {k.decode().rsplit(":", 1)[1] for k in await c.keys("antumbra:rblk:m:*")}
                assert on_it == {r for r in held if shards.shard_of(r) is shard}
            for chain in range(len(CHAINS)):
                assert await shards.lookup(CHAINS[chain], live) == expected(held, chain, live)
            r = next(iter(held))
            assert await shards.last_seq(r) == 0
            assert await shards.forget_replica(r) > 0
            assert r not in (await shards.lookup(CHAINS[held[r][0]], live) or {})
            # One shard down: the lookup cannot be answered (the router routes by load), not a partial answer.
            await single_client.aclose()
            servers[0].stop()
            try:
                assert await shards.lookup(CHAINS[0], live) is None
            finally:
                servers[0].start()
        finally:
            for c in clients[1:]:
                await c.aclose()

    asyncio.run(body())
