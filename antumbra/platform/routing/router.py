"""The cache-affinity request router: Ray Serve's `RequestRouter` over `CacheAffinityPolicy`.

Ray Serve runs one instance per deployment handle (in the ingress replica), on the
handle's router event loop, and calls `choose_replicas` once per routing attempt. For a
request whose first handle argument carries `block_hashes` and `token_ids` (the model
deployment's `GenerateRequest`), one attempt is:

  1. `live` = the candidates' `replica_id.unique_id`; ask the `PrefixDirectory` how many
     leading blocks of the request each live replica holds (one Lua round trip per chunk of
     hashes, bounded by `lookup_timeout_s`; no blocking call runs on the loop). If the
     directory is not configured, its circuit breaker is open, or the lookup fails or is
     slow, the answer is None: route by load alone. Otherwise each replica's match is the
     larger of the directory's and this router's *recent routes*: the leading blocks of
     requests it sent to that replica in the last `recent_ttl_s` seconds (counted from the
     first such route, not extended by later ones). Those blocks are being computed there
     but reach the directory only when their request finishes, so without this a burst of
     requests sharing a new prefix would spread over the replicas and each would compute
     it (at most `recent_max_blocks` hashes are remembered, LRU).
  2. Each candidate's load is `ReplicaLoad.from_stats` over its `routing_stats`
     (`queue_len`, `running_tokens`, `kv_use`, refreshed every
     `request_routing_stats_period_s`), with `queue_len` raised to the freshest bound
     this router knows: the queue length Ray Serve last probed from the replica (its
     queue-length cache, updated on every send) and this router's own in-flight requests
     to it (counted from `on_request_routed` to `on_request_completed`).
  3. `CacheAffinityPolicy.rank` scores them (uncached prefill tokens plus weighted load,
     hot-spot gate; see its docstring) into ranked tiers of ids, mapped back to the
     `RunningReplica`s; Ray Serve probes queue lengths within a tier and falls through.
  4. The decision's reason (affinity / hot_spot / load / no_directory) is counted here
     (`decision_counts`) and in the Ray metrics.

A request without block hashes (another method, or no hashes) is routed by load. A
`WeightsUpdate` (or `ReplicaQuery`) goes to a candidate it has not reached yet, while one is left
(the ingress repeats it until every replica has the new weights, or has answered).
`on_replica_actor_died`, and `update_replicas` for a replica that left Serve's set (its node
died, or it is stopping), drop the replica's in-flight count and remove its directory entries
in the background.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from antumbra.platform.messages import ReplicaQuery, WeightsUpdate
from antumbra.platform.metrics import PlatformMetrics
from antumbra.platform.redis_client import redis_client
from antumbra.platform.routing.directory import DirectoryUnavailable, PrefixDirectory
from antumbra.platform.routing.policy import CacheAffinityPolicy, ReplicaLoad, RoutingDecision
from antumbra.platform.routing.sharded_directory import ShardedDirectory

Directory = PrefixDirectory | ShardedDirectory  # one Redis, or shards of it

log = logging.getLogger(__name__)


def request_of(pending_request: PendingRequest | None) -> Any | None:
    """The first handle argument, if it carries block hashes (a `GenerateRequest`)."""
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if hasattr(first, "block_hashes") else None


def prompt_tokens(request: Any, page_size: int) -> int:
    """The prompt's length in tokens: `len(token_ids)`, else what its block hashes cover."""
    token_ids = getattr(request, "token_ids", None)
    if token_ids is not None:
        return len(token_ids)
    return len(getattr(request, "block_hashes", None) or ()) * page_size


