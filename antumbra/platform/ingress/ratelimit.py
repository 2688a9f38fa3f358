"""Per-tenant rate and concurrency limits, enforced in Redis so every ingress replica shares them.

Rate limits use GCRA (the generic cell rate algorithm), one Lua script:

* A limit of `rate` units per minute has the emission interval `T = 60 / rate`
  seconds: the time one unit "costs". `burst` is how many units may go at once
  (default: one minute's worth, `burst = rate`), so the burst tolerance is
  `tau = burst * T`.
* Each key stores one number, the theoretical arrival time TAT: when the key
  would be idle again if nothing more came. Its debt at time `now` is
  `max(TAT - now, 0)`.
* A request of `cost` units is allowed iff `debt + cost * T <= tau`; then
  `TAT = now + debt + cost * T`. Otherwise it may retry after
  `debt + cost * T - tau` seconds, when enough debt has drained.
* A cost above `burst` can never pass, however long the caller waits; it is
  reported with `never=True` rather than as an endless wait.
* `remaining = floor((tau - debt) / T)` units and `reset_after = debt` seconds
  (until the key is back at full burst) give the `x-ratelimit-*` headers.

Time is Redis's own (`TIME`, to the millisecond), so replicas with skewed clocks
still agree, and each key expires (`PX`) once its debt is paid: an idle tenant
costs no memory.

All limits of one request (requests/min and tokens/min) go through one call and
are all-or-nothing: a request refused on tokens is not charged a request. On a
Redis Cluster the keys of one call must share a hash tag, e.g. `{tenant}:rpm`.

Tokens are charged at admission as `prompt + max_tokens`; `adjust()` corrects the
charge with the real count at the end (a negative delta is a refund, which never
leaves a key with more than a full burst).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

# KEYS[i]: the limiter key of limit i.
# ARGV[1]: "check" (all-or-nothing admission) or "force" (apply every cost, never refuse; for adjust).
# ARGV[2]: now in milliseconds, or "" to read the Redis server's clock.
# ARGV[3i], ARGV[3i+1], ARGV[3i+2]: rate (units per minute), burst (units), cost (units).
# Returns {all_allowed, then per limit: allowed, never, retry_after_ms, remaining, reset_after_ms}.
#
# Arithmetic is exact: time is counted in ticks of 1/rate ms, in which one unit's emission interval
# is exactly 60000 ticks, and a TAT is stored as "<whole ms>:<ticks past it>". Every quantity stays
# an integer below 2^53, which Lua's doubles hold exactly, so rounding can never admit one unit
# too many or refuse a request that exactly fits (a float TAT drifted by a unit within one burst).
_GCRA_LUA = """
local TICKS = 60000
local MAX_DEBT = 4503599627370496
local function floordiv(a, b)
  local q = math.floor(a / b)
  -- a / b was rounded; settle q so that q * b <= a < (q + 1) * b holds exactly.
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end
local function ceildiv(a, b)
  return -floordiv(-a, b)
end
local now
if ARGV[2] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
else
  now = tonumber(ARGV[2])
end
local force = ARGV[1] == 'force'
local n = #KEYS
local limits = {}
local all_ok = 1
for i = 1, n do
  local rate = tonumber(ARGV[3 * i])
  local burst = tonumber(ARGV[3 * i + 1])
  local cost = tonumber(ARGV[3 * i + 2])
  local debt = 0
  local stored = redis.call('GET', KEYS[i])
  if stored then
    local ms, ticks = string.match(stored, '^(%-?%d+):(%d+)$')
    if ms then
      debt = math.max((tonumber(ms) - now) * rate + tonumber(ticks), 0)
    end
  end
  local tau = burst * TICKS
  local new_debt = math.min(math.max(debt + cost * TICKS, 0), MAX_DEBT)
  local ok, never, retry = 1, 0, 0
  if not force then
    if cost > burst then
      ok, never = 0, 1
    elseif new_debt > tau then
      ok, retry = 0, ceildiv(new_debt - tau, rate)
    end
  end
  if ok == 0 then all_ok = 0 end
  limits[i] = {rate, tau, debt, new_debt, ok, never, retry}
end
local out = {all_ok}
for i = 1, n do
  local rate, tau, debt, new_debt, ok, never, retry = unpack(limits[i])
  local final = debt
  if all_ok == 1 then
    final = new_debt
    if final > 0 then
      local ms = floordiv(final, rate)
      local value = string.format('%.0f:%.0f', now + ms, final - ms * rate)
      -- A second of slack: the key may outlive its debt (it then reads as no debt), never the reverse,
      -- even when a caller's simulated clock runs ahead of the Redis clock that expires keys.
      redis.call('SET', KEYS[i], value, 'PX', ceildiv(final, rate) + 1000)
    else
      redis.call('DEL', KEYS[i])
    end
  end
  table.insert(out, ok)
  table.insert(out, never)
  table.insert(out, retry)
  table.insert(out, math.max(floordiv(tau - final, TICKS), 0))
  table.insert(out, ceildiv(final, rate))
