"""The prefix directory and the router at 100, 300 and 1000 replicas, simulated against local Redis.

No model runs: each simulated replica is an LRU cache of blocks whose size (`block_set_blocks`),
event rates and event sizes come from `data/directory_trace.json`, recorded from the real engine
under load (`benchmarks/directory_trace.py`). The directory and routing code are the real ones:
`PrefixDirectory` (its Lua scripts, `apply` batches as the publisher sends them) and
`CacheAffinityPolicy.rank`; a sharded run uses `ShardedDirectory` over three redis-servers.

Per replica count N, two phases against a fresh Redis (or three):

1. Hit ratio (logical time, no pacing): a Zipf workload of shared prefixes (`prefix_blocks` blocks
   each from the trace, plus one block of its own per request) routed once by the affinity router
   (directory lookup + policy) and once by power of two choices (two replicas at random, the
   shorter queue). A routed request's blocks enter its replica's LRU; the replica's stored and
   removed events reach the directory every `flush_every` requests (the publisher's 20 ms flush at
   the trace's request rate). Queues: a request holds its replica for as many arrivals as make
   `queue_per_replica` requests per replica on average. Hit ratio = cached / prompt blocks.
2. Load (wall clock, `duration_s`): N publishers in a separate process replay the trace's event
   stream (each from a random offset, x `rate_scale`), flushing every 20 ms as `Publisher` does,
   while this process routes `router_rate` Zipf requests a second (a directory lookup over all N
   replicas, then `rank`). Reported: decision latency p50 / p99 (lookup + rank), the lookup alone,
   Redis CPU (INFO cpu: seconds of CPU per second, i.e. the share of one core, per server), Redis
   memory (used_memory), event lag (from an event's time in the trace to its batch applied) p50 /
   p99, and the publishers' achieved batches a second.

    python -m benchmarks.directory_scale [--replicas 100 300 1000] [--sharded] [--smoke]

Results go to `benchmarks/results/directory_scale.json` (`--smoke`: `directory_scale-smoke.json`).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import datetime
import heapq
import importlib.metadata
import json
import multiprocessing
import os
import platform
import random
import statistics
import subprocess
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from antumbra.cachestore.block_hash import BlockRemoved, BlockStored, EventBatch
from antumbra.platform.launch.redis_server import LocalRedis
from antumbra.platform.routing.directory import PrefixDirectory
from antumbra.platform.routing.policy import CacheAffinityPolicy, ReplicaLoad
from antumbra.platform.routing.sharded_directory import ShardedDirectory
from benchmarks.directory_trace import TRACE_PATH, Trace

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "sim"
# How often each modelled publisher flushes: more often than `Publisher.flush_interval_s`'s default,
# so more and smaller batches reach the directory (the harder case for it)
FLUSH_S = 0.02
AIM_P99_MS = 2.0
AIM_CORE_SHARE = 0.5


@dataclass(frozen=True)
class Settings:
    replicas: tuple[int, ...] = (100, 300, 1000)
    shards: int = 1
    hit_requests_per_replica: int = 6
    max_hit_requests: int = 3000
    prefixes_per_replica: float = 2.0  # distinct shared prefixes, per replica
    zipf_s: float = 1.1
    queue_per_replica: float = 4.0
    max_ongoing: int = 8
    duration_s: float = 10.0
    router_rate: float = 200.0  # decisions a second, one router (one ingress replica)
    rate_scale: float = 1.0  # the trace's event rates times this
    seed: int = 0


SMOKE = Settings(replicas=(20,), hit_requests_per_replica=10, duration_s=1.5, router_rate=50.0)


# ---------------------------------------------------------------------------------------------- workload


class Workload:
    """Zipf-distributed shared prefixes of `prefix_blocks` blocks, each request with one block of its own."""

    def __init__(self, prefixes: int, prefix_blocks: int, zipf_s: float, rng: random.Random) -> None:
        self.rng = rng
        self.chains = [[rng.getrandbits(63) for _ in range(prefix_blocks)] for _ in range(prefixes)]
        weights = [1.0 / (rank + 1) ** zipf_s for rank in range(prefixes)]
        total = sum(weights)
        self.cumulative = [sum(weights[: i + 1]) / total for i in range(prefixes)]

    def request(self) -> list[int]:
        chain = self.chains[min(bisect.bisect_left(self.cumulative, self.rng.random()), len(self.chains) - 1)]
        return [*chain, self.rng.getrandbits(63)]


class SimReplica:
    """A replica's cache as the directory sees it: an LRU of blocks and the events not yet published."""

    def __init__(self, replica_id: str, capacity: int) -> None:
        self.id = replica_id
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.pending: list[BlockStored | BlockRemoved] = []
        self.seq = 0
        self.in_flight = 0

    def serve(self, hashes: list[int]) -> int:
        """Cache the request's blocks (LRU); returns the leading blocks it already held."""
        hit = 0
        while hit < len(hashes) and hashes[hit] in self.blocks:
            hit += 1
        stored = [h for h in hashes if h not in self.blocks]
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        if stored:
            self.pending.append(BlockStored(tuple(stored), "device"))
        if evicted:
            self.pending.append(BlockRemoved(tuple(evicted), "device"))
        return hit

    def batch(self) -> EventBatch | None:
        if not self.pending:
            return None
        batch = EventBatch(self.id, self.seq, tuple(self.pending))
        self.seq += 1
        self.pending = []
        return batch


