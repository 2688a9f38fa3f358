"""The cache-affinity router against a real Redis directory: driven directly, then inside Ray Serve."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from redis.asyncio import Redis

from antumbra.cachestore.block_hash import BlockStored, EventBatch, block_hashes
from antumbra.platform.launch.redis_server import LocalRedis
from antumbra.platform.metrics import PlatformMetrics, default_metrics, observe_request
from antumbra.platform.routing.directory import PrefixDirectory, replica_directory_url, shard_index
from antumbra.platform.routing.router import CacheAffinityRouter
from tests.waiting import wait_until

MODEL = "tiny"
PAGE = 128


@pytest.fixture(scope="module")
def redis_server() -> Iterator[LocalRedis]:
    with LocalRedis() as server:
        yield server


def _tokens(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 + 5 for i in range(n)]


def _request(token_ids: list[int], namespace: str = f"{MODEL}:t1") -> SimpleNamespace:
    """A stand-in for the model deployment's `GenerateRequest` (the attributes the router reads)."""
    return SimpleNamespace(
        token_ids=token_ids,
        block_hashes=block_hashes(token_ids, PAGE, namespace),
        namespace=namespace,
        prompt="",
    )


async def _publish(url: str, replica_id: str, hashes: list[int], seq: int = 0) -> None:
    redis = Redis.from_url(url)
    try:
        directory = PrefixDirectory(redis, MODEL, write_timeout_s=2.0)
        await directory.apply(EventBatch(replica_id, seq, (BlockStored(tuple(hashes)),)))
    finally:
        await redis.aclose()


# --------------------------------------------------------------------------- driven directly


@dataclass
class FakeReplica:
    """The `RunningReplica` attributes `choose_replicas` reads."""

    replica_id: Any
    routing_stats: dict[str, Any] = field(default_factory=dict)
    max_ongoing_requests: int = 8

    async def get_queue_len(self, *, deadline_s: float) -> int:  # Serve probes a new replica set
        return 0


