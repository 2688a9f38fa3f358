"""The platform's asyncio Redis client against a real redis-server that is killed and started again.

It fails fast (no retry on a timeout), yet a connection the pool kept from before a restart must not
fail a command: the first command on each stale pooled connection would otherwise raise, and the
router counts each such error toward opening its directory breaker (routing by load alone after a
Redis restart although Redis answers)."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from antumbra.platform.launch.redis_server import LocalRedis
from antumbra.platform.redis_client import redis_client


async def _fill_pool_restart_and_count_failures(server: LocalRedis, connections: int) -> int:
    client = redis_client(server.url, timeout_s=1.0)
    try:
        # Concurrent blocking commands hold `connections` pooled connections at once.
        await asyncio.gather(*(client.blpop([f"none-{i}"], timeout=0.2) for i in range(connections)))
        assert len(client.connection_pool._available_connections) >= connections
        server.kill()
        server.start()
        failures = 0
        for i in range(connections + 1):
            try:
                assert await client.set(f"k{i}", "v")
            except RedisConnectionError:
                failures += 1
        return failures
    finally:
        await client.aclose()


def test_pooled_connections_survive_a_redis_restart() -> None:
    with LocalRedis() as server:
        assert asyncio.run(_fill_pool_restart_and_count_failures(server, 4)) == 0


def test_a_redis_that_is_down_still_fails_fast() -> None:
    async def one_command(url: str) -> None:
        client = redis_client(url, timeout_s=0.5)
        try:
            await client.ping()
        finally:
            await client.aclose()

    with LocalRedis() as server:
        url = server.url
        server.kill()
        loop_time = asyncio.new_event_loop()
        try:
            started = loop_time.time()
            with pytest.raises(RedisConnectionError):
                loop_time.run_until_complete(one_command(url))
            assert loop_time.time() - started < 1.0  # refused at once, retried once at most
        finally:
            loop_time.close()