# ---------------------------------------------------------------------------------------------- phase 1


def _pick(tiers: list[list[str]], replicas: dict[str, SimReplica], max_ongoing: int) -> SimReplica:
    """What Ray Serve does with ranked tiers: within a tier the shorter queue, a full tier falls through."""
    for tier in tiers:
        ready = [replicas[r] for r in tier if replicas[r].in_flight < max_ongoing]
        if ready:
            return min(ready, key=lambda r: r.in_flight)
    return replicas[tiers[0][0]]


async def hit_ratio(
    directory: Any, trace: Trace, n: int, settings: Settings, affinity: bool
) -> dict[str, Any]:
    rng = random.Random(settings.seed)
    workload = _workload(trace, n, settings, rng)
    replicas = {f"r{i:04d}": SimReplica(f"r{i:04d}", trace.block_set_blocks) for i in range(n)}
    live = set(replicas)
    policy = CacheAffinityPolicy(page_size=trace.page_size, rng=random.Random(settings.seed))
    flush_every = max(1, round(n * trace.request_rate * FLUSH_S))
    hold = max(1, round(settings.queue_per_replica * n))
    finishing: list[tuple[int, str]] = []
    requests = min(settings.max_hit_requests, settings.hit_requests_per_replica * n)
    hit_blocks = total_blocks = 0
    for i in range(requests):
        while finishing and finishing[0][0] <= i:
            replicas[heapq.heappop(finishing)[1]].in_flight -= 1
        hashes = workload.request()
        loads = [
            ReplicaLoad(r.id, r.in_flight, 0, len(r.blocks) / r.capacity, settings.max_ongoing)
            for r in replicas.values()
        ]
        matched = await directory.lookup(hashes, live) if affinity else None
        tiers = policy.rank(len(hashes) * trace.page_size, matched, loads).tiers
        chosen = _pick(tiers, replicas, settings.max_ongoing)
        chosen.in_flight += 1
        heapq.heappush(finishing, (i + hold, chosen.id))
        hit_blocks += chosen.serve(hashes)
        total_blocks += len(hashes)
        if affinity and (i + 1) % flush_every == 0:
            batches = [b for b in (r.batch() for r in replicas.values()) if b is not None]
            if batches:
                await directory.apply_many(batches)
    return {
        "requests": requests,
        "hit_ratio": round(hit_blocks / total_blocks, 4),
        "flush_every": flush_every,
    }


# ---------------------------------------------------------------------------------------------- phase 2


async def redis_cost_per_lookup(
    clients: list[aioredis.Redis], trace: Trace, n: int, settings: Settings, lookups: int = 300
) -> float:
    """Redis time (all shards) inside commands per router lookup: INFO commandstats over a burst of
    lookups and nothing else (INFO cpu would add the servers' idle housekeeping over the burst)."""
    directory = _directory(clients)
    rng = random.Random(settings.seed + 3)
    workload = _workload(trace, n, settings, rng)
    live = {f"r{i:04d}" for i in range(n)}
    for c in clients:
        await c.config_resetstat()
    for _ in range(lookups):
        await directory.lookup(workload.request(), live)
    usec = 0.0
    for c in clients:
        stats = await c.info("commandstats")
        usec += sum(float(v.get("usec", 0)) for k, v in stats.items() if k.startswith("cmdstat_"))
    return round(usec / lookups, 1)