class CacheAffinityRouter(RequestRouter):
    """Routes each request to the replica that already holds most of its prefix, load permitting.

    Configure it with `RequestRouterConfig(request_router_class=CacheAffinityRouter,
    request_router_kwargs={...})`; the kwargs are `initialize_state`'s. The algorithm is
    in the module docstring.
    """

    def initialize_state(
        self,
        redis_url: str | None = None,
        model: str | None = None,
        page_size: int = 128,
        *,
        model_name: str | None = None,
        key_prefix: str = "antumbra",
        load_weight: float = 2048.0,
        hot_spot_gate: float = 0.5,
        hot_spot_sigma: float | None = None,
        tier_size: int = 2,
        lookup_timeout_s: float = 0.02,
        recent_ttl_s: float = 10.0,
        recent_max_blocks: int = 200_000,
        failure_threshold: int = 3,
        cooldown_s: float = 1.0,
        seed: int | None = None,
        clock: Callable[[], float] | None = None,
        directory_redis_urls: Sequence[str] = (),
        **_: Any,
    ) -> None:
        """Called by Ray Serve with `request_router_kwargs`; `redis_url=None` routes by load only.

        `model` (or `model_name`, as `app.build_app` passes it) names the directory to read;
        `page_size` must be the model's page size (the tokens one block hash covers).
        `lookup_timeout_s` bounds each directory round trip as this process sees it, event-loop
        delays included (a bound near those delays opens the breaker on a busy small ingress);
        `failure_threshold` consecutive failures open the breaker for `cooldown_s`.
        `clock` (tests) drives the circuit breaker; unknown kwargs are ignored, so one
        kwargs dict can serve several router versions. `directory_redis_urls`: the directory is
        sharded over these Redis servers (`sharded_directory.py`) instead of living in `redis_url`.
        """
        self.redis_url = redis_url
        self.directory_redis_urls = tuple(directory_redis_urls)
        self.model = model or model_name or "default"
        self.page_size = page_size
        self._key_prefix = key_prefix
        self._lookup_timeout_s = lookup_timeout_s
        self._failure_threshold = failure_threshold
        self._cooldown_s = cooldown_s
        self._clock = clock or time.monotonic
        self.policy = CacheAffinityPolicy(
            page_size=page_size,
            rng=random.Random(seed),
            load_weight=load_weight,
            hot_spot_gate=hot_spot_gate,
            hot_spot_sigma=hot_spot_sigma,
            tier_size=tier_size,
        )
        self.metrics = PlatformMetrics()
        self.directory: Directory | None = None
        self._directory_loop: asyncio.AbstractEventLoop | None = None
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._routed: dict[str, str] = {}  # internal request id -> replica unique id
        self.decision_counts: collections.Counter[str] = collections.Counter()
        self.last_decision: RoutingDecision | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._directory_available: bool | None = None
        self._seen_timeouts = 0
        self._seen_errors = 0
        self.recent_ttl_s = recent_ttl_s
        self.recent_max_blocks = recent_max_blocks
        self._recent: collections.OrderedDict[int, dict[str, float]] = collections.OrderedDict()

    # ------------------------------------------------------------------ directory

    async def _get_directory(self) -> Directory | None:
        """The directory client, created on the loop that routes (a Redis connection is per loop)."""
        urls = self.directory_redis_urls or ((self.redis_url,) if self.redis_url is not None else ())
        if not urls:
            return None
        loop = asyncio.get_running_loop()
        if self.directory is None or self._directory_loop is not loop:
            self._seen_timeouts = self._seen_errors = 0
            shards = [self._shard(url) for url in urls]
            self.directory = shards[0] if len(shards) == 1 else ShardedDirectory(shards)
            self._directory_loop = loop
            await self.directory.ping()  # open the connection outside the lookup's time budget
        return self.directory

    def _shard(self, url: str) -> PrefixDirectory:
        return PrefixDirectory(
            redis_client(url, timeout_s=0.5),
            self.model,
            prefix=self._key_prefix,
            clock=self._clock,
            op_timeout_s=self._lookup_timeout_s,
            failure_threshold=self._failure_threshold,
            cooldown_s=self._cooldown_s,
        )

    # ------------------------------------------------------------------ routing

    def replica_loads(self, candidates: list[RunningReplica]) -> list[ReplicaLoad]:
        """Each candidate's load from its routing stats, its probed queue length and our in-flight count."""
        loads = []
        for replica in candidates:
            rid = replica.replica_id.unique_id
            stats = dict(replica.routing_stats or {})
            probed = self._probed_queue_len(replica.replica_id)
            queue_len = max(int(stats.get("queue_len", 0)), probed or 0, self._in_flight.get(rid, 0))
            stats["queue_len"] = queue_len
            loads.append(ReplicaLoad.from_stats(rid, stats, max(1, int(replica.max_ongoing_requests))))
        return loads

    def _probed_queue_len(self, replica_id: ReplicaID) -> int | None:
        cache = getattr(self, "_replica_queue_len_cache", None)
        return cache.get(replica_id) if cache is not None else None

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        first = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if isinstance(first, WeightsUpdate | ReplicaQuery):
            left = [r for r in candidate_replicas if r.replica_id.unique_id not in first.updated]
            return [left or candidate_replicas[:1]]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        request = request_of(pending_request)
        hashes = list(getattr(request, "block_hashes", None) or ()) if request is not None else []
        num_tokens = prompt_tokens(request, self.page_size) if request is not None else 0
        matched: dict[str, int] | None
        directory = await self._get_directory()
        if directory is None:
            matched = None
        else:
            matched = await directory.lookup(hashes, set(by_id))
            if matched is not None and hashes:
                for rid, blocks in self.recent_matches(hashes, set(by_id)).items():
                    matched[rid] = max(matched.get(rid, 0), blocks)
            self._report_directory(directory)
        decision = self.policy.rank(num_tokens, matched, self.replica_loads(candidate_replicas))
        self.last_decision = decision
        self.decision_counts[decision.reason] += 1
        self.metrics.record_route(decision.reason, model=self.model)
        return [[by_id[rid] for rid in tier] for tier in decision.tiers]

    def _report_directory(self, directory: Directory) -> None:
        """Export the directory's new failures and whether it is answering (on change)."""
        stats = directory.stats()
        timeouts, errors = stats.timeouts - self._seen_timeouts, stats.errors - self._seen_errors
        if timeouts or errors:
            self._seen_timeouts, self._seen_errors = stats.timeouts, stats.errors
            self.metrics.record_directory_failures(self.model, timeouts, errors)
        available = stats.breaker_state == "closed"
        if available != self._directory_available:
            self._directory_available = available
            self.metrics.set_directory_available(self.model, available)

    # ------------------------------------------------------------------ recent routes

    def remember_route(self, hashes: list[int], replica_unique_id: str) -> None:
        """Credit the replica with `hashes` for `recent_ttl_s` seconds (it is computing them).

        A credit is not extended by later routes of the same blocks to the same replica: it
        only bridges the time until the directory shows them, and routes it attracted must
        not keep it alive if the directory never does (the replica did not cache them).
        """
        if not hashes or self.recent_ttl_s <= 0:
            return
        now = self._clock()
        expires = now + self.recent_ttl_s
        recent = self._recent
        for h in hashes:
            holders = recent.get(h)
            if holders is None:
                recent[h] = {replica_unique_id: expires}
                continue
            if holders.get(replica_unique_id, 0.0) <= now:
                holders[replica_unique_id] = expires
            recent.move_to_end(h)
        while len(recent) > self.recent_max_blocks:
            recent.popitem(last=False)

    def recent_matches(self, hashes: list[int], live: set[str]) -> dict[str, int]:
        """Leading blocks of `hashes` each live replica was recently sent (replicas with none absent)."""
        now = self._clock()
        alive = set(live)
        counts: dict[str, int] = {}
        for i, h in enumerate(hashes):
            holders = self._recent.get(h)
            if not holders:
                break
            alive = {r for r in alive if holders.get(r, 0.0) > now}
            if not alive:
                break
            for r in alive:
                counts[r] = i + 1
        return counts

    # ------------------------------------------------------------------ lifecycle hooks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        rid = replica_id.unique_id
        request = request_of(pending_request)
        if request is not None:
            self.remember_route(list(getattr(request, "block_hashes", None) or ()), rid)
        internal_id = pending_request.metadata.internal_request_id
        previous = self._routed.pop(internal_id, None)
        if previous is not None:
            self._release(previous)
        self._routed[internal_id] = rid
        self._in_flight[rid] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self._routed.pop(internal_request_id, None)
        if rid is not None:
            self._release(rid)

    def _release(self, rid: str) -> None:
        self._in_flight[rid] -= 1
        if self._in_flight[rid] <= 0:
            del self._in_flight[rid]

    def in_flight(self, replica_unique_id: str) -> int:
        return self._in_flight.get(replica_unique_id, 0)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new replica set: a replica that left it (dead, its node gone, or stopping) is
        dropped here and its directory entries removed at once, so no lookup offers it again and
        the directory does not wait for its lease to lapse."""
        known = {replica_id.unique_id for replica_id in getattr(self, "_replicas", {})}
        super().update_replicas(replicas)
        for rid in known - {r.replica_id.unique_id for r in replicas}:
            self._replica_gone(rid)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._replica_gone(replica_id.unique_id)

    def _replica_gone(self, rid: str) -> None:
        """Forget what this router holds of the replica and remove its directory entries (in the
        background, on the directory's loop)."""
        self._in_flight.pop(rid, None)
        for internal_id in [k for k, v in self._routed.items() if v == rid]:
            del self._routed[internal_id]
        for holders in self._recent.values():
            holders.pop(rid, None)
        directory, loop = self.directory, self._directory_loop
        if directory is None or loop is None or loop.is_closed():
            return
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not loop:  # the directory's connection belongs to its loop
            asyncio.run_coroutine_threadsafe(self._forget(directory, rid), loop)
            return
        task = loop.create_task(self._forget(directory, rid))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _forget(directory: Directory, replica_unique_id: str) -> None:
        try:
            await directory.forget_replica(replica_unique_id)
        except DirectoryUnavailable as exc:
            log.debug("could not forget dead replica %s: %r", replica_unique_id, exc)