end
return out
"""

# KEYS[1]: a sorted set of leases, scored by expiry (milliseconds of the Redis clock).
# ARGV: op ("acquire" | "renew" | "count"), now in ms or "" for the server clock, lease ms, limit, token.
# Returns {ok, count, expires_at_ms}. Expired leases are purged first, so a crashed holder's slot
# comes back once its lease runs out; the set's TTL is kept at least one lease long, so it
# expires once its newest lease has.
_CONCURRENCY_LUA = """
local now
if ARGV[2] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
else
  now = tonumber(ARGV[2])
end
local op = ARGV[1]
local lease_ms = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local count = redis.call('ZCARD', KEYS[1])
if op == 'count' then
  return {1, count, 0}
end
local expires = now + lease_ms
local function extend_ttl()
  if redis.call('PTTL', KEYS[1]) < lease_ms then
    redis.call('PEXPIRE', KEYS[1], lease_ms)
  end
end
if op == 'acquire' then
  if count >= tonumber(ARGV[4]) then
    return {0, count, 0}
  end
  redis.call('ZADD', KEYS[1], expires, ARGV[5])
  extend_ttl()
  return {1, count + 1, expires}
end
if redis.call('ZSCORE', KEYS[1], ARGV[5]) == false then
  return {0, count, 0}
