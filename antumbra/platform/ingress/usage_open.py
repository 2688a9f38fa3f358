"""Open usage entries: a running stream's usage so far, kept in Redis while it runs, so that an
ingress that crashes loses at most a bounded tail of it (the layout is `usage.py`'s).

A stream's entry is written before its first token is sent (`RequestUsage.open`); after each chunk
is sent the entry is due to be rewritten with the completion tokens of the chunks sent before it.
The writes of one ingress are batched (`OpenEntries`): one pipelined round trip carries every entry
that changed.
The rule:

  * an entry that changed is written at most `WRITE_INTERVAL_S` (plus that write's round trip)
    after the change, and the writer starts a new round at most once per `WRITE_INTERVAL_S` unless
    a stream hurries it or waits on it;
  * a stream never runs more than `MAX_UNWRITTEN_TOKENS` completion tokens ahead of its written
    entry: before it sends a chunk that would put it further ahead, it waits for a write of what it
    has put in the entry;
  * a stream more than half that bound ahead hurries the writer without waiting: the next round is
    then due `HURRY_INTERVAL_S` after the last. So a stream that sends well under half the bound per
    `HURRY_INTERVAL_S` (a token every 4 ms or slower leaves room for the round trip) finds its
    entry written before it reaches the bound and never waits; waiting on a write every few chunks
    put the Redis round trip, and the event loop's turns around it, into the inter-token gaps.

So when the ingress crashes, a stream's recorded completion tokens lag what its client received by
at most `MAX_UNWRITTEN_TOKENS` (mostly by what was sent in the last `WRITE_INTERVAL_S`), or by
its last two chunks where those two together are larger. Never the other way: a stream puts its
chunks in the entry one delta after it handed them to Serve's transport (`Finisher.sent`), and the
write starts after the event loop has run again. A chunk handed over is gone from the ingress
within that time unless the transport stalls for a whole decode step; only such a stall at the
moment the process dies could count a chunk that never arrived.

The cost is bounded too: at most one round trip per `WRITE_INTERVAL_S`, or per `HURRY_INTERVAL_S`
while a stream runs fast, plus one per `MAX_UNWRITTEN_TOKENS` tokens of a stream that outruns it. A
write before each chunk instead was measured and rejected: a lone round trip costs the ingress
several times the client CPU of an entry in a batch, and its count would grow with the token rate
rather than with the number of open streams.

Every `HEARTBEAT_S` every live entry is written again, changed or not; the script stamps it with
Redis's own clock, so a sweeper (`usage_sweep`) tells a dead ingress's entries (stamps older than
`STALE_AFTER_S`) from a quiet stream's. A write sets absolute counts and only ever raises them, and
does nothing once the request's done key exists: a write repeated, reordered, or landing after the
request was closed or folded cannot count anything twice.

Redis away: writes fail and streams stop waiting for them (a stream waits only while writes
succeed); the writer retries with backoff. A stream that ends during the outage is closed through
the meter's queue like any request (`usage_meter`); an ingress that crashes during the outage
loses what its entries had not got written (all of a stream opened during it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from antumbra.platform.ingress.usage import DONE_TTL_S, UsageKeys, UsageRecord

log = logging.getLogger(__name__)

WRITE_INTERVAL_S = 0.1
HURRY_INTERVAL_S = WRITE_INTERVAL_S / 4
MAX_UNWRITTEN_TOKENS = 16
HEARTBEAT_S = 2.0
STALE_AFTER_S = 15.0  # several heartbeats: an entry this old belongs to a dead ingress
FLUSH_WAIT_S = 1.0  # the longest a stream waits on a write before it sends anyway
MIN_BACKOFF_S = 0.05
MAX_BACKOFF_S = 2.0
OPEN_COUNTERS = ("prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens")

# KEYS: done key, open entry, open index. ARGV: request id, model, at_s, entry TTL, then counter
# name / value pairs. Returns 1 when written, 0 when the request was already counted.
_PROGRESS = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
redis.call('HSET', KEYS[2], 'model', ARGV[2], 'at_s', ARGV[3])
for i = 5, #ARGV, 2 do
  local old = tonumber(redis.call('HGET', KEYS[2], ARGV[i]) or '0')
  if tonumber(ARGV[i + 1]) > old then
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  end
end
redis.call('EXPIRE', KEYS[2], ARGV[4])
local now = redis.call('TIME')
redis.call('ZADD', KEYS[3], now[1] * 1000 + math.floor(now[2] / 1000), ARGV[1])
return 1
"""

