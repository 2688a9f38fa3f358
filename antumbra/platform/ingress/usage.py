"""Durable usage metering: each request's tokens, per tenant, model and hour, in Redis, exactly once.

A finished request (however it ended) hands one `UsageRecord` to the ingress's `UsageMeter`, which
writes it with one Lua script: `SET <done key> NX` (the request's idempotency key, kept
`DONE_TTL_S`), and only if that was new, `HINCRBY` of the hour's counters and an index entry. A
write retried after a lost reply, or replayed after an ingress restart, finds the done key and adds
nothing, so each request counts once.

Redis layout (one hash tag per tenant, so the script's keys share a cluster slot):
  {<prefix>:usage:<tenant>}:h:<hour epoch>:<model>   hash: requests, prompt_tokens, cached_tokens,
                                                     completion_tokens, reasoning_tokens (no TTL:
                                                     billing data is never evicted by volatile-lru)
  {<prefix>:usage:<tenant>}:hours                    sorted set of "<hour epoch>:<model>" by hour
  {<prefix>:usage:<tenant>}:done:<request id>        the idempotency key (TTL `DONE_TTL_S`)
  <prefix>:usage:tenants                             set of tenants that have usage

Redis down at write time: records wait in a queue and are written in arrival order once Redis
answers again (retried with backoff up to `MAX_BACKOFF_S`). The queue holds at most
`MAX_PENDING_RECORDS` records (a few MB; at 100 requests/s, close to 17 minutes of outage); past
that, new records are dropped, counted in `dropped` and logged, since an ingress must not grow
without bound while Redis is away. The queue lives in the ingress's memory: a replica that Serve
shuts down writes it first (`close`), one that crashes loses it, with the usage of the requests
it was serving (their clients lose their connections too).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

HOUR_S = 3600
DONE_TTL_S = 7 * 24 * HOUR_S  # far beyond any retry or restart that could replay a record
MAX_PENDING_RECORDS = 100_000
BATCH_RECORDS = 64  # records per pipelined round trip
MIN_BACKOFF_S = 0.05
MAX_BACKOFF_S = 2.0
COUNTERS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens")

# KEYS: done key, hour hash, hours index. ARGV: done TTL, index member, hour epoch, then the
# counter name / increment pairs. Returns 1 when counted now, 0 when the request was counted before.
_RECORD = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then
  return 0
end
for i = 4, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1])
end
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[2])
return 1
"""


@dataclass(frozen=True)
class UsageRecord:
    """What one request used: prompt tokens read (of which `cached_tokens` from the prefix cache) and
    completion tokens the client received (of which `reasoning_tokens` were reasoning)."""

    request_id: str
    tenant_id: str
    model: str
    finished_at_s: float  # Unix time: it picks the hour
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0

    @property
    def hour_s(self) -> int:
        return int(self.finished_at_s // HOUR_S) * HOUR_S

    def counters(self) -> dict[str, int]:
        return {"requests": 1, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens, "reasoning_tokens": self.reasoning_tokens}


@dataclass(frozen=True)
class UsageKeys:
    """The Redis key names of the module docstring."""

    prefix: str = "antumbra"

    def tag(self, tenant_id: str) -> str:
        return f"{{{self.prefix}:usage:{tenant_id}}}"

    def hour(self, tenant_id: str, member: str) -> str:
        """The hash of one index member, `"<hour epoch>:<model>"`."""
        return f"{self.tag(tenant_id)}:h:{member}"

    def hours(self, tenant_id: str) -> str:
        return f"{self.tag(tenant_id)}:hours"

    def done(self, tenant_id: str, request_id: str) -> str:
        return f"{self.tag(tenant_id)}:done:{request_id}"

    @property
    def tenants(self) -> str:
        return f"{self.prefix}:usage:tenants"


def index_member(hour_s: int, model: str) -> str:
    return f"{hour_s}:{model}"


def split_member(member: str) -> tuple[int, str]:
    hour, _, model = member.partition(":")
    return int(hour), model


async def write_records(redis: Any, keys: UsageKeys, records: list[UsageRecord]) -> list[bool]:
    """Write `records` in one pipelined round trip; per record, whether it was counted now (False:
    it had been counted before). Safe to repeat: a record counts once whatever happens."""
    pipe = redis.pipeline(transaction=False)
    for rec in records:
        member = index_member(rec.hour_s, rec.model)
        args: list[Any] = [DONE_TTL_S, member, rec.hour_s]
        for name, value in rec.counters().items():
            args += [name, value]
        pipe.eval(_RECORD, 3, keys.done(rec.tenant_id, rec.request_id), keys.hour(rec.tenant_id, member),
                  keys.hours(rec.tenant_id), *args)
    for tenant in sorted({rec.tenant_id for rec in records}):
        pipe.sadd(keys.tenants, tenant)
    results = await pipe.execute()
    return [bool(r) for r in results[: len(records)]]


class UsageMeter:
    """Queues `UsageRecord`s and writes them in order from one background task (module docstring)."""

    def __init__(
        self, redis: Any, key_prefix: str = "antumbra", max_pending: int = MAX_PENDING_RECORDS
    ) -> None:
        self.redis = redis
        self.keys = UsageKeys(key_prefix)
        self.max_pending = max_pending
        self.dropped = 0
        self.written = 0
        self._pending: collections.deque[UsageRecord] = collections.deque()
        self._wake = asyncio.Event()
        self._writer: asyncio.Task | None = None
        self._failing_since: float | None = None

    @property
    def pending(self) -> int:
        return len(self._pending)

    def record(self, rec: UsageRecord) -> None:
        """Queue one record (no awaits: it runs where a cancelled request finishes)."""
        if len(self._pending) >= self.max_pending:
            self.dropped += 1
            log.error("usage queue full (%d records while Redis is away): dropped the usage of %s",
                      self.max_pending, rec.request_id)
            return
        self._pending.append(rec)
        self._wake.set()
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_forever())

    async def flush(self, timeout_s: float) -> bool:
        """Wait until every queued record is written (True) or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < deadline:
            self._wake.set()
            await asyncio.sleep(0.01)
        return not self._pending

    async def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (for at most `timeout_s`), then stop the writer."""
        if not await self.flush(timeout_s):
            log.error("usage of %d requests not written at shutdown (Redis unavailable)", self.pending)
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer

    async def _write_forever(self) -> None:
        backoff_s = MIN_BACKOFF_S
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = list(self._pending)[:BATCH_RECORDS]
            try:
                await write_records(self.redis, self.keys, batch)
            except Exception as exc:  # Redis away (or anything else): the batch waits and goes again
                self._note_failure(exc)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)
                continue
            for _ in batch:  # only now: a failed batch stays first in line, in order
                self._pending.popleft()
            self.written += len(batch)
            backoff_s = MIN_BACKOFF_S
            if self._failing_since is not None:
                log.warning("usage writes resumed after %.1f s", time.monotonic() - self._failing_since)
                self._failing_since = None

    def _note_failure(self, exc: BaseException) -> None:
        if self._failing_since is None:
            self._failing_since = time.monotonic()
            log.warning("usage writes failing (%r); %d records queued, retrying", exc, len(self._pending))