end
redis.call('ZADD', KEYS[1], 'XX', expires, ARGV[5])
extend_ttl()
return {1, count, expires}
"""

Clock = Callable[[], float]
# Rates, bursts and costs up to this keep every tick count in the script below 2^53.
MAX_UNITS = 10**10


@dataclass(frozen=True)
class Decision:
    """One limit's verdict, and what the `x-ratelimit-*` and `Retry-After` headers need.

    `never` means the cost exceeds the burst, so no wait would help (`retry_after_s`
    is then infinite); an ingress should answer that with a 4xx other than 429, so
    clients do not retry forever.
    """

    allowed: bool
    retry_after_s: float
    limit: int
    remaining: int
    reset_after_s: float
    never: bool = False


@dataclass(frozen=True)
class Limit:
    """One limit to check: `cost` units against `rate_per_min`, with `burst` (default: `rate_per_min`)."""

    key: str
    rate_per_min: int
    cost: int = 1
    burst: int | None = None


class RateLimiter:
    """GCRA limits in Redis (algorithm in the module docstring).

    `clock` (seconds) replaces the Redis clock, for simulated time in tests; leave
    it None in production so that every replica uses the one Redis clock.
    """

    def __init__(
        self,
        redis_client: aioredis.Redis,
        clock: Clock | None = None,
        key_prefix: str = "antumbra:ratelimit",
    ) -> None:
        self._redis = redis_client
        self._clock = clock
        self._prefix = key_prefix
        self._script = redis_client.register_script(_GCRA_LUA)

    async def check(self, key: str, rate_per_min: int, cost: int = 1, burst: int | None = None) -> Decision:
        """Charge `cost` units to `key` if its limit has room; otherwise charge nothing."""
        (decision,) = await self.check_all([Limit(key, rate_per_min, cost, burst)])
        return decision

    async def check_all(self, limits: Sequence[Limit]) -> tuple[Decision, ...]:
        """Charge every limit, or none: each `Decision.allowed` says whether its own limit had room,
        and nothing is charged unless all did."""
        for lim in limits:
            if lim.cost < 0:
                raise ValueError(f"cost must be >= 0, got {lim.cost} for {lim.key!r}; use adjust() to refund")
        return await self._run("check", limits)

    async def adjust(
        self, key: str, rate_per_min: int, delta_cost: int, burst: int | None = None
    ) -> Decision:
        """Correct an earlier charge by `delta_cost` units (negative: refund); never refused.

        A refund lowers the debt but not below zero, so it cannot bank more than a full burst.
        """
        (decision,) = await self._run("force", [Limit(key, rate_per_min, delta_cost, burst)])
        return decision

    async def refund(self, key: str, rate_per_min: int, cost: int, burst: int | None = None) -> Decision:
        """Give back `cost` units charged earlier (e.g. max_tokens that were not generated)."""
        return await self.adjust(key, rate_per_min, -cost, burst)

    async def _run(self, mode: str, limits: Sequence[Limit]) -> tuple[Decision, ...]:
        if not limits:
            return ()
        args: list[str | int] = [mode, "" if self._clock is None else str(round(self._clock() * 1000))]
        for lim in limits:
            args += [lim.rate_per_min, _burst(lim), lim.cost]
        keys = [f"{self._prefix}:{lim.key}" for lim in limits]
        raw = [int(v) for v in await self._script(keys=keys, args=args)]
        decisions = []
        for i, lim in enumerate(limits):
            ok, never, retry_ms, remaining, reset_ms = raw[1 + 5 * i : 6 + 5 * i]
            decisions.append(
                Decision(
                    allowed=bool(ok),
                    retry_after_s=math.inf if never else retry_ms / 1000,
                    limit=lim.rate_per_min,
                    remaining=min(remaining, _burst(lim)),
                    reset_after_s=reset_ms / 1000,
                    never=bool(never),
                )
            )
        return tuple(decisions)


def _burst(lim: Limit) -> int:
    """The limit's burst, after checking that its numbers keep the script's arithmetic exact."""
    burst = lim.rate_per_min if lim.burst is None else lim.burst
    for name, value, low in (("rate_per_min", lim.rate_per_min, 1), ("burst", burst, 1)):
        if not low <= value <= MAX_UNITS:
            raise ValueError(f"{name} must be in [{low}, {MAX_UNITS}], got {value} for {lim.key!r}")
    if abs(lim.cost) > MAX_UNITS:
        raise ValueError(f"|cost| must be <= {MAX_UNITS}, got {lim.cost} for {lim.key!r}")
    return burst


def retry_after_header(decisions: Sequence[Decision]) -> int:
    """The `Retry-After` value in whole seconds (at least 1) for a refused request."""
    waits = [d.retry_after_s for d in decisions if not d.allowed and not d.never]
    return max(1, math.ceil(max(waits, default=1.0)))


# --- concurrency -----------------------------------------------------------------


class ConcurrencyLimitExceeded(Exception):
    def __init__(self, key: str, limit: int) -> None:
        super().__init__(f"{key!r} already has {limit} requests in flight")
        self.key = key
        self.limit = limit


@dataclass(frozen=True)
class Lease:
    """One held slot; it lapses at `expires_at_s` (Redis clock) unless renewed."""

    key: str
    token: str
    expires_at_s: float


class ConcurrencyLimiter:
    """At most `limit` requests in flight per key, across every ingress replica.

    Each slot is a lease: a member of a Redis sorted set scored by its expiry.
    Acquiring purges expired leases and then adds one if fewer than `limit`
    remain; releasing removes it. A replica that dies without releasing loses its
    slots when their leases lapse (`lease_s`), so long requests renew theirs;
    `hold()` does so in the background.
    """

    def __init__(
        self,
        redis_client: aioredis.Redis,
        lease_s: float = 60.0,
        clock: Clock | None = None,
        key_prefix: str = "antumbra:concurrency",
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self._redis = redis_client
        self._lease_ms = max(1, round(lease_s * 1000))
        self._clock = clock
        self._prefix = key_prefix
        self._script = redis_client.register_script(_CONCURRENCY_LUA)

    @property
    def lease_s(self) -> float:
        return self._lease_ms / 1000

    async def acquire(self, key: str, limit: int) -> Lease | None:
        """A lease on one of `limit` slots, or None if all are held."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        token = secrets.token_hex(8)
        ok, _, expires_ms = await self._call("acquire", key, limit, token)
        return Lease(key, token, expires_ms / 1000) if ok else None

    async def renew(self, lease: Lease) -> Lease | None:
        """Extend a lease by `lease_s` from now; None if it had already lapsed or been released."""
        ok, _, expires_ms = await self._call("renew", lease.key, 0, lease.token)
        return Lease(lease.key, lease.token, expires_ms / 1000) if ok else None

    async def release(self, lease: Lease) -> bool:
        """Give the slot back; False if it had already lapsed or been released."""
        return bool(await self._redis.zrem(self._key(lease.key), lease.token))

    async def in_use(self, key: str) -> int:
        """How many unexpired leases the key has."""
        _, count, _ = await self._call("count", key, 0, "")
        return count

    @contextlib.asynccontextmanager
    async def hold(self, key: str, limit: int) -> AsyncIterator[Lease]:
        """Hold a slot for the body, renewing it every `lease_s / 3`; raises `ConcurrencyLimitExceeded`."""
        lease = await self.acquire(key, limit)
        if lease is None:
            raise ConcurrencyLimitExceeded(key, limit)
        stop = asyncio.Event()
        renewer = asyncio.create_task(self._keep_renewed(lease, stop))
        try:
            yield lease
        finally:
            # Stop the renewer between commands rather than cancelling it: a Redis command
            # cancelled mid-flight can leave its pooled connection unusable.
            stop.set()
            await renewer
            await self.release(lease)

    async def _keep_renewed(self, lease: Lease, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.lease_s / 3)
            if stop.is_set():
                return
            # A transient Redis error must not end the request; the next round tries again.
            with contextlib.suppress(Exception):
                if await self.renew(lease) is None:
                    return

    async def _call(self, op: str, key: str, limit: int, token: str) -> tuple[int, int, int]:
        now = "" if self._clock is None else str(round(self._clock() * 1000))
        raw = await self._script(keys=[self._key(key)], args=[op, now, self._lease_ms, limit, token])
        ok, count, expires = (int(v) for v in raw)
        return ok, count, expires

    def _key(self, key: str) -> str:
        return f"{self._prefix}:{key}"