Key = tuple[str, str]  # (tenant id, request id)


def key_of(rec: UsageRecord) -> Key:
    return rec.tenant_id, rec.request_id


async def write_progress(redis: Any, keys: UsageKeys, records: list[UsageRecord]) -> list[bool]:
    """Write the open entries of `records` (completion tokens sent so far) in one round trip; per
    record, whether it was written (False: the request was counted already)."""
    pipe = redis.pipeline(transaction=False)
    for rec in records:
        args: list[Any] = [rec.request_id, rec.model, repr(rec.finished_at_s), DONE_TTL_S]
        for name in OPEN_COUNTERS:
            args += [name, rec.counters()[name]]
        pipe.eval(_PROGRESS, 3, keys.done(rec.tenant_id, rec.request_id),
                  keys.open_entry(rec.tenant_id, rec.request_id), keys.open_index(rec.tenant_id), *args)
    for tenant in sorted({rec.tenant_id for rec in records}):
        pipe.sadd(keys.tenants, tenant)  # the sweeper looks for open entries per tenant
    results = await pipe.execute()
    return [bool(r) for r in results[: len(records)]]


class OpenEntries:
    """The open entries of one ingress's streams and their one writer task (module docstring)."""

    def __init__(self, redis: Any, keys: UsageKeys, write_interval_s: float = WRITE_INTERVAL_S,
                 heartbeat_s: float = HEARTBEAT_S, hurry_interval_s: float = HURRY_INTERVAL_S) -> None:
        self.redis = redis
        self.keys = keys
        self.write_interval_s = write_interval_s
        self.hurry_interval_s = hurry_interval_s
        self._hurried = False  # a stream nears its bound: the next round is due sooner
        self._closed = False  # the ingress is going: nothing more is written
        self.heartbeat_s = heartbeat_s
        self.writing = True  # the last write succeeded: only then do streams wait on writes
        self.rounds = 0  # pipelined round trips that succeeded
        self._live: dict[Key, UsageRecord] = {}
        self._written: dict[Key, int] = {}  # completion tokens each entry holds in Redis
        self._dirty: set[Key] = set()
        self._waiters: list[asyncio.Future[bool]] = []
        self._wake = asyncio.Event()
        self._writer: asyncio.Task | None = None
        self._last_round = -float("inf")
        self._beat_at = time.monotonic() + heartbeat_s

    @property
    def live(self) -> int:
        return len(self._live)

    def written_tokens(self, rec: UsageRecord) -> int:
        """The completion tokens of `rec`'s request that its entry in Redis holds."""
        return self._written.get(key_of(rec), 0)

    def put(self, rec: UsageRecord) -> None:
        """The request's usage so far, to be written (no awaits)."""
        self._live[key_of(rec)] = rec
        self._dirty.add(key_of(rec))
        self._wake.set()
        if not self._closed and (self._writer is None or self._writer.done()):
            self._writer = asyncio.get_running_loop().create_task(self._write_forever())

    def drop(self, rec: UsageRecord) -> None:
        """The request is over: its entry is no longer written (the close deletes it)."""
        self._live.pop(key_of(rec), None)
        self._written.pop(key_of(rec), None)
        self._dirty.discard(key_of(rec))

    def hurry(self) -> None:
        """A stream nears its bound: make the next round due `hurry_interval_s` after the last one,
        without waiting for it (no awaits)."""
        if self.writing and not self._hurried and self._writer is not None and not self._writer.done():
            self._hurried = True
            self._wake.set()

    async def flush(self, timeout_s: float = FLUSH_WAIT_S) -> bool:
        """Wait for a write of everything put so far: True once written, False at once while writes
        fail, or after `timeout_s`."""
        if not self.writing or self._writer is None or self._writer.done():
            return False
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters.append(done)
        self._wake.set()
        try:
            return await asyncio.wait_for(done, timeout_s)
        except TimeoutError:
            return False

    async def close(self) -> None:
        """Stop writing. Cancelling the writer alone is not enough: a cancellation that meets the
        writer's wake-up in `asyncio.wait_for` can be swallowed (Python before 3.12), and the writer
        would run on; it also stops at its next turn once closed."""
        self._closed = True
        if self._writer is not None:
            self._wake.set()
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer

    async def _write_forever(self) -> None:
        backoff_s = MIN_BACKOFF_S
        while True:
            await self._round_due()
            if self._closed:
                return
            beat = time.monotonic() >= self._beat_at
            due = list(self._live) if beat else [k for k in self._dirty if k in self._live]
            waiters, self._waiters = self._waiters, []
            self._hurried = False  # a stream that hurries during this round hurries the next
            self._dirty.difference_update(due)
            self._last_round = time.monotonic()
            try:
                await self._write([self._live[k] for k in due])
            except Exception as exc:  # Redis away (or anything else): written again next round
                self._dirty.update(k for k in due if k in self._live)
                self._note_failure(exc)
                _resolve(waiters, False)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)
                continue
            backoff_s = MIN_BACKOFF_S
            if beat:
                self._beat_at = time.monotonic() + self.heartbeat_s
            _resolve(waiters, True)

    async def _round_due(self) -> None:
        """Until a round is due: a stream waits on one, an entry changed at least `write_interval_s`
        (`hurry_interval_s` once a stream hurried) after the last round, or the heartbeat is due."""
        while not self._waiters and not self._closed:
            due = []
            if self._dirty:
                interval_s = self.hurry_interval_s if self._hurried else self.write_interval_s
                due.append(self._last_round + interval_s)
            if self._live:
                due.append(self._beat_at)
            wait_s = min(due) - time.monotonic() if due else None
            if wait_s is not None and wait_s <= 0:
                return
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait_s)

    async def _write(self, records: list[UsageRecord]) -> None:
        if not records:
            return
        results = await write_progress(self.redis, self.keys, records)
        for rec, written in zip(records, results, strict=True):
            if written and key_of(rec) in self._live:
                self._written[key_of(rec)] = rec.completion_tokens
            elif not written and self._live.get(key_of(rec)) is rec:
                # Counted already (a sweeper took this ingress for dead): nothing more can count.
                log.warning("usage of %s was folded while its stream ran", rec.request_id)
                self.drop(rec)
        self.rounds += 1
        if not self.writing:
            log.warning("usage entry writes resumed")
        self.writing = True

    def _note_failure(self, exc: BaseException) -> None:
        if self.writing:
            log.warning("usage entry writes failing (%r); %d streams open, retrying", exc, len(self._live))
        self.writing = False


