"""The ingress's usage meter: closing records written in order through a queue that waits out Redis
outages, open entries of running streams (`usage_open`), and the sweeper of entries that dead
ingresses left (`usage_sweep`). The Redis layout and the exactly-once rule are `usage.py`'s.

Redis down at write time: closing records wait in a queue and are written in arrival order once
Redis answers again (retried with backoff up to `MAX_BACKOFF_S`). The queue holds at most
`MAX_PENDING_RECORDS` records (a few MB; at 100 requests/s, close to 17 minutes of outage); past
that, new records are dropped, counted in `dropped` and logged, since an ingress must not grow
without bound while Redis is away. The queue lives in the ingress's memory: a replica that Serve
shuts down writes it first (`close`); one that crashes loses it, except what its streams' open
entries held (`usage_open`), which a sweeper folds.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from antumbra.platform.ingress.usage import UsageKeys, UsageRecord, write_records
from antumbra.platform.ingress.usage_open import OpenEntries, RequestUsage
from antumbra.platform.ingress.usage_sweep import Sweeper

log = logging.getLogger(__name__)

MAX_PENDING_RECORDS = 100_000
BATCH_RECORDS = 64  # records per pipelined round trip
MIN_BACKOFF_S = 0.05
MAX_BACKOFF_S = 2.0


class UsageMeter:
    """Queues closing `UsageRecord`s and writes them in order from one background task; hands out
    each request's `RequestUsage`; runs the sweeper once `start`ed (module docstring)."""

    def __init__(
        self, redis: Any, key_prefix: str = "antumbra", max_pending: int = MAX_PENDING_RECORDS
    ) -> None:
        self.redis = redis
        self.keys = UsageKeys(key_prefix)
        self.max_pending = max_pending
        self.dropped = 0
        self.written = 0
        self.streams = OpenEntries(redis, self.keys)
        self.sweeper = Sweeper(redis, self.keys, owner=uuid.uuid4().hex)
        self._pending: collections.deque[UsageRecord] = collections.deque()
        self._wake = asyncio.Event()
        self._writer: asyncio.Task | None = None
        self._sweeping: asyncio.Task | None = None
        self._failing_since: float | None = None

    @property
    def pending(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        """Sweep now and every `sweeper.every_s`."""
        if self._sweeping is None:
            self._sweeping = asyncio.get_running_loop().create_task(self.sweeper.run())

    def request(self, make_record: Callable[[Any, int], UsageRecord]) -> RequestUsage:
        """The meter of one request; `make_record(acc, completion tokens)` builds its record."""
        return RequestUsage(self.streams, self.record, make_record)

    def record(self, rec: UsageRecord) -> None:
        """Queue one closing record (no awaits: it runs where a cancelled request finishes)."""
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
        """Stop sweeping and writing open entries, write what is queued (for at most `timeout_s`),
        then stop the writer."""
        await _stop(self._sweeping)
        await self.streams.close()
        if not await self.flush(timeout_s):
            log.error("usage of %d requests not written at shutdown (Redis unavailable)", self.pending)
        await _stop(self._writer)

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


async def _stop(task: asyncio.Task | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
