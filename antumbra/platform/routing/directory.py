"""The cluster-wide prefix directory: which replicas hold which KV blocks, kept in Redis.

Layout (one directory per served model; `P` is the key prefix, `M` the model):

  key                          type    content                                  TTL
  ---------------------------  ------  ---------------------------------------  ----------------------
  P:blk:M:<hash hex>           set     members "<replica_id>|<tier>"            `ttl_s`, refreshed on
                                                                                every store
  P:rblk:M:<replica_id>        set     members "<hash hex>|<tier>": every       `ttl_s`, refreshed on
                                       entry the replica owns                   store and heartbeat
  P:replica:M:<replica_id>     hash    `seq`: last applied batch; liveness      `replica_ttl_s`,
                                                                                refreshed on apply and
                                                                                heartbeat

Writes (`apply`, `forget_replica`) run as one Lua script each, so a batch is applied
atomically, in order and at most once: a batch whose `seq` is not above the replica's last
applied `seq` is ignored. `AllCleared` walks the replica's own set instead of scanning keys.

Reads (`lookup`) walk the request's block hashes in rounds of `batch_size` hashes (doubling
each round up to `max_batch_size`). A round is one Lua call that reads the blocks in order
with the replicas still matching as candidates, and stops at the first block none of them
holds, so a lookup is one round trip for a miss at block 0 and a handful for a long cached
prompt, and reads no block past the first miss. (A server-side walk instead of a pipeline
of `SMEMBERS`: the pipeline's replies are parsed in Python, which measured 5x slower for a
390-block prompt.) With more than `max_candidates` live replicas, the first round walks for the
replicas holding the first block instead of for every live one, so a lookup's cost follows the
replicas that hold the prefix, not the replicas there are (the live list of a 1000-replica
deployment is not sent and indexed on every lookup). Entries of replicas outside
`live_replicas` are ignored at once; a background task then deletes all entries of such a
replica if its liveness key has lapsed (a replica the caller has not seen yet keeps its entries).

Every lookup round trip must finish within `op_timeout_s`; errors and timeouts feed a
`CircuitBreaker`, and whenever a lookup cannot be answered it returns None, which tells the
router to route by load alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError, RedisError

from antumbra.cachestore.block_hash import AllCleared, BlockStored, EventBatch, hash_hex
from antumbra.platform.routing.circuit_breaker import BreakerState, CircuitBreaker
from antumbra.platform.routing.directory_scripts import APPLY_LUA, FORGET_LUA, WALK_LUA

log = logging.getLogger(__name__)


def shard_index(replica_id: str, num_shards: int) -> int:
    """The shard of a sharded directory (`sharded_directory.py`) that holds every key of the
    replica: a stable hash of its id, the same in every process."""
    return zlib.crc32(replica_id.encode()) % num_shards


def replica_directory_url(replica_id: str, redis_urls: Sequence[str]) -> str:
    """The Redis (of a sharded directory's `redis_urls`, in their configured order) that the
    replica publishes to."""
    if not redis_urls:
        raise ValueError("at least one directory Redis URL")
    return redis_urls[shard_index(replica_id, len(redis_urls))]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _apply_result(batch: EventBatch, applied: Any, prev: Any) -> ApplyResult:
    previous = None if int(prev) < 0 else int(prev)
    return ApplyResult(applied=bool(int(applied)), previous_seq=previous, seq=batch.seq)


class DirectoryUnavailable(RuntimeError):
    """A directory write failed or timed out; the caller keeps its events and retries later."""


@dataclass(frozen=True)
class ApplyResult:
    """What `apply` did: `applied` is False for a stale or duplicate batch.

    `previous_seq` is the replica's last applied seq before this batch (None if the
    directory knew none). `gap` means batches were lost (or the directory lost its state):
    the publisher should send a snapshot (`AllCleared` followed by everything it holds).
    Sequence numbers start at 0.
    """

    applied: bool
    previous_seq: int | None
    seq: int

    @property
    def gap(self) -> bool:
        if not self.applied:
            return False
        expected = 0 if self.previous_seq is None else self.previous_seq + 1
        return self.seq != expected


@dataclass(frozen=True)
class DirectoryStats:
    """Counters for metrics: lookups asked, lookups answered by the load-only fallback, and why."""

    lookups: int
    fallbacks: int
    errors: int
    timeouts: int
    breaker_state: BreakerState
    breaker_opens: int
    reaped_replicas: int


class PrefixDirectory:
    """Client of the prefix directory of one model; see the module docstring for the layout.

    `redis` is a `redis.asyncio.Redis` (either `decode_responses` setting works). Give it a
    short socket timeout and few retries: the breaker bounds each lookup round trip by
    `op_timeout_s` anyway, and writes by `write_timeout_s`.
    """

    def __init__(
        self,
        redis: Redis,
        model: str,
        *,
        prefix: str = "antumbra",
        clock: Callable[[], float] = time.monotonic,
        ttl_s: float = 1800.0,
        replica_ttl_s: float = 30.0,
        op_timeout_s: float = 0.005,
        write_timeout_s: float = 1.0,
        batch_size: int = 16,
        max_batch_size: int = 256,
        max_candidates: int = 64,
        failure_threshold: int = 3,
        cooldown_s: float = 5.0,
        reap_interval_s: float = 5.0,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        if batch_size < 1 or max_batch_size < batch_size:
            raise ValueError("need 1 <= batch_size <= max_batch_size")
        self._redis = redis
        self.model = model
        self._block_prefix = f"{prefix}:blk:{model}:"
        self._replica_prefix = f"{prefix}:replica:{model}:"
        self._replica_blocks_prefix = f"{prefix}:rblk:{model}:"
        self._clock = clock
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._replica_ttl_ms = max(1, int(replica_ttl_s * 1000))
        self._op_timeout_s = op_timeout_s
        self._write_timeout_s = write_timeout_s
        self._batch_size = batch_size
        self._max_batch_size = max_batch_size
        self._max_candidates = max_candidates
        self._reap_interval_s = reap_interval_s
        self.breaker = breaker or CircuitBreaker(
            failure_threshold=failure_threshold, cooldown_s=cooldown_s, clock=clock
        )
        self._apply_script = redis.register_script(APPLY_LUA)
        self._forget_script = redis.register_script(FORGET_LUA)
        self._walk_script = redis.register_script(WALK_LUA)
        self._reap_checked: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._lookups = 0
        self._fallbacks = 0
        self._errors = 0
        self._timeouts = 0
        self._reaped = 0

    # ------------------------------------------------------------------ keys

    def block_key(self, block_hash: int) -> str:
        return self._block_prefix + hash_hex(block_hash)

    def replica_key(self, replica_id: str) -> str:
        return self._replica_prefix + replica_id

    def replica_blocks_key(self, replica_id: str) -> str:
        return self._replica_blocks_prefix + replica_id

    # ------------------------------------------------------------------ writes

    async def _write(self, coro: Any) -> Any:
        try:
            async with asyncio.timeout(self._write_timeout_s):
                return await coro
        except (RedisError, OSError, TimeoutError) as exc:
            raise DirectoryUnavailable(f"prefix directory write failed: {exc!r}") from exc

    async def apply(self, batch: EventBatch) -> ApplyResult:
        """Apply one replica's event batch atomically, unless its seq is not above the last applied."""
        keys, args = self._apply_call(batch)
        applied, prev = await self._write(self._apply_script(keys=keys, args=args))
        return _apply_result(batch, applied, prev)

    async def apply_many(self, batches: list[EventBatch]) -> list[ApplyResult]:
        """`apply` for several batches (of any replicas) in one round trip; each is still atomic.

        For a process that publishes for many replicas at once (the directory-at-scale benchmark's
        simulated replicas), where a round trip per batch would cost more than the batches.
        """
        calls = [self._apply_call(batch) for batch in batches]

        async def run() -> list[Any]:
            sha = self._apply_script.sha
            for attempt in range(2):
                pipe = self._redis.pipeline(transaction=False)
                for keys, args in calls:
                    pipe.evalsha(sha, len(keys), *keys, *args)
                try:
                    return list(await pipe.execute())
                except NoScriptError:  # a fresh server (restarted, or never asked): load it once
                    if attempt:
                        raise
                    await self._redis.script_load(APPLY_LUA)
            raise AssertionError("unreachable")

        replies = await self._write(run())
        return [_apply_result(b, applied, prev) for b, (applied, prev) in zip(batches, replies, strict=True)]

    def _apply_call(self, batch: EventBatch) -> tuple[list[str], list[str | int]]:
        if "|" in batch.replica_id:
            raise ValueError(f"replica id may not contain '|': {batch.replica_id!r}")
        args: list[str | int] = [
            self._block_prefix,
            batch.replica_id,
            str(batch.seq),
            self._ttl_ms,
            self._replica_ttl_ms,
        ]
        for event in batch.events:
            if isinstance(event, AllCleared):
                args.append("c")
                continue
            args += ["s" if isinstance(event, BlockStored) else "r", event.tier, len(event.hashes)]
            args += [hash_hex(h) for h in event.hashes]
        return [self.replica_key(batch.replica_id), self.replica_blocks_key(batch.replica_id)], args

    async def heartbeat(self, replica_id: str) -> None:
        """Mark the replica alive for `replica_ttl_s` more seconds (and keep its entry set)."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(self.replica_key(replica_id), "alive", 1)
        pipe.pexpire(self.replica_key(replica_id), self._replica_ttl_ms)
        pipe.pexpire(self.replica_blocks_key(replica_id), self._ttl_ms)
        await self._write(pipe.execute())

    async def forget_replica(self, replica_id: str) -> int:
        """Remove every entry of the replica and its liveness; returns how many entries it had."""
        keys = [self.replica_key(replica_id), self.replica_blocks_key(replica_id)]
        removed = await self._write(self._forget_script(keys=keys, args=[self._block_prefix, replica_id]))
        self._reap_checked.pop(replica_id, None)
        return int(removed)

    # ------------------------------------------------------------------ reads

    async def last_seq(self, replica_id: str) -> int | None:
        """The last applied seq of the replica, or None if unknown (never seen or lapsed)."""
        value = await self._write(self._redis.hget(self.replica_key(replica_id), "seq"))
        return None if value is None else int(value)

    async def is_alive(self, replica_id: str) -> bool:
        return bool(await self._write(self._redis.exists(self.replica_key(replica_id))))

    async def lookup(self, hashes: list[int], live_replicas: set[str]) -> dict[str, int] | None:
        """Leading blocks of `hashes` each live replica holds (either tier); None means "route by load".

        Replicas with no leading block are absent from the result.
        """
        self._lookups += 1
        if not hashes or not live_replicas:
            return {}
        if not self.breaker.allow():
            self._fallbacks += 1
            return None
        try:
            matched, dead = await self._lookup(hashes, live_replicas)
        except TimeoutError:
            self._timeouts += 1
        except (RedisError, OSError) as exc:
            self._errors += 1
            log.debug("prefix directory lookup failed: %r", exc)
        except BaseException:
            self.breaker.abandon()
            raise
        else:
            self.breaker.record_success()
            if dead:
                self._schedule_reap(dead)
            return matched
        self.breaker.record_failure()
        self._fallbacks += 1
        return None

    async def _lookup(self, hashes: list[int], live: set[str]) -> tuple[dict[str, int], set[str]]:
        matched: dict[str, int] = {}
        dead: set[str] = set()
        # Few live replicas: walk for them only. Many: the first round walks for the holders of the
        # first block instead (no candidate list to send and index), later rounds for the live ones
        # still matching.
        by_holders = len(live) > self._max_candidates
        candidates: list[str] = [] if by_holders else sorted(live)
        index = 0
        size = self._batch_size
        while index < len(hashes):
            chunk = hashes[index : index + size]
            first = index == 0
            args = [self._block_prefix, len(candidates), "1" if first else "0", *candidates]
            args += [hash_hex(h) for h in chunk]
            async with asyncio.timeout(self._op_timeout_s):
                counts, seen_dead, walked = await self._walk_script(args=args)
            walked = [_text(r) for r in walked]
            if first:
                dead.update(_text(r) for r in seen_dead)
                dead.update(r for r in walked if r not in live)
            still: list[str] = []
            for replica_id, count in zip(walked, counts, strict=True):
                if replica_id not in live:
                    continue
                if int(count) == len(chunk):
                    still.append(replica_id)
                elif index + int(count):
                    matched[replica_id] = index + int(count)
            candidates = still
            index += len(chunk)
            if not candidates:
                break
            size = min(2 * size, self._max_batch_size)
        for replica_id in candidates:
            matched[replica_id] = index
        return matched, dead

    # ------------------------------------------------------------------ lazy deletion

    def _schedule_reap(self, replica_ids: Iterable[str]) -> None:
        now = self._clock()
        due = [r for r in replica_ids if now - self._reap_checked.get(r, -1e18) >= self._reap_interval_s]
        if not due:
            return
        for replica_id in due:
            self._reap_checked[replica_id] = now
        task = asyncio.get_running_loop().create_task(self._reap(due))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reap(self, replica_ids: list[str]) -> None:
        for replica_id in replica_ids:
            try:
                if not await self.is_alive(replica_id):
                    await self.forget_replica(replica_id)
                    self._reaped += 1
            except DirectoryUnavailable as exc:
                log.debug("could not reap replica %s: %r", replica_id, exc)

    async def drain(self) -> None:
        """Wait for background deletions started by lookups (tests and shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # ------------------------------------------------------------------ health

    async def ping(self) -> bool:
        """One round trip outside the breaker (e.g. to open the connection before serving)."""
        try:
            async with asyncio.timeout(self._write_timeout_s):
                return bool(await self._redis.ping())
        except (RedisError, OSError, TimeoutError):
            return False

    def stats(self) -> DirectoryStats:
        return DirectoryStats(
            lookups=self._lookups,
            fallbacks=self._fallbacks,
            errors=self._errors,
            timeouts=self._timeouts,
            breaker_state=self.breaker.state,
            breaker_opens=self.breaker.opens,
            reaped_replicas=self._reaped,
        )
