"""The asyncio Redis client of the ingress, the router and the replicas' publishers.

It fails fast (short socket timeouts, no retries): a slow or absent Redis must degrade the
platform (cached keys, open limits, routing by load alone, publishing later) rather than stall
a request.
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff


def redis_client(url: str, *, timeout_s: float = 1.0) -> Redis:
    """An asyncio Redis client that fails fast: short socket timeouts, no retries."""
    return Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
    )