def _publish(urls: list[str], trace_path: str, n: int, settings: Settings, start_at: float, out: Any) -> None:
    """The N replicas' publishers (a separate process): the trace's events, flushed every 20 ms."""
    asyncio.run(_publish_async(urls, Trace.load(Path(trace_path)), n, settings, start_at, out))


async def _publish_async(
    urls: list[str], trace: Trace, n: int, settings: Settings, start_at: float, out: Any
) -> None:
    rng = random.Random(settings.seed + 1)
    clients = [aioredis.Redis.from_url(u) for u in urls]
    directory = _directory(clients)
    span = trace.duration_s / settings.rate_scale
    events = [(t / settings.rate_scale, kind, count) for t, kind, count in trace.events if kind != "cleared"]
    offsets = [rng.uniform(0, span) for _ in range(n)]
    own: list[list[int]] = [[] for _ in range(n)]
    seqs = [10**6] * n  # above the hit-ratio phase's seqs of the same replica ids
    times = [e[0] for e in events]
    cursor = [bisect.bisect_left(times, o) for o in offsets]

    def due(i: int) -> float:  # when replica i's next event happens (seconds from the start)
        k, loop = cursor[i] % len(events), cursor[i] // len(events)
        return times[k] - offsets[i] + loop * span

    upcoming = [(due(i), i) for i in range(n)]
    heapq.heapify(upcoming)
    lags: list[float] = []
    batches_sent = 0
    while time.time() < start_at:
        await asyncio.sleep(0.005)
    t0 = time.monotonic()
    tick = 0
    while (now := time.monotonic() - t0) < settings.duration_s:
        batches, created = [], []
        ready = []
        while upcoming and upcoming[0][0] <= now:
            ready.append(heapq.heappop(upcoming)[1])
        for i in ready:
            evs: list[BlockStored | BlockRemoved] = []
            first = None
            while (t := due(i)) <= now:
                _, kind, count = events[cursor[i] % len(events)]
                if kind == "stored":
                    fresh = [rng.getrandbits(63) for _ in range(count)]
                    own[i].extend(fresh)
                    evs.append(BlockStored(tuple(fresh), "device"))
                elif own[i]:
                    gone, own[i] = own[i][:count], own[i][count:]
                    evs.append(BlockRemoved(tuple(gone), "device"))
                first = t if first is None else first
                cursor[i] += 1
            heapq.heappush(upcoming, (due(i), i))
            if evs:
                batches.append(EventBatch(f"r{i:04d}", seqs[i], tuple(evs)))
                seqs[i] += 1
                created.append(first)
        for j in range(0, len(batches), 256):
            await directory.apply_many(batches[j : j + 256])
        done = time.monotonic() - t0
        lags.extend(done - c for c in created if c is not None)
        batches_sent += len(batches)
        tick += 1
        await asyncio.sleep(max(0.0, tick * FLUSH_S - (time.monotonic() - t0)))
    for c in clients:
        await c.aclose()
    out.put({"lags": lags, "batches": batches_sent, "elapsed_s": time.monotonic() - t0})


async def _redis_cpu(clients: list[aioredis.Redis]) -> list[float]:
    cpu = []
    for c in clients:
        info = await c.info("cpu")
        cpu.append(float(info["used_cpu_sys"]) + float(info["used_cpu_user"]))
    return cpu


