"""What a failing prefix directory costs the router: lookup latency healthy, with Redis down, with the
circuit breaker open, and with Redis stalled; a real redis-server on this machine.

The router asks the directory once per request (`platform/routing/directory.py`). When Redis fails
the lookup must give up within `op_timeout_s` and, after `failure_threshold` failures, stop asking
at all (breaker open) so that routing by load costs next to nothing. Measured:

* healthy: a 40-block lookup that all matches, `LOOKUPS` times (p50 / p99);
* redis killed: each of the failing lookups until the breaker opens (connection refused);
* breaker open: `OPEN_LOOKUPS` lookups answered without Redis (mean per lookup);
* redis paused (`CLIENT PAUSE`): one lookup that has to time out, against `op_timeout_s`.

Ratios from the same run: open vs healthy per lookup, and the stalled lookup vs its timeout.

    python -m benchmarks run platform --only directory_failure [--smoke]
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from ..lib.context import Context
from ..lib.timing import percentile

DEVICE = "cpu"

LOOKUPS = 500
OPEN_LOOKUPS = 10_000
OP_TIMEOUT_S = 0.05
FAILURE_THRESHOLD = 3


async def _timed(coro: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    result = await coro
    return result, time.perf_counter() - started


class _FrozenClock:
    """Keeps the breaker open for the whole measurement (its cooldown never passes)."""

    def __call__(self) -> float:
        return 0.0


async def _measure(port: int, server: Any, lookups: int, open_lookups: int) -> dict[str, Any]:
    from redis.asyncio import Redis

    from antumbra.cachestore.block_hash import BlockStored, EventBatch, block_hashes
    from antumbra.platform.routing.directory import PrefixDirectory

    hashes = block_hashes(list(range(16 * 40)), 16, "tiny:tenant-a")
    client = Redis(host="127.0.0.1", port=port, socket_timeout=0.5, socket_connect_timeout=0.5)
    directory = PrefixDirectory(
        client, "tiny", prefix="bench", clock=_FrozenClock(), op_timeout_s=OP_TIMEOUT_S,
        failure_threshold=FAILURE_THRESHOLD, cooldown_s=3600,
    )
    try:
        await directory.apply(EventBatch("A", 0, (BlockStored(tuple(hashes)),)))
        healthy = []
        for _ in range(lookups):
            matched, seconds = await _timed(directory.lookup(hashes, {"A"}))
            assert matched == {"A": 40}, matched
            healthy.append(seconds)

        server.kill()
        failing = []
        for _ in range(FAILURE_THRESHOLD):
            matched, seconds = await _timed(directory.lookup(hashes, {"A"}))
            assert matched is None
            failing.append(seconds)
        assert directory.breaker.state == "open"
        started = time.perf_counter()
        for _ in range(open_lookups):
            await directory.lookup(hashes, {"A"})
        open_s = (time.perf_counter() - started) / open_lookups
    finally:
        await client.aclose()

    server.restart()
    client = Redis(host="127.0.0.1", port=port, socket_timeout=0.5, socket_connect_timeout=0.5)
    admin = Redis(host="127.0.0.1", port=port)
    stalled = PrefixDirectory(client, "tiny", prefix="bench", op_timeout_s=OP_TIMEOUT_S, failure_threshold=1)
    try:
        await stalled.apply(EventBatch("A", 0, (BlockStored(tuple(hashes)),)))
        await admin.execute_command("CLIENT", "PAUSE", int(OP_TIMEOUT_S * 1000 * 6), "ALL")
        matched, paused_s = await _timed(stalled.lookup(hashes, {"A"}))
        assert matched is None and stalled.stats().timeouts == 1
    finally:
        await client.aclose()
        await admin.aclose()

    healthy_p50 = statistics.median(healthy)
    return {
        "healthy_lookup_ms": {"p50": healthy_p50 * 1e3, "p99": percentile(healthy, 0.99) * 1e3},
        "redis_killed_lookup_ms": [s * 1e3 for s in failing],
        "breaker_open_lookup_us": open_s * 1e6,
        "redis_paused_lookup_ms": paused_s * 1e3,
        "op_timeout_ms": OP_TIMEOUT_S * 1e3,
        "ratios": {
            "breaker_open_vs_healthy_lookup": open_s / healthy_p50,
            "redis_paused_lookup_vs_op_timeout": paused_s / OP_TIMEOUT_S,
        },
    }


def run(ctx: Context) -> dict[str, Any]:
    from antumbra.platform.launch.redis_server import LocalRedis

    lookups, open_lookups = (20, 100) if ctx.smoke else (LOOKUPS, OPEN_LOOKUPS)
    with LocalRedis() as server:
        figures = asyncio.run(_measure(server.port, server, lookups, open_lookups))
    return {"lookups": lookups, "open_lookups": open_lookups, **figures}
