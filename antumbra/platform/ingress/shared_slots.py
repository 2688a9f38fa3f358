"""Borrowing the slots other ingresses leave idle: every ingress's generations in flight, in Redis.

The capacity gate (`capacity.py`) gives each ingress an equal share of a model's running slots.
Serve's proxy (or HAProxy) spreads requests over the ingress replicas by its own view of their
queues, and a burst after an idle spell can land unevenly; an ingress past its share would then
refuse requests that the model's replicas have room for. So each ingress publishes, for every
gated model, how many generations it has in flight:

    HSET <prefix>:slots:<model>  <ingress id>  "<in flight> <expiry, ms since the epoch>"

at every watch refresh and each time it asks to borrow, and an ingress at its share admits one
more only while the live counts of all ingresses (its own exact, the others' as last published)
add up to less than the model's running slots. Invariants:

- an ingress never admits past its share unless the published counts leave room below the total;
- an entry whose expiry has passed counts as nothing (its ingress stopped publishing: dead or
  stopped) and the next publish or borrow removes it; the hash itself expires `ttl_s` after the
  last publish, so a platform that stopped leaves nothing behind;
- Redis down or slow: nothing is borrowed, the share alone decides (what the gate did without it).

Counts are as fresh as the last publish, so borrowers deciding together may overbook by a little;
Ray's queue (`max_queued_requests`) holds that. The clock is injected for tests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from redis.asyncio import Redis

from antumbra.platform.ingress.errors import REDIS_ERRORS

log = logging.getLogger(__name__)


class SharedSlots:
    """This ingress's counts in Redis, and the others' as they published them (module docstring)."""

    def __init__(
        self,
        redis: Redis,
        key_prefix: str,
        ingress_id: str,
        ttl_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.key_prefix = key_prefix
        self.ingress_id = ingress_id
        self.ttl_s = ttl_s
        self.clock = clock

    def key(self, model: str) -> str:
        return f"{self.key_prefix}:slots:{model}"

    def _entry(self, in_flight: int) -> str:
        return f"{in_flight} {int((self.clock() + self.ttl_s) * 1000)}"

    async def publish(self, in_flight: Mapping[str, int]) -> None:
        """Write this ingress's count for each model (a failure is logged, not raised)."""
        for model, count in in_flight.items():
            await self._exchange(model, count)

    async def may_borrow(self, model: str, in_flight: int, total_slots: int) -> bool:
        """Whether one more generation fits: this ingress's `in_flight` plus every other live
        ingress's published count below `total_slots`. Publishes `in_flight` on the way."""
        others = await self._exchange(model, in_flight)
        return others is not None and in_flight + others < total_slots

    async def _exchange(self, model: str, in_flight: int) -> int | None:
        """Publish this ingress's count and read the others': their live total, None if Redis failed.
        Expired entries are removed on the way."""
        key = self.key(model)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hset(key, self.ingress_id, self._entry(in_flight))
                pipe.pexpire(key, int(self.ttl_s * 1000))
                pipe.hgetall(key)
                _, _, entries = await pipe.execute()
            others, expired = _live_total(entries, self.ingress_id, self.clock() * 1000)
            if expired:
                await self.redis.hdel(key, *expired)
        except REDIS_ERRORS as exc:
            log.debug("could not exchange the slots in flight of %s: %r", model, exc)
            return None
        return others


def _live_total(entries: Mapping[Any, Any], ingress_id: str, now_ms: float) -> tuple[int, list[str]]:
    """(the other ingresses' live counts added up, the ids of expired entries)."""
    others, expired = 0, []
    for raw_id, raw_entry in entries.items():
        ingress = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
        if ingress == ingress_id:
            continue
        count, expiry_ms = _parse(raw_entry)
        if expiry_ms <= now_ms:
            expired.append(ingress)
        else:
            others += count
    return others, expired


def _parse(raw: bytes | str) -> tuple[int, float]:
    """(count, expiry ms) of an entry; one that does not parse counts as expired."""
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    try:
        count, expiry = text.split()
        return int(count), float(expiry)
    except ValueError:
        return 0, 0.0
