"""The asyncio Redis client of the ingress, the router and the replicas' publishers.

It fails fast (short socket timeouts, no retry on a timeout): a slow or absent Redis must degrade
the platform (cached keys, open limits, routing by load alone, publishing later) rather than stall
a request. A command that finds its pooled connection broken (the server restarted since) is sent
once more on a new connection: that costs a connect, refused at once while Redis is down, and
spares the first command after every restart a failure (which the router would count toward
opening its directory breaker).
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError


def redis_client(url: str, *, timeout_s: float = 1.0) -> Redis:
    """An asyncio Redis client that fails fast: short socket timeouts, one retry on a broken
    connection only."""
    retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
    return Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=retry)