def _resolve(waiters: list[asyncio.Future[bool]], ok: bool) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(ok)


class RequestUsage:
    """How one request's usage is metered: an open entry while it streams (`open`, `before_send`,
    `sent`), one closing record however it ends (`finish`).

    `make_record(acc, completion_tokens)` builds the request's `UsageRecord` from its response
    builder; `close` queues the final one (the meter's queue)."""

    def __init__(self, entries: OpenEntries, close: Callable[[UsageRecord], None],
                 make_record: Callable[[Any, int], UsageRecord],
                 max_unwritten_tokens: int = MAX_UNWRITTEN_TOKENS) -> None:
        self.entries = entries
        self.max_unwritten_tokens = max_unwritten_tokens
        self._close = close
        self._make_record = make_record
        self._last: UsageRecord | None = None  # the latest record put in the open entry

    async def open(self, acc: Any) -> None:
        """Open the entry (a stream, before its first chunk): its prompt counts from now on."""
        self._last = self._make_record(acc, 0)
        self.entries.put(self._last)
        await self.entries.flush()

    async def before_send(self, sent_tokens: int, tokens: int) -> None:
        """Wait, if sending `tokens` more after `sent_tokens` would run too far ahead of the entry."""
        if self._last is None:
            return
        ahead = sent_tokens + tokens - self.entries.written_tokens(self._last)
        if ahead > self.max_unwritten_tokens:
            await self.entries.flush()
        elif 2 * ahead > self.max_unwritten_tokens:
            self.entries.hurry()

    def sent(self, acc: Any, sent_tokens: int) -> None:
        """The client has been sent `sent_tokens` completion tokens (no awaits)."""
        if self._last is not None:
            self._last = self._make_record(acc, sent_tokens)
            self.entries.put(self._last)

    def finish(self, acc: Any, received_tokens: int) -> None:
        """The request is over: its closing record (no awaits: it runs where a cancelled request ends)."""
        rec = self._make_record(acc, received_tokens)
        self._last = None  # nothing is written to the entry after this
        self.entries.drop(rec)
        self._close(rec)