async def load_phase(
    urls: list[str], clients: list[aioredis.Redis], trace: Trace, n: int, settings: Settings
) -> dict[str, Any]:
    directory = _directory(clients, op_timeout_s=1.0)
    rng = random.Random(settings.seed + 2)
    workload = _workload(trace, n, settings, rng)
    live = {f"r{i:04d}" for i in range(n)}
    policy = CacheAffinityPolicy(page_size=trace.page_size, rng=random.Random(settings.seed))
    loads = [
        ReplicaLoad(r, rng.randrange(settings.max_ongoing), 0, rng.random(), settings.max_ongoing)
        for r in sorted(live)
    ]
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    start_at = time.time() + 3.0  # the child's imports first
    child = context.Process(target=_publish, args=(urls, str(trace_path()), n, settings, start_at, out))
    child.start()
    try:
        while time.time() < start_at:
            await asyncio.sleep(0.005)
        cpu0, t0 = await _redis_cpu(clients), time.monotonic()
        decisions, lookups, cpu_ms, rank_ms = [], [], [], []
        k = 0
        while time.monotonic() - t0 < settings.duration_s:
            hashes = workload.request()
            began, began_cpu = time.perf_counter(), time.thread_time()
            matched = await directory.lookup(hashes, live)
            looked, looked_cpu = time.perf_counter(), time.thread_time()
            policy.rank(len(hashes) * trace.page_size, matched, loads)
            ended, ended_cpu = time.perf_counter(), time.thread_time()
            decisions.append((ended - began) * 1e3)
            lookups.append((looked - began) * 1e3)
            cpu_ms.append((ended_cpu - began_cpu) * 1e3)
            rank_ms.append((ended_cpu - looked_cpu) * 1e3)
            k += 1
            await asyncio.sleep(max(0.0, k / settings.router_rate - (time.monotonic() - t0)))
        cpu1, wall = await _redis_cpu(clients), time.monotonic() - t0
        published = await asyncio.to_thread(out.get, True, 60.0)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    memory = [int((await c.info("memory"))["used_memory"]) for c in clients]
    lags = sorted(published["lags"])
    return {
        "decision_ms": _percentiles(decisions),
        "lookup_ms": _percentiles(lookups),
        "decision_cpu_ms": _percentiles(cpu_ms),
        "rank_cpu_ms": _percentiles(rank_ms),
        "decisions": len(decisions),
        "redis_core_share": [round((b - a) / wall, 3) for a, b in zip(cpu0, cpu1, strict=True)],
        "redis_used_memory_mb": [round(m / 2**20, 1) for m in memory],
        "event_lag_ms": _percentiles([x * 1e3 for x in lags]),
        "publisher_batches_per_s": round(published["batches"] / published["elapsed_s"], 1),
        "lookup_fallbacks": directory.stats().fallbacks,
    }


# ---------------------------------------------------------------------------------------------- driver


def trace_path() -> Path:
    return TRACE_PATH


def _workload(trace: Trace, n: int, settings: Settings, rng: random.Random) -> Workload:
    """The Zipf workload for `n` replicas: prefixes in proportion to them, each a request's blocks but one."""
    prefixes = max(4, int(settings.prefixes_per_replica * n))
    return Workload(prefixes, max(1, round(trace.blocks_per_request) - 1), settings.zipf_s, rng)


def _directory(clients: list[aioredis.Redis], op_timeout_s: float = 1.0) -> Any:
    shards = [PrefixDirectory(c, MODEL, op_timeout_s=op_timeout_s, write_timeout_s=10.0) for c in clients]
    return shards[0] if len(shards) == 1 else ShardedDirectory(shards)


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p99": float("nan")}
    ordered = sorted(values)
    return {
        "p50": round(statistics.median(ordered), 3),
        "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3),
    }


async def run_one(trace: Trace, n: int, settings: Settings) -> dict[str, Any]:
    servers = [LocalRedis() for _ in range(settings.shards)]
    urls = [s.start() for s in servers]
    clients = [aioredis.Redis.from_url(u) for u in urls]
    try:
        result: dict[str, Any] = {"replicas": n, "shards": settings.shards}
        pow2 = await hit_ratio(_directory(clients), trace, n, settings, affinity=False)
        affinity = await hit_ratio(_directory(clients), trace, n, settings, affinity=True)
        result["hit_ratio"] = {
            "affinity": affinity["hit_ratio"],
            "pow2": pow2["hit_ratio"],
            "requests": affinity["requests"],
        }
        result["redis_us_per_lookup"] = await redis_cost_per_lookup(clients, trace, n, settings)
        result["load"] = await load_phase(urls, clients, trace, n, settings)
        return result
    finally:
        for c in clients:
            await c.aclose()
        for s in servers:
            s.stop()


