"""Folding the open usage entries that a dead ingress left behind (the layout is `usage.py`'s).

Every ingress runs a `Sweeper`: at start-up and every `SWEEP_EVERY_S`, if it takes the sweep lease
(`SET NX PX`, held for one interval and left to expire, so that one ingress sweeps at a time), it
finds, for each tenant with usage, the open entries whose heartbeat (`usage_open`) is older than
`STALE_AFTER_S` by Redis's clock, and folds each with one script: the entry's counts (and one
request) go into the hour's counters of its last write, under the request's done key, and the entry
is deleted. The script checks the staleness again, atomically, so an entry written meanwhile is left
alone; and the done key makes a fold and a close (or two folds, had a sweep outlasted its lease)
count the request once.

After Redis was away nobody could heartbeat: a sweeper whose Redis calls failed waits
`STALE_AFTER_S` once Redis answers again before it folds anything, so that the live ingresses stamp
their entries and write their queued closes first. (An ingress that starts during such a moment does
not know of it; an ingress whose event loop stalls longer than `STALE_AFTER_S` has its streams
folded early, and they count what was written by then.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from antumbra.platform.ingress.usage import DONE_TTL_S, HOUR_S, UsageKeys, index_member
from antumbra.platform.ingress.usage_open import OPEN_COUNTERS, STALE_AFTER_S

log = logging.getLogger(__name__)

SWEEP_EVERY_S = 5.0

# KEYS: done key, open entry, open index, hour hash, hours index. ARGV: request id, stale after
# (ms), done TTL, index member, hour epoch, the entry's at_s when read, then the counter names.
# Returns 1 when folded now, 0 when there was nothing to fold, -1 when the entry changed since read.
_FOLD = """
local beat = redis.call('ZSCORE', KEYS[3], ARGV[1])
if not beat then
  return 0
end
local now = redis.call('TIME')
if tonumber(beat) > now[1] * 1000 + math.floor(now[2] / 1000) - tonumber(ARGV[2]) then
  return 0
end
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('ZREM', KEYS[3], ARGV[1])
  return 0
end
if redis.call('HGET', KEYS[2], 'at_s') ~= ARGV[6] then
  return -1
end
redis.call('ZREM', KEYS[3], ARGV[1])
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[3]) then
  redis.call('DEL', KEYS[2])
  return 0
end
redis.call('HINCRBY', KEYS[4], 'requests', 1)
for i = 7, #ARGV do
  redis.call('HINCRBY', KEYS[4], ARGV[i], tonumber(redis.call('HGET', KEYS[2], ARGV[i]) or '0'))
end
redis.call('ZADD', KEYS[5], ARGV[5], ARGV[4])
redis.call('DEL', KEYS[2])
return 1
"""


async def stale_entries(redis: Any, keys: UsageKeys, stale_after_s: float) -> list[tuple[str, str]]:
    """(tenant, request id) of every open entry whose heartbeat is older than `stale_after_s`."""
    seconds, micros = await redis.time()
    cutoff_ms = seconds * 1000 + micros // 1000 - int(stale_after_s * 1000)
    tenants = sorted(t.decode() for t in await redis.smembers(keys.tenants))
    pipe = redis.pipeline(transaction=False)
    for tenant in tenants:
        pipe.zrangebyscore(keys.open_index(tenant), "-inf", cutoff_ms)
    found = await pipe.execute()
    return [(tenant, rid.decode()) for tenant, ids in zip(tenants, found, strict=True) for rid in ids]


async def fold_stale(redis: Any, keys: UsageKeys, stale_after_s: float = STALE_AFTER_S) -> int:
    """Fold every open entry older than `stale_after_s` into the hour's counters; how many were
    folded now (an entry folded, closed or rewritten meanwhile is not)."""
    stale = await stale_entries(redis, keys, stale_after_s)
    if not stale:
        return 0
    pipe = redis.pipeline(transaction=False)
    for tenant, rid in stale:
        pipe.hmget(keys.open_entry(tenant, rid), "model", "at_s")
    read = await pipe.execute()
    pipe = redis.pipeline(transaction=False)
    for (tenant, rid), (model, at_s) in zip(stale, read, strict=True):
        model, at_s = (model or b"").decode(), (at_s or b"0").decode()
        hour_s = int(float(at_s) // HOUR_S) * HOUR_S
        member = index_member(hour_s, model)
        pipe.eval(_FOLD, 5, keys.done(tenant, rid), keys.open_entry(tenant, rid), keys.open_index(tenant),
                  keys.hour(tenant, member), keys.hours(tenant), rid, int(stale_after_s * 1000), DONE_TTL_S,
                  member, hour_s, at_s, *OPEN_COUNTERS)
    folded = sum(r == 1 for r in await pipe.execute())
    if folded:
        log.warning("folded the usage of %d streams left open by a stopped ingress", folded)
    return folded


class Sweeper:
    """One ingress's sweeps: `run` forever, or `sweep` once (module docstring)."""

    def __init__(self, redis: Any, keys: UsageKeys, owner: str, every_s: float = SWEEP_EVERY_S,
                 stale_after_s: float = STALE_AFTER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.redis = redis
        self.keys = keys
        self.owner = owner
        self.every_s = every_s
        self.stale_after_s = stale_after_s
        self.folded = 0
        self._clock = clock
        self._failed = False
        self._grace_until = -float("inf")

    async def sweep(self) -> int:
        """One sweep if this ingress takes the lease and is not waiting after an outage; how many
        entries it folded."""
        try:
            leased = await self.redis.set(self.keys.sweep_lease, self.owner, nx=True,
                                          px=max(1, int(self.every_s * 1000)))
        except Exception:
            self._failed = True
            raise
        if self._failed:  # Redis is back: give the live ingresses time to stamp their entries
            self._failed = False
            self._grace_until = self._clock() + self.stale_after_s
        if not leased or self._clock() < self._grace_until:
            return 0
        try:
            folded = await fold_stale(self.redis, self.keys, self.stale_after_s)
        except Exception:
            self._failed = True
            raise
        self.folded += folded
        return folded

    async def run(self) -> None:
        while True:
            try:
                await self.sweep()
            except Exception as exc:  # Redis away: the next sweep tries again
                log.info("usage sweep failed: %r", exc)
            await asyncio.sleep(self.every_s)
