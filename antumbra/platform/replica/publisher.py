"""Publish a replica's cache events into the prefix directory, from a background thread.

`attach(engine, replica_id, model, redis_url)` subscribes to the engine's cache events
(`BlockStored` / `BlockRemoved` / `AllCleared`, delivered on the engine's thread under its
lock) and starts a `Publisher` thread that owns its own asyncio loop and Redis client, so
no Redis call ever runs on the engine's thread or on the replica's event loop.

Algorithm:

  * The subscriber callback only appends the event to a pending list (re-tagged with the
    replica's tier: "host" when HiSparse keeps the compressed rows in host memory, else
    "device"; stored and removed events carry the same tier, so removals match stores), and
    wakes the thread when `max_batch_events` are pending.
  * The thread flushes every `flush_interval_s` (or at once when woken by size): up to
    `max_batch_events` pending events become one `EventBatch(replica_id, seq, events)`
    (runs of same-kind events merged), applied atomically by the directory; more pending
    events go out in the next batches without waiting. `seq` starts at 0 and every attempt
    uses a fresh one, so a write that timed out but did land can never make a later,
    different batch look like a duplicate.
  * The first batch, and the first one after any failure, is a *snapshot*: `AllCleared`
    followed by `BlockStored` of every block hash in the engine's tree, read under the
    engine's lock together with dropping the pending events it supersedes (so no event is
    lost or applied twice between the snapshot and the events after it).
  * A failed write (Redis down or slow: `DirectoryUnavailable`) keeps the pending events,
    marks a snapshot as due and retries after `retry_interval_s`; the events kept meanwhile
    are superseded by that snapshot once Redis answers (at most `max_pending_events` are
    kept; the snapshot makes the oldest ones redundant anyway).
  * A gap (the directory's last seq for this replica is not the one before ours: it lost
    its state, e.g. Redis restarted empty) also makes the next batch a snapshot; so does a
    batch refused as stale (the directory holds a higher seq, e.g. from an earlier
    publisher with this replica id), after jumping past that seq.
  * Every `heartbeat_interval_s` without a batch it reads the replica's last applied seq:
    if it is ours, it heartbeats (keeping the replica's liveness key and entry set alive);
    if not (Redis restarted empty while the replica was idle), it resyncs at once. Every
    `resync_interval_s` it re-publishes a snapshot, which refreshes the TTL of every block
    key it holds (block keys expire `ttl_s` after their last store).
  * `close()` stops the thread, and by default removes the replica's entries.

Clock and the Redis client factory are injectable; `flush_once()` runs one step of the loop
for tests that drive it without the thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from redis.asyncio import Redis

from antumbra.cachestore.block_hash import AllCleared, BlockEvent, BlockRemoved, BlockStored, EventBatch, Tier
from antumbra.platform.redis_client import redis_client
from antumbra.platform.routing.directory import DirectoryUnavailable, PrefixDirectory, replica_directory_url

log = logging.getLogger(__name__)


def engine_tier(engine: Any) -> Tier:
    """The tier to publish: "host" when the engine keeps compressed rows in host RAM (HiSparse),
    else "device"."""
    pools = getattr(engine, "pools", None)
    return "host" if getattr(pools, "hot", None) is not None else "device"


def engine_block_hashes(engine: Any) -> list[int]:
    """Every block hash in the engine's prefix tree, parents before children.

    Called with the engine's lock held (see `Publisher._snapshot`); the engine's lock is re-entrant.
    """
    return list(engine.cached_block_hashes())


def _retag(event: BlockEvent, tier: Tier) -> BlockEvent:
    if isinstance(event, BlockStored) and event.tier != tier:
        return BlockStored(event.hashes, tier)
    if isinstance(event, BlockRemoved) and event.tier != tier:
        return BlockRemoved(event.hashes, tier)
    return event


def _compact(events: Iterable[BlockEvent]) -> tuple[BlockEvent, ...]:
    """Merge runs of same-kind, same-tier block events into one event each (order kept)."""
    runs: list[tuple[type, str, list[int]]] = []  # (kind, tier, hashes); AllCleared has no hashes
    for event in events:
        if isinstance(event, AllCleared):
            runs.append((AllCleared, "", []))
            continue
        kind = type(event)
        if runs and runs[-1][0] is kind and runs[-1][1] == event.tier:
            runs[-1][2].extend(event.hashes)
        else:
            runs.append((kind, event.tier, list(event.hashes)))
    return tuple(
        AllCleared() if kind is AllCleared else kind(tuple(hashes), tier) for kind, tier, hashes in runs
    )


class Publisher:
    """Keeps one replica's entries in the prefix directory true; see the module docstring."""

    def __init__(
        self,
        engine: Any,
        replica_id: str,
        model: str,
        redis_factory: Callable[[], Redis],
        *,
        key_prefix: str = "antumbra",
        directory_options: dict[str, Any] | None = None,
        tier: Tier | None = None,
        # Each flush holds the interpreter lock the engine's stepping thread needs (an engine process
        # runs this thread beside it), so not too often. A request's blocks reach the directory only
        # when it finishes anyway; each router's recent routes cover that lag for what it routed.
        flush_interval_s: float = 0.1,
        max_batch_events: int = 512,
        max_pending_events: int = 100_000,
        heartbeat_interval_s: float = 5.0,
        resync_interval_s: float = 600.0,
        retry_interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if "|" in replica_id:
            raise ValueError(f"replica id may not contain '|': {replica_id!r}")
        self.engine = engine
        self.replica_id = replica_id
        self.tier: Tier = tier or engine_tier(engine)
        self.model = model
        self._redis_factory = redis_factory
        self._key_prefix = key_prefix
        self._directory_options = dict(directory_options or {})
        self._redis: Redis | None = None
        self._directory: PrefixDirectory | None = None
        self.flush_interval_s = flush_interval_s
        self.max_batch_events = max_batch_events
        self.max_pending_events = max_pending_events
        self.heartbeat_interval_s = heartbeat_interval_s
        self.resync_interval_s = resync_interval_s
        self.retry_interval_s = retry_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: list[BlockEvent] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._seq = 0
        self._snapshot_due = True
        self._last_write = -float("inf")
        self._last_snapshot = -float("inf")
        self._retry_at = -float("inf")
        self._closed = False
        self._forget_on_close = True
        # Counters, for metrics and tests.
        self.batches = 0
        self.snapshots = 0
        self.failures = 0
        self.gaps = 0
        self.dropped_events = 0

    # ------------------------------------------------------------------ engine side

    def on_event(self, seq: int, event: BlockEvent) -> None:
        """The engine's subscriber callback: queue the event (runs on the engine's thread)."""
        if self._closed:
            return
        with self._lock:
            self._pending.append(_retag(event, self.tier))
            overflow = len(self._pending) - self.max_pending_events
            if overflow > 0:
                # Only reachable while writes fail, and then a snapshot is due that supersedes them.
                del self._pending[:overflow]
                self.dropped_events += overflow
                self._snapshot_due = True
            full = len(self._pending) >= self.max_batch_events
        if full:
            self._wake.set()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    @property
    def healthy(self) -> bool:
        """False while the last write failed (the directory is behind this replica)."""
        return self._retry_at == -float("inf")

    # ------------------------------------------------------------------ one step

    def _snapshot(self) -> tuple[BlockEvent, ...]:
        """AllCleared + every block now cached, and drop the pending events it supersedes."""
        engine_lock = getattr(self.engine, "_lock", None) or contextlib.nullcontext()
        with engine_lock:  # no tree change (hence no event) between the walk and the drop
            hashes = engine_block_hashes(self.engine)
            with self._lock:
                self._pending.clear()
        events: list[BlockEvent] = [AllCleared()]
        if hashes:
            events.append(BlockStored(tuple(hashes), self.tier))
        return tuple(events)

    def _directory_client(self) -> PrefixDirectory:
        """The directory client, created on first use inside the loop that will use it."""
        if self._directory is None:
            self._redis = self._redis_factory()
            self._directory = PrefixDirectory(
                self._redis, self.model, prefix=self._key_prefix, **self._directory_options
            )
        return self._directory

    async def flush_once(self, *, force: bool = False) -> bool:
        """Publish what is due now; True if a batch was applied (or nothing was due).

        Due: a snapshot (first batch, after a failure or gap, every `resync_interval_s`),
        else the pending events, else a heartbeat every `heartbeat_interval_s`.
        """
        now = self._clock()
        if now < self._retry_at and not force:
            return False
        directory = self._directory_client()
        if (
            not self._snapshot_due
            and not self.pending
            and now - self._last_write >= self.heartbeat_interval_s
        ):
            # Idle: heartbeat, unless the directory lost our entries (then resync right away).
            try:
                if await directory.last_seq(self.replica_id) == self._seq - 1:
                    await directory.heartbeat(self.replica_id)
                    self._last_write = now
                    self._retry_at = -float("inf")
                    return True
            except DirectoryUnavailable as exc:
                self._fail(now, exc)
                return False
            self._snapshot_due = True
            self.gaps += 1
        snapshot = self._snapshot_due or now - self._last_snapshot >= self.resync_interval_s
        if snapshot:
            events = self._snapshot()
        else:
            with self._lock:
                taken = min(len(self._pending), self.max_batch_events)
                events = _compact(self._pending[:taken])
        if not events:
            return True
        seq = self._seq
        self._seq += 1
        try:
            result = await directory.apply(EventBatch(self.replica_id, seq, events))
        except DirectoryUnavailable as exc:
            self._fail(now, exc)
            return False
        self._retry_at = -float("inf")
        self._last_write = now
        self.batches += 1
        if snapshot:
            self.snapshots += 1
            self._last_snapshot = now
            self._snapshot_due = False
        else:
            with self._lock:
                del self._pending[:taken]
        if not result.applied and result.previous_seq is not None and result.previous_seq > seq:
            # Another publisher used this replica id with higher seqs: continue above them.
            self._seq = result.previous_seq + 1
            self._snapshot_due = True
            self.gaps += 1
        elif result.gap and not snapshot:
            self._snapshot_due = True
            self.gaps += 1
        return True

    def _fail(self, now: float, exc: Exception) -> None:
        self.failures += 1
        self._snapshot_due = True
        self._retry_at = now + self.retry_interval_s
        log.debug("prefix directory write for %s failed: %r", self.replica_id, exc)

    # ------------------------------------------------------------------ thread

    def start(self) -> Publisher:
        """Start the background thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"cache-publisher-{self.replica_id}", daemon=True
            )
            self._thread.start()
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            while not self._stop.is_set():
                try:
                    applied = loop.run_until_complete(self.flush_once())
                except Exception:  # keep publishing whatever one step hit
                    log.exception("cache publisher step failed")
                    self._snapshot_due = True
                    applied = False
                if applied and self.pending >= self.max_batch_events:
                    continue  # a backlog: send the next batch now
                self._wake.wait(self.flush_interval_s)
                self._wake.clear()
            loop.run_until_complete(self._shutdown())
        finally:
            loop.close()

    async def _shutdown(self) -> None:
        """Forget the replica (or publish what is pending), then close the Redis client."""
        directory = self._directory
        if directory is None:
            return
        with contextlib.suppress(DirectoryUnavailable):
            if self._forget_on_close:
                await directory.forget_replica(self.replica_id)
            else:
                await self.flush_once(force=True)
        if self._redis is not None:
            with contextlib.suppress(Exception):
                await self._redis.aclose()

    def close(self, *, forget: bool = True, timeout_s: float = 5.0) -> None:
        """Stop publishing; `forget` removes the replica's entries from the directory."""
        self._closed = True
        self._forget_on_close = forget
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def __repr__(self) -> str:
        return (
            f"Publisher(replica={self.replica_id!r}, tier={self.tier}, seq={self._seq}, "
            f"batches={self.batches}, snapshots={self.snapshots}, failures={self.failures})"
        )


def attach(
    engine: Any,
    replica_id: str,
    model: str,
    redis_url: str,
    *,
    key_prefix: str = "antumbra",
    directory_options: dict[str, Any] | None = None,
    directory_urls: Sequence[str] = (),
    **publisher_options: Any,
) -> Publisher:
    """Subscribe a started `Publisher` to the engine's cache events; returns it (call `close()`
    at shutdown). With `directory_urls` (a sharded directory) it publishes to the shard that
    holds the replica's keys, else to `redis_url`."""
    url = replica_directory_url(replica_id, directory_urls) if directory_urls else redis_url
    publisher = Publisher(
        engine,
        replica_id,
        model,
        functools.partial(redis_client, url),
        key_prefix=key_prefix,
        directory_options=directory_options,
        **publisher_options,
    )
    engine.subscribe(publisher.on_event)
    return publisher.start()


def on_start_hook(model: str, redis_url: str, **options: Any) -> Callable[[Any, str], Publisher]:
    """An `on_start(engine, replica_id)` hook for the model deployment (picklable)."""
    return functools.partial(attach, model=model, redis_url=redis_url, **options)
