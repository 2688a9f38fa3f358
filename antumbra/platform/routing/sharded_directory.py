"""The prefix directory over several Redis servers, sharded by replica.

Every key of one replica (its liveness hash, its entry set, and its membership in the block
keys) lives on the shard `shard_of(replica_id)`, so each of its event batches is still one
atomic, ordered Lua call on one server, exactly as on a single Redis. A block held by replicas
of several shards has a block key on each of them. A lookup asks every shard at once, each for
its own candidates, and merges the answers (a replica's match is only ever on its own shard).

Why by replica and not by block hash (Redis Cluster's slots): a batch of one replica touches
blocks of every slot, so it would be split across servers and lose its atomicity and the
seq-ordering that keeps the directory true; and a lookup walks a chain of blocks in order,
which on slots is a round trip per shard per step. Sharded by replica, writes spread evenly
(each server takes 1/S of the replicas' event traffic) and a lookup stays one parallel round
trip per chunk, with each server walking 1/S of the candidates.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from antumbra.cachestore.block_hash import EventBatch
from antumbra.platform.routing.directory import ApplyResult, DirectoryStats, PrefixDirectory, shard_index


class ShardedDirectory:
    """`PrefixDirectory`'s interface over shards (one `PrefixDirectory` per Redis server)."""

    def __init__(self, shards: Sequence[PrefixDirectory]) -> None:
        if not shards:
            raise ValueError("at least one shard")
        self.shards = list(shards)
        self.model = self.shards[0].model

    def shard_of(self, replica_id: str) -> PrefixDirectory:
        """The shard holding every key of the replica (a stable hash of its id)."""
        return self.shards[shard_index(replica_id, len(self.shards))]

    async def ping(self) -> bool:
        """One round trip to every shard (opens their connections); True if all answered."""
        return all(await asyncio.gather(*(s.ping() for s in self.shards)))

    async def apply(self, batch: EventBatch) -> ApplyResult:
        return await self.shard_of(batch.replica_id).apply(batch)

    async def apply_many(self, batches: list[EventBatch]) -> list[ApplyResult]:
        groups: dict[int, list[int]] = {}
        for i, batch in enumerate(batches):
            groups.setdefault(self.shards.index(self.shard_of(batch.replica_id)), []).append(i)
        answers = await asyncio.gather(
            *(self.shards[s].apply_many([batches[i] for i in idx]) for s, idx in groups.items())
        )
        results: list[ApplyResult | None] = [None] * len(batches)
        for idx, answer in zip(groups.values(), answers, strict=True):
            for i, result in zip(idx, answer, strict=True):
                results[i] = result
        return [r for r in results if r is not None]

    async def heartbeat(self, replica_id: str) -> None:
        await self.shard_of(replica_id).heartbeat(replica_id)

    async def forget_replica(self, replica_id: str) -> int:
        return await self.shard_of(replica_id).forget_replica(replica_id)

    async def last_seq(self, replica_id: str) -> int | None:
        return await self.shard_of(replica_id).last_seq(replica_id)

    async def lookup(self, hashes: list[int], live_replicas: set[str]) -> dict[str, int] | None:
        """Every shard's lookup for its own live replicas, merged; None if any shard cannot answer
        (then the router routes by load, as with one Redis)."""
        parts: dict[int, set[str]] = {}
        for replica_id in live_replicas:
            parts.setdefault(self.shards.index(self.shard_of(replica_id)), set()).add(replica_id)
        answers = await asyncio.gather(*(self.shards[s].lookup(hashes, live) for s, live in parts.items()))
        merged: dict[str, int] = {}
        for answer in answers:
            if answer is None:
                return None
            merged.update(answer)
        return merged

    def stats(self) -> DirectoryStats:
        each = [s.stats() for s in self.shards]
        states = {s.breaker_state for s in each}
        return DirectoryStats(
            lookups=max(s.lookups for s in each),
            fallbacks=max(s.fallbacks for s in each),
            errors=sum(s.errors for s in each),
            timeouts=sum(s.timeouts for s in each),
            breaker_state="closed" if states == {"closed"} else next(s for s in states if s != "closed"),
            breaker_opens=sum(s.breaker_opens for s in each),
            reaped_replicas=sum(s.reaped_replicas for s in each),
        )
