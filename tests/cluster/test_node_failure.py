"""A Ray cluster of three nodes on this machine (a head and two workers, each its own raylet with
its own resources, as Ray's multi-node tests run them), the platform deployed across it, and a
worker node killed under the steady load of two tenants.

Placement: the ingress takes the head's `antumbra_head` resource (it runs on the head; so do the
Serve controller and the one HTTP proxy); the model's 3 replicas each take one `antumbra_worker`,
of which each worker node offers 2, and Serve spreads them: 2 on one worker, 1 on the other.

The node with two replicas is killed (`Cluster.remove_node(allow_graceful=False)`: its raylet, its
object store and every worker process on it, replica actors included) while each of its replicas
runs requests. Asserted, with the bounds the README states ("Multi-node clusters"):
  * no request fails: non-streaming ones it was running start over on the surviving node
    (`x-antumbra-retries`), streams it was serving end with an SSE error event within
    `STREAM_ERROR_BOUND_S`;
  * every directory entry of its replicas is gone within `DIRECTORY_BOUND_S` of the kill;
  * the router never picks a dead replica once Serve knows it is dead: every request that starts
    after the entries are gone runs without a retry;
  * Serve replaces one replica on the surviving node (the one free `antumbra_worker`), the third
    waits for room; a node that joins again gets it, and serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from antumbra.platform.launch.redis_server import LocalRedis, free_port
from antumbra.platform.launch.serve_cli import local_platform
from tests.faults.app import MODEL, FaultApp
from tests.faults.load import Outcome, SteadyLoad, request, sentence, summary
from tests.waiting import wait_until

REPLICAS = 3
WORKER_UNITS = 2  # replicas a worker node can hold
MAX_ONGOING = 8
# Node death: the GCS declares a node dead after `health_check_failure_threshold` missed checks
# `health_check_period_ms` apart (Ray's defaults: 5 x 3 s); Serve's controller checks replicas
# every `health_check_period_s` (ours: 10 s). The test shortens both so it runs in minutes.
SYSTEM_CONFIG = {
    "health_check_period_ms": 1000,
    "health_check_failure_threshold": 3,
    "health_check_timeout_ms": 1000,
}
REPLICA_HEALTH_PERIOD_S = 1.0
STREAM_ERROR_BOUND_S = 5.0
DIRECTORY_BOUND_S = 20.0  # detection (~3 s) + Serve's replica set update + a busy 2-core machine
LONG_TOKENS = 3000
LONG_PLAIN_TOKENS = 300
PLAIN_AFTER_S = 1.0


@dataclass
class Multinode:
    cluster: Any  # ray.cluster_utils.Cluster
    app: FaultApp
    workers: list[Any]  # the worker nodes (ray._private.node.Node)

    def replica_nodes(self) -> dict[str, str]:
        """Replica id -> node id of every live replica (the admin API's pids, Ray's actor table)."""
        import ray

        pids = {
            a["Pid"]: a["Address"]["NodeID"]
            for a in ray._private.state.actors().values()
            if a["State"] == "ALIVE"
        }
        return {s["replica_id"]: pids[s["pid"]] for s in self.app.replicas() if s["pid"] in pids}

    def ingress_node(self) -> str:
        import ray

        return next(
            a["Address"]["NodeID"]
            for a in ray._private.state.actors().values()
            if a["State"] == "ALIVE" and a["ActorClassName"].endswith(":Ingress")
        )

    def add_worker(self) -> Any:
        node = self.cluster.add_node(num_cpus=1, resources={"antumbra_worker": WORKER_UNITS})
        self.workers.append(node)
        return node


@pytest.fixture(scope="module")
def multinode(tiny_checkpoint: Path) -> Iterator[Multinode]:
    import ray
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized()
    redis_server = LocalRedis()
    redis_server.start()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "resources": {"antumbra_head": 100},
            "include_dashboard": False,
            "_system_config": SYSTEM_CONFIG,
        },
    )
    workers = [cluster.add_node(num_cpus=1, resources={"antumbra_worker": WORKER_UNITS}) for _ in range(2)]
    model = {
        "path": str(tiny_checkpoint),
        "replicas": REPLICAS,
        "resources": {"antumbra_worker": 1},
        "max_model_len": 4096,
        "max_ongoing_requests": MAX_ONGOING,
        "max_queued_requests": 32,
        "health_check_period_s": REPLICA_HEALTH_PERIOD_S,
        "health_check_timeout_s": 5.0,
    }
    config = {
        "redis_url": redis_server.url,
        "models": {MODEL: model},
        "stream_idle_timeout_s": 30,
        "ingress_resources": {"antumbra_head": 1},
    }
    try:
        ray.init(address=cluster.address)
        with local_platform(
            config, port=free_port(), create_default_tenant=False, proxy_location="HeadOnly"
        ) as running:
            keys = {t: _tenant(running, t) for t in ("alpha", "beta")}
            yield Multinode(cluster, FaultApp(running, redis_server, keys), workers)
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        cluster.shutdown()
        redis_server.stop()


def _tenant(running: Any, tenant: str) -> str:
    import httpx

    r = httpx.post(
        f"{running.base_url}/admin/tenants",
        json={"id": tenant},
        headers={"Authorization": f"Bearer {running.admin_key}"},
        timeout=30,
    )
    assert r.status_code == 201, r.text
    return str(r.json()["api_key"])


# Words of `sentence` that make more than one 128-token page in V4's tokenizer (about 1.1 tokens a word).
PAGE_WORDS = 130

def entries(app: FaultApp, replica_id: str) -> int:
    """The replica's directory entries: its own entry set's members plus block keys listing it."""
    client = redis.Redis.from_url(app.redis.url)
    try:
        own = int(client.scard(f"{app.key_prefix}:rblk:{MODEL}:{replica_id}"))
        listed = sum(
            any(m.decode().startswith(f"{replica_id}|") for m in client.smembers(k))
            for k in client.scan_iter(f"{app.key_prefix}:blk:{MODEL}:*", count=1000)
        )
        return own + listed
    finally:
        client.close()


def test_a_worker_node_dies_under_load_and_comes_back(multinode: Multinode) -> None:
    app = multinode.app
    wait_until(lambda: app.running_replicas() == {"RUNNING": REPLICAS}, 180, "3 replicas", poll_s=1.0)
    wait_until(lambda: len(multinode.replica_nodes()) == REPLICAS, 60, "replicas answering", poll_s=0.5)
    placed = multinode.replica_nodes()
    worker_ids = {w.node_id for w in multinode.workers}
    assert set(placed.values()) == worker_ids, "replicas on both workers, none on the head"
    assert multinode.ingress_node() == multinode.cluster.head_node.node_id
    victim = next(w for w in multinode.workers if list(placed.values()).count(w.node_id) == WORKER_UNITS)
    doomed = {r for r, n in placed.items() if n == victim.node_id}

    asyncio.run(_prime(app))
    assert all(entries(app, r) > 0 for r in doomed), "the dead node's replicas had published blocks"
    result = asyncio.run(_kill_under_load(multinode, victim, doomed))
    killed_at, forgotten_at = result["killed_at"], result["forgotten_at"]
    outcomes: list[Outcome] = result["outcomes"]

    assert forgotten_at - killed_at <= DIRECTORY_BOUND_S
    plain = [o for o in outcomes if not o.stream]
    assert plain and not [o for o in plain if o.failed], summary(plain)
    restarted = [o for o in plain if o.retries >= 1]
    assert restarted and all(o.started < forgotten_at for o in restarted)
    # A stream that failed had started before the death was known and ended with an error event
    # within the bound (of the kill, or of its start when it was sent to the dead node after it).
    failed_streams = [o for o in outcomes if o.stream and o.failed]
    assert failed_streams, "the dead node was serving streams"
    assert all(o.error_event and o.started < forgotten_at for o in failed_streams), summary(failed_streams)
    late = [o for o in failed_streams if o.ended - max(killed_at, o.started) > STREAM_ERROR_BOUND_S]
    assert not late, summary(late)
    after = [o for o in outcomes if o.started > forgotten_at]
    assert after and all(o.ok and o.retries == 0 for o in after if not o.disconnected), summary(after)

    # One replacement on the survivor (its one free unit); the third waits for a node.
    survivor = next(w for w in multinode.workers if w is not victim)
    wait_until(
        lambda: (
            len(multinode.replica_nodes()) == REPLICAS - 1
            and set(multinode.replica_nodes().values()) == {survivor.node_id}
        ),
        120,
        "a replacement on the surviving node",
        poll_s=1.0,
    )
    assert not doomed & set(multinode.replica_nodes())
    newcomer = multinode.add_worker()
    wait_until(
        lambda: newcomer.node_id in multinode.replica_nodes().values(),
        180,
        "a replica on the node that joined",
        poll_s=1.0,
    )
    wait_until(lambda: app.running_replicas() == {"RUNNING": REPLICAS}, 120, "3 replicas again", poll_s=1.0)
    joined = next(r for r, n in multinode.replica_nodes().items() if n == newcomer.node_id)
    asyncio.run(_until_served(app, joined))
    print(
        f"\nnode kill: {len(plain)} plain requests, 0 failed, {len(restarted)} started over; "
        f"{len(failed_streams)} streams ended with an error event; directory entries of "
        f"{sorted(doomed)} gone {forgotten_at - killed_at:.1f} s after the kill"
    )


async def _prime(app: FaultApp) -> None:
    """Two-page prompts from both tenants at once, so every replica caches (and publishes) some."""
    rng = random.Random(3)
    clients = {t: app.client(t) for t in ("alpha", "beta")}
    try:
        # Two waves of 6: within one replica's slots, as the ingress's capacity gate may still count
        # one running replica for a moment after Serve reports all three.
        outs = []
        for wave in range(2):
            outs += await asyncio.gather(
                *(
                    request(clients[t], t, f"prime {wave} {i}: " + sentence(rng, PAGE_WORDS * 2), 2,
                            stream=False)
                    for i, t in enumerate(["alpha", "beta"] * 3)
                )
            )
    finally:
        for c in clients.values():
            await c.close()
    assert all(o.ok for o in outs), summary(outs)


async def _kill_under_load(multinode: Multinode, victim: Any, doomed: set[str]) -> dict[str, Any]:
    app = multinode.app
    rng = random.Random(7)
    stop, cut = asyncio.Event(), asyncio.Event()
    # 1 steady worker, 2 long streams and 4 long plain requests: the surviving replica's 8 slots hold
    # all of them, so the capacity gate refuses nothing while one replica serves alone. The steady
    # worker streams, so the only plain requests are the long ones: one of them that runs on the
    # doomed node at the kill is still far from its end, and must start over. Four of them, so that
    # the router places one on the doomed node but rarely (about 1 in 80) none.
    streams: set[str] = set()  # ids of every stream once its first token is in (the rest are plain)
    load = SteadyLoad(
        app, workers=1, max_tokens=16, stream_every=1, seed=2, on_token=lambda o: streams.add(str(o.id))
    )
    steady = asyncio.create_task(load.run(stop))
    clients = {t: app.client(t) for t in ("alpha", "beta")}
    long_jobs = [
        asyncio.create_task(
            request(
                clients[t],
                t,
                f"long {i} {t}: " + sentence(rng, 30),
                LONG_TOKENS if i < 2 else LONG_PLAIN_TOKENS,
                stream=i < 2,
                cut=cut,
                on_token=lambda o: streams.add(str(o.id)),
            )
        )
        for i, t in enumerate(["alpha", "beta"] * 3)
    ]
    try:

        first_seen: dict[str, float] = {}

        def busy() -> bool:  # each doomed replica runs a request; a stream and a plain one among them
            states = {s["replica_id"]: s for s in app.replicas()}
            if not all(states.get(r, {}).get("request_ids") for r in doomed):
                return False
            running = {i for r in doomed for i in states[r]["request_ids"]}
            now = time.monotonic()
            for i in running:
                first_seen.setdefault(i, now)
            # A stream still in its prefill has no token yet: an id counts as plain once it has run
            # for PLAIN_AFTER_S without streaming one.
            plain = {i for i in running - streams if now - first_seen[i] >= PLAIN_AFTER_S}
            return bool(running & streams) and bool(plain)

        await asyncio.to_thread(wait_until, busy, 60, "requests on the doomed node", 0.2)
        killed_at = time.monotonic()
        await asyncio.to_thread(multinode.cluster.remove_node, victim, False)
        multinode.workers.remove(victim)
        await asyncio.to_thread(
            wait_until,
            lambda: all(entries(app, r) == 0 for r in doomed),
            DIRECTORY_BOUND_S + 10,
            "the dead replicas' directory entries gone",
            0.2,
        )
        forgotten_at = time.monotonic()
        await asyncio.sleep(4.0)  # load after the death is known
    finally:
        stop.set()
        cut.set()
        longs = await asyncio.gather(*long_jobs)
        outcomes = await steady
        for c in clients.values():
            await c.close()
    return {"killed_at": killed_at, "forgotten_at": forgotten_at, "outcomes": outcomes + longs}


async def _until_served(app: FaultApp, replica_id: str) -> None:
    """Requests until the replica that joined has cached (and published) one: it serves."""
    rng = random.Random(11)
    client = app.client("alpha")
    try:
        for i in range(20):
            outs = await asyncio.gather(
                *(
                    request(client, "alpha", f"rejoin {i} {j}: " + sentence(rng, PAGE_WORDS), 2, stream=False)
                    for j in range(4)
                )
            )
            assert all(o.ok for o in outs), summary(outs)
            if await asyncio.to_thread(entries, app, replica_id):
                return
        raise AssertionError(f"{replica_id} on the node that joined never served a request")
    finally:
        await client.close()
