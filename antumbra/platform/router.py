"""The cache-affinity request router: Ray Serve's `RequestRouter` over `CacheAffinityPolicy`.

Ray Serve runs one instance per deployment handle (in the ingress replica), on the
handle's router event loop, and calls `choose_replicas` once per routing attempt. For a
request whose first handle argument carries `block_hashes` and `token_ids` (the model
deployment's `GenerateRequest`), one attempt is:

  1. `live` = the candidates' `replica_id.unique_id`; ask the `PrefixDirectory` how many
     leading blocks of the request each live replica holds (one Lua round trip per chunk of
     hashes, bounded by `lookup_timeout_s`; no blocking call runs on the loop). If the
     directory is not configured, its circuit breaker is open, or the lookup fails or is
     slow, the answer is None: route by load alone.
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

A request without block hashes (another method, or no hashes) is routed by load.
`on_replica_actor_died` drops the replica's in-flight count and removes its directory
entries in the background.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from collections.abc import Callable
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from .directory import DirectoryUnavailable, PrefixDirectory
from .metrics import PlatformMetrics
from .publisher import redis_client
from .routing_policy import CacheAffinityPolicy, ReplicaLoad, RoutingDecision

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
        lookup_timeout_s: float = 0.01,
        failure_threshold: int = 3,
        cooldown_s: float = 5.0,
        seed: int | None = None,
        clock: Callable[[], float] | None = None,
        **_: Any,
    ) -> None:
        """Called by Ray Serve with `request_router_kwargs`; `redis_url=None` routes by load only.

        `model` (or `model_name`, as `app.build_app` passes it) names the directory to read;
        `page_size` must be the model's page size (the tokens one block hash covers).
        `clock` (tests) drives the circuit breaker; unknown kwargs are ignored, so one
        kwargs dict can serve several router versions.
        """
        self.redis_url = redis_url
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
        self.directory: PrefixDirectory | None = None
        self._directory_loop: asyncio.AbstractEventLoop | None = None
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._routed: dict[str, str] = {}  # internal request id -> replica unique id
        self.decision_counts: collections.Counter[str] = collections.Counter()
        self.last_decision: RoutingDecision | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._directory_available: bool | None = None

    # ------------------------------------------------------------------ directory

    async def _get_directory(self) -> PrefixDirectory | None:
        """The directory client, created on the loop that routes (a Redis connection is per loop)."""
        if self.redis_url is None:
            return None
        loop = asyncio.get_running_loop()
        if self.directory is None or self._directory_loop is not loop:
            self.directory = PrefixDirectory(
                redis_client(self.redis_url, timeout_s=0.5),
                self.model,
                prefix=self._key_prefix,
                clock=self._clock,
                op_timeout_s=self._lookup_timeout_s,
                failure_threshold=self._failure_threshold,
                cooldown_s=self._cooldown_s,
            )
            self._directory_loop = loop
            await self.directory.ping()  # open the connection outside the lookup's time budget
        return self.directory

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
            available = directory.breaker.state == "closed"
            if available != self._directory_available:
                self._directory_available = available
                self.metrics.set_directory_available(self.model, available)
        decision = self.policy.rank(num_tokens, matched, self.replica_loads(candidate_replicas))
        self.last_decision = decision
        self.decision_counts[decision.reason] += 1
        self.metrics.record_route(decision.reason, model=self.model)
        return [[by_id[rid] for rid in tier] for tier in decision.tiers]

    # ------------------------------------------------------------------ lifecycle hooks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        rid = replica_id.unique_id
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

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        rid = replica_id.unique_id
        self._in_flight.pop(rid, None)
        for internal_id in [k for k, v in self._routed.items() if v == rid]:
            del self._routed[internal_id]
        directory = self.directory
        if directory is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if loop is not self._directory_loop:
            return
        task = loop.create_task(self._forget(directory, rid))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _forget(directory: PrefixDirectory, replica_unique_id: str) -> None:
        try:
            await directory.forget_replica(replica_unique_id)
        except DirectoryUnavailable as exc:
            log.debug("could not forget dead replica %s: %r", replica_unique_id, exc)