def environment() -> dict[str, Any]:
    root = Path(__file__).resolve().parent.parent
    try:
        tree = subprocess.run(
            ["git", "rev-parse", "HEAD^{tree}"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        tree = commit = "unknown"
    redis_version = subprocess.run(
        [LocalRedis().binary or "redis-server", "--version"], capture_output=True, text=True
    ).stdout.split()[2:3]
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "tree": tree,
        "device": f"cpu: {cpu}",
        "python": platform.python_version(),
        "redis_server": (redis_version or ["?"])[0].removeprefix("v="),
        "redis_py": importlib.metadata.version("redis"),
        "ray": importlib.metadata.version("ray"),
    }


def run(settings: Settings) -> dict[str, Any]:
    trace = Trace.load()
    started = environment()  # the tree measured, before any commit made while it runs
    rows = [asyncio.run(run_one(trace, n, settings)) for n in settings.replicas]
    return {
        **started,
        "load_average": list(os.getloadavg()),
        "cpus": os.cpu_count(),
        "settings": asdict(settings),
        "trace": trace.summary(),
        "runs": rows,
    }


def report(result: dict[str, Any]) -> list[str]:
    lines = []
    for row in result["runs"]:
        load = row["load"]
        lines.append(
            f"N={row['replicas']:5d} shards={row['shards']} "
            f"decision p50/p99 {load['decision_ms']['p50']:.2f}/"
            f"{load['decision_ms']['p99']:.2f} ms (lookup p99 {load['lookup_ms']['p99']:.2f}; CPU p50/p99 "
            f"{load['decision_cpu_ms']['p50']:.2f}/{load['decision_cpu_ms']['p99']:.2f}, rank "
            f"{load['rank_cpu_ms']['p99']:.2f}; redis {row['redis_us_per_lookup']} us/lookup) "
            f"redis core {load['redis_core_share']} mem {load['redis_used_memory_mb']} MB "
            f"lag p50/p99 {load['event_lag_ms']['p50']:.1f}/{load['event_lag_ms']['p99']:.1f} ms "
            f"batches/s {load['publisher_batches_per_s']} hit affinity {row['hit_ratio']['affinity']:.3f} "
            f"pow2 {row['hit_ratio']['pow2']:.3f}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.directory_scale", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--replicas", type=int, nargs="+", help="simulated replica counts (default 100 300 1000)"
    )
    parser.add_argument(
        "--shards", type=int, default=None, help="redis-servers the directory is sharded over"
    )
    parser.add_argument("--sharded", action="store_true", help="also run every count on three shards")
    parser.add_argument("--duration", type=float, help="seconds of the load phase per count")
    parser.add_argument("--rate-scale", type=float, help="the trace's event rates times this")
    parser.add_argument("--smoke", action="store_true", help="one small count, seconds in all")
    parser.add_argument(
        "--out", type=Path, help="results file (default benchmarks/results/directory_scale.json)"
    )
    args = parser.parse_args(argv)
    settings = SMOKE if args.smoke else Settings()
    overrides = {
        "replicas": tuple(args.replicas) if args.replicas else None,
        "shards": args.shards,
        "duration_s": args.duration,
        "rate_scale": args.rate_scale,
    }
    settings = replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    result = run(settings)
    if args.sharded:
        result["runs"] += run(replace(settings, shards=3))["runs"]
    result["aims"] = aims(result)
    out = args.out or RESULTS / f"directory_scale{'-smoke' if args.smoke else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for line in report(result):
        print(line)
    print(json.dumps(result["aims"]), "->", out)
    return 0


def aims(result: dict[str, Any]) -> dict[str, Any]:
    """Each run against the aims: decision p99 <= 2 ms and every Redis below half a core."""
    return {
        f"{row['replicas']}x{row['shards']}": {
            "p99_ok": row["load"]["decision_ms"]["p99"] <= AIM_P99_MS,
            "redis_ok": max(row["load"]["redis_core_share"]) < AIM_CORE_SHARE,
            "affinity_over_pow2": round(
                row["hit_ratio"]["affinity"] / max(row["hit_ratio"]["pow2"], 1e-9), 3
            ),
        }
        for row in result["runs"]
    }


if __name__ == "__main__":
    raise SystemExit(main())
