"""What an ingress knows of its Redis: up, or down since when.

Every call that reaches Redis or fails on it may report here, and `watch` pings every
`period_s`, so an outage is seen within about a second even when no request comes. Authentication
reads `last_ok_s` (how long before an outage a key must have been confirmed to keep working
through it); `/health` reports `state()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from antumbra.platform.ingress.errors import REDIS_ERRORS


class RedisHealth:
    """Up or down, from the last answers of Redis; `owner` is "platform" (it restarts the Redis it
    started) or "external" (only reported)."""

    def __init__(self, owner: str = "external", clock: Callable[[], float] = time.monotonic) -> None:
        self.owner = owner
        self._clock = clock
        self.last_ok_s = clock()
        self.down_since_s: float | None = None

    def now(self) -> float:
        return self._clock()

    @property
    def up(self) -> bool:
        return self.down_since_s is None

    def ok(self) -> None:
        self.last_ok_s = self._clock()
        self.down_since_s = None

    def failed(self) -> None:
        if self.down_since_s is None:
            self.down_since_s = self._clock()

    async def check(self, redis: Any, timeout_s: float) -> bool:
        """Ping once; record and return whether Redis answered within `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                await redis.ping()
        except REDIS_ERRORS:
            self.failed()
            return False
        self.ok()
        return True

    async def watch(self, redis: Any, period_s: float, timeout_s: float) -> None:
        """Ping every `period_s` for ever (a task of the ingress)."""
        while True:
            with contextlib.suppress(Exception):  # a bug here must not end the watch
                await self.check(redis, timeout_s)
            await asyncio.sleep(period_s)

    def state(self) -> dict[str, Any]:
        """`/health`'s view: Redis ok or unavailable (for how long), who restarts it, and what auth does."""
        down_s = None if self.down_since_s is None else round(self._clock() - self.down_since_s, 3)
        return {
            "redis": "ok" if self.up else "unavailable",
            "redis_owner": self.owner,
            "redis_down_s": down_s,
            "auth": "live" if self.up else "known_keys",
        }