def _router(redis_url: str | None, clock: Any = time.monotonic, **kwargs: Any) -> CacheAffinityRouter:
    """Construct the router the way Ray Serve's handle does, then `initialize_state`."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    router = CacheAffinityRouter(
        deployment_id=DeploymentID(name="model", app_name="test"),
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    router.initialize_state(
        redis_url=redis_url, model=MODEL, page_size=PAGE, seed=0, clock=clock, lookup_timeout_s=0.25, **kwargs
    )
    return router


def _replicas(*names: str) -> list[FakeReplica]:
    from ray.serve._private.common import DeploymentID, ReplicaID

    dep = DeploymentID(name="model", app_name="test")
    return [FakeReplica(ReplicaID(unique_id=name, deployment_id=dep)) for name in names]


def _pending(request: Any) -> Any:
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    rid = uuid.uuid4().hex
    return PendingRequest(
        args=[request], kwargs={}, metadata=RequestMetadata(request_id=rid, internal_request_id=rid)
    )


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_affinity_load_fallback_and_recovery_with_redis_outage(redis_server: LocalRedis) -> None:
    async def main() -> None:
        clock = FakeClock()
        router = _router(redis_server.url, clock=clock, cooldown_s=5.0)
        replicas = _replicas("r-a", "r-b", "r-c")
        prompt = _tokens(5 * PAGE + 17, seed=1)
        request = _request(prompt)
        await _publish(redis_server.url, "r-b", request.block_hashes[:4])

        for _ in range(10):
            tiers = await router.choose_replicas(replicas, _pending(request))
            assert tiers[0][0].replica_id.unique_id == "r-b"
        assert router.last_decision is not None and router.last_decision.best_match_blocks == 4
        assert router.decision_counts["affinity"] == 10

        # Another tenant's namespace never matches the first tenant's entries.
        other = _request(prompt, namespace=f"{MODEL}:t2")
        await router.choose_replicas(replicas, _pending(other))
        assert router.last_decision.reason == "load"

        # Redis dies: every request is still routed, by load alone.
        redis_server.kill()
        for _ in range(10):
            tiers = await router.choose_replicas(replicas, _pending(request))
            assert tiers and tiers[0]
        assert router.last_decision.reason == "no_directory"
        assert router.directory is not None and router.directory.breaker.state == "open"

        # Redis comes back (empty); the replica republishes; after the cooldown affinity returns.
        redis_server.start()
        await _publish(redis_server.url, "r-b", request.block_hashes[:4])
        clock.now += 5.0
        for _ in range(5):
            tiers = await router.choose_replicas(replicas, _pending(request))
        assert tiers[0][0].replica_id.unique_id == "r-b"
        assert router.last_decision.reason == "affinity"
        assert router.directory.breaker.state == "closed"

    asyncio.run(main())


def test_in_flight_counts_raise_load_and_the_hot_spot_gate_spills(redis_server: LocalRedis) -> None:
    async def main() -> None:
        router = _router(redis_server.url, hot_spot_gate=0.5)
        replicas = _replicas("h-a", "h-b")
        request = _request(_tokens(16 * PAGE, seed=2))  # uncached cost on h-b (2048) > load cost on h-a
        await _publish(redis_server.url, "h-a", request.block_hashes)

        routed = []
        for _ in range(5):  # up to four in flight on h-a: load 4/8 = 0.5, not above the gate
            pending = _pending(request)
            tiers = await router.choose_replicas(replicas, pending)
            assert tiers[0][0].replica_id.unique_id == "h-a"
            router.on_request_routed(pending, tiers[0][0].replica_id, None)
            routed.append(pending)
        assert router.in_flight("h-a") == 5
        tiers = await router.choose_replicas(replicas, _pending(request))
        assert tiers[0][0].replica_id.unique_id == "h-b"
        assert router.last_decision.reason == "hot_spot"

        for pending in routed:
            router.on_request_completed(replicas[0].replica_id, pending.metadata.internal_request_id)
        assert router.in_flight("h-a") == 0
        tiers = await router.choose_replicas(replicas, _pending(request))
        assert tiers[0][0].replica_id.unique_id == "h-a"

        # Routing stats count too (they lag, but they are what other routers sent).
        replicas[0].routing_stats = {"queue_len": 8, "kv_use": 0.9}
        tiers = await router.choose_replicas(replicas, _pending(request))
        assert tiers[0][0].replica_id.unique_id == "h-b"

    asyncio.run(main())


def test_a_burst_on_a_new_prefix_follows_the_first_route_until_it_expires(redis_server: LocalRedis) -> None:
    async def main() -> None:
        clock = FakeClock()
        router = _router(redis_server.url, clock=clock, recent_ttl_s=10.0)
        replicas = _replicas("b-a", "b-b", "b-c", "b-d")
        request = _request(_tokens(6 * PAGE, seed=4))  # in no directory entry yet
        first = _pending(request)
        tiers = await router.choose_replicas(replicas, first)
        assert router.last_decision.reason == "load"
        chosen = tiers[0][0].replica_id
        router.on_request_routed(first, chosen, None)
        for _ in range(5):
            tiers = await router.choose_replicas(replicas, _pending(request))
            assert tiers[0][0].replica_id == chosen and router.last_decision.reason == "affinity"
        # A longer prompt on the same prefix matches as far as the shared blocks go.
        longer = _request(request.token_ids + _tokens(2 * PAGE, seed=5))
        await router.choose_replicas(replicas, _pending(longer))
        assert router.last_decision.best_match_blocks == 6
        clock.now += 11.0
        await router.choose_replicas(replicas, _pending(request))
        assert router.last_decision.reason == "load"

    asyncio.run(main())


def test_without_directory_or_hashes_routes_by_load() -> None:
    async def main() -> None:
        router = _router(None)
        replicas = _replicas("n-a", "n-b", "n-c")
        tiers = await router.choose_replicas(replicas, _pending(_request(_tokens(300, seed=3))))
        assert len(tiers) == 1 and len(tiers[0]) == 2
        assert router.last_decision.reason == "no_directory"
        assert await router.choose_replicas([], _pending(_request([1, 2]))) == []
        tiers = await router.choose_replicas(replicas, _pending("not a generate request"))
        assert tiers and tiers[0]

    asyncio.run(main())


def test_metrics_count_routes_and_are_noops_without_ray() -> None:
    import ray

    assert not ray.is_initialized()
    metrics = PlatformMetrics()
    metrics.record_route("affinity", model=MODEL)
    metrics.record_route("affinity", model=MODEL)
    metrics.record_request(
        "t1", MODEL, 200, prompt_tokens=10, cached_tokens=4, completion_tokens=3, ttft_s=0.1
    )
    metrics.record_request("t1", MODEL, 429)
    metrics.set_in_flight("t1", MODEL, 2)
    assert metrics.count("routing_decisions", MODEL, "affinity") == 2
    assert metrics.count("cached_tokens", "t1", MODEL) == 4
    assert metrics.count("rate_limited", "t1", MODEL) == 1
    assert metrics.count("request_errors", "t1", MODEL, "429") == 1
    record = SimpleNamespace(
        tenant_id="t2",
        model=MODEL,
        status=200,
        prompt_tokens=5,
        cached_tokens=0,
        completion_tokens=3,
        ttft_s=0.2,
        duration_s=0.4,
    )
    before = default_metrics().count("requests", "t2", MODEL, "200")  # a process-wide registry
    observe_request(record)
    assert default_metrics().count("requests", "t2", MODEL, "200") == before + 1
    assert not ray.is_initialized()


# --------------------------------------------------------------------------- inside Ray Serve


@pytest.fixture  # one test uses it; Ray is down again before the next (which may need it down)
def serve_app(redis_server: LocalRedis) -> Iterator[Any]:
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    @serve.deployment(
        num_replicas=2,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=8,
        request_router_config=RequestRouterConfig(
            request_router_class=CacheAffinityRouter,
            request_router_kwargs={
                "redis_url": redis_server.url,
                "model": MODEL,
                "page_size": PAGE,
                "lookup_timeout_s": 1.0,  # a loaded CI machine can take longer than a healthy Redis should
                "cooldown_s": 0.5,
                "recent_ttl_s": 2.0,
            },
            request_routing_stats_period_s=1,
        ),
    )
    class Echo:
        def __init__(self) -> None:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
            self.ongoing = 0

        async def generate(self, request: Any) -> str:
            self.ongoing += 1
            try:
                await asyncio.sleep(0.005)
                return self.replica_id
            finally:
                self.ongoing -= 1

        def record_routing_stats(self) -> dict[str, Any]:
            return {
                "queue_len": self.ongoing,
                "running_tokens": 0,
                "kv_use": 0.0,
                "replica_id": self.replica_id,
            }

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        handle = serve.run(Echo.bind(), name="router-test", route_prefix=None)
        yield handle
    finally:
        serve.shutdown()
        ray.shutdown()


def _replica_ids(handle: Any) -> list[str]:
    seen: set[str] = set()
    for i in range(200):
        seen.add(handle.generate.remote(_request(_tokens(10, seed=1000 + i))).result(timeout_s=30))
        if len(seen) == 2:
            return sorted(seen)
    raise AssertionError(f"only saw replicas {seen}")


def test_serve_app_follows_the_directory_and_survives_redis_outage(
    serve_app: Any, redis_server: LocalRedis
) -> None:
    handle = serve_app
    first, second = _replica_ids(handle)
    prompts = [_request(_tokens(3 * PAGE + 5, seed=50 + i)) for i in range(10)]
    for i, request in enumerate(prompts):
        asyncio.run(_publish(redis_server.url, first if i % 2 == 0 else second, request.block_hashes, seq=i))

    def landed() -> list[bool]:
        hits = []
        for i, request in enumerate(prompts * 4):
            want = first if (i % len(prompts)) % 2 == 0 else second
            hits.append(handle.generate.remote(request).result(timeout_s=30) == want)
        return hits

    # The replicas' routing stats and the router's first lookups settle within a few rounds.
    rounds: list[list[bool]] = []

    def affinity_holds() -> bool:
        rounds.append(landed())
        return sum(rounds[-1]) >= 0.95 * len(rounds[-1])

    wait_until(affinity_holds, 20, "requests to follow the directory", poll_s=0.2)
    assert sum(rounds[-1]) >= 0.95 * len(rounds[-1]), Counter(rounds[-1])

    # Redis stopped mid-test: every request still succeeds (load-only routing).
    redis_server.kill()
    results = [handle.generate.remote(request).result(timeout_s=30) for request in prompts * 2]
    assert set(results) <= {first, second} and len(results) == 2 * len(prompts)

    # Redis back (empty): the replicas' entries are republished and affinity returns.
    redis_server.start()
    for i, request in enumerate(prompts):
        asyncio.run(_publish(redis_server.url, first if i % 2 == 0 else second, request.block_hashes, seq=i))
    observed: list[list[bool]] = []

    def affinity_back() -> bool:
        observed.append(landed())
        return sum(observed[-1]) >= 0.95 * len(observed[-1])

    wait_until(affinity_back, 20, "affinity to return after Redis came back", poll_s=0.5)
    assert sum(observed[-1]) >= 0.95 * len(observed[-1]), Counter(observed[-1])


def test_a_replica_leaving_serves_set_loses_its_directory_entries(redis_server: LocalRedis) -> None:
    """Serve's new replica set without a replica (its node died, or it is stopping): the router
    removes that replica's directory entries at once, and no lookup offers it again."""

    async def main() -> None:
        router = _router(redis_server.url)
        replicas = _replicas("gone-a", "stay-b")
        request = _request(_tokens(3 * PAGE, seed=9))
        for replica in replicas:
            await _publish(redis_server.url, replica.replica_id.unique_id, request.block_hashes)
        router.update_replicas(replicas)
        await router.choose_replicas(replicas, _pending(request))  # opens the directory
        assert router.last_decision is not None and router.last_decision.best_match_blocks == 3
        router.update_replicas(replicas[1:])
        while router._tasks:
            await asyncio.gather(*list(router._tasks))
        redis = Redis.from_url(redis_server.url)
        try:
            directory = PrefixDirectory(redis, MODEL, op_timeout_s=2.0)
            assert await directory.lookup(request.block_hashes, {"gone-a", "stay-b"}) == {"stay-b": 3}
            assert await directory.last_seq("gone-a") is None and await directory.last_seq("stay-b") == 0
        finally:
            await redis.aclose()

    asyncio.run(main())


def test_a_sharded_directory_routes_to_the_holder_on_its_shard(redis_server: LocalRedis) -> None:
    with LocalRedis() as second, LocalRedis() as third:
        urls = [redis_server.url, second.url, third.url]

        async def main() -> None:
            router = _router(None, directory_redis_urls=urls)
            names = [f"r-{i}" for i in range(6)]
            holder = next(n for n in names if shard_index(n, 3) != 0)  # not on the first shard
            prompt = _tokens(4 * PAGE + 5, seed=9)
            request = _request(prompt)
            await _publish(replica_directory_url(holder, urls), holder, request.block_hashes[:3])
            for _ in range(5):
                tiers = await router.choose_replicas(_replicas(*names), _pending(request))
                assert tiers[0][0].replica_id.unique_id == holder
            assert router.last_decision is not None and router.last_decision.reason == "affinity"
            assert router.last_decision.best_match_blocks == 3

        asyncio.run(main())
