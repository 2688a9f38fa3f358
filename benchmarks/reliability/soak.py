"""Soak on CPU: mixed multi-tenant load on a 2-replica app for N minutes, a fault every minute.

    python -m benchmarks run reliability [--smoke] [--set minutes=10] [--set seed=0]

The app: the tiny model on 2 replicas (8 slots each) behind the ingress, real Ray Serve, and a
real redis-server that persists as `infra/redis.conf` does (append-only file). Load: Locust,
headless (`benchmarks/locust_load.py`), three tenants of different fair-share weights (their
share of users and the weight in their tenant spec) and request shapes (completion and message
length), multi-turn chats behind shared per-tenant system prompts (prefix-cache hits), plain and
streamed; Locust's CSVs, report and summary are kept in `benchmarks/results/reliability-locust/`
(`smoke/reliability-locust/` for a smoke run). Beside it a rate-limited tenant (6 requests a
minute) tries every few seconds from a plain client, since it sends a refused request (429 / 503
with `Retry-After`) again after the wait, up to 4 times, as the official client does, which
Locust does not.

Faults, one a minute (at its 30th second), in turn: SIGKILL of a model replica's process, Redis
SIGKILLed for 10 s and started again, a storm of 12 streams that disconnect at random.

Counted: Locust's requests and failures per tenant (a failure: a 4xx/5xx, an SSE error event,
e.g. a stream whose replica died, or a stream without `[DONE]`), and the per-tenant tokens of
the usage the clients received; for the rate-limited tenant, per request it meant to make: sent,
succeeded, refused (still refused after the retries), failed with an answer (an OpenAI error body
or an SSE error event), lost (no answer at all: a hang, a broken connection, a malformed reply),
and retries (the client's after `Retry-After`, and the ingress's own, from `x-antumbra-retries`).
Memory: RSS of every process of the Ray session and of Redis at the start and the end, and
Redis's `used_memory`. The bound, checked per long-lived process (a killed replica's successor
is compared with the replica it replaced): end <= 1.25 x start + 64 MiB.

After the soak: the refusal path's latency alone (the slots held by long streams, requests sent one
at a time), refusal latency under 3x overload (16 clients for the 16 slots throughout, 32
more joining and leaving in turns; p50 / p99 / max of the 503s, and the admitted median TTFT
against the TTFT at capacity), and the TTFT ratio of a tenant beside one hammering its rate limit
(20 requests a second) to the same tenant alone. Options: minutes (0: only the measurements after
the soak), fault_every_s, seed, users (Locust's). A smoke run soaks for a few seconds (Locust, no
fault) and measures each after-soak figure once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from ..lib.context import Context
from ..lib.records import RESULTS_DIR, SMOKE_DIR
from ..lib.timing import percentile
from ..locust_load import REPO, locust_results, start_locust

DEVICE = "cpu"

MODEL = "tiny"
SLOTS = 2 * 8
RSS_FACTOR, RSS_SLACK = 1.25, 64 << 20
# Locust's tenants: fair-share weight (users and tenant spec) and request shape, each its own.
LOCUST_TENANTS = {
    "alpha": {"rps": 1.0, "weight": 2.0, "max_tokens": 12, "message_words": 10},
    "beta": {"rps": 0.5, "weight": 1.0, "max_tokens": 32, "message_words": 40},
    "gamma": {"rps": 1.0, "weight": 1.0, "max_tokens": 8, "message_words": 80},
}
SMOKE_MINUTES = 0.25
WORDS = ("river stone cloud lantern orchard copper meadow signal harbor ember quiet spiral window "
         "falcon").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass
class Counts:
    sent: int = 0
    succeeded: int = 0
    refused: int = 0
    failed_answered: int = 0
    lost: int = 0
    client_retries: int = 0
    ingress_retries: int = 0
    examples: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        if len(self.examples) < 10:
            self.examples.append(what[:200])


@dataclass
class Reply:
    ok: bool = False
    status: int | None = None  # the HTTP status of an error answer
    answered: bool = True  # False: no answer at all
    retry_after: float = 0.0
    retries: int = 0
    ttft: float | None = None
    latency: float = 0.0
    error: str = ""


async def call(client: openai.AsyncOpenAI, prompt: str, max_tokens: int, stream: bool,
               disconnect_after: int | None = None) -> Reply:
    """One completion; every outcome becomes a Reply (nothing the server does raises here)."""
    out, started = Reply(), time.monotonic()
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "extra_body": {"ignore_eos": True}}
    try:
        if not stream:
            raw = await client.completions.with_raw_response.create(**body)
            out.retries = int(raw.headers.get("x-antumbra-retries", 0))
            reply = raw.parse()
            out.ok = bool(reply.usage and reply.usage.completion_tokens == max_tokens)
        else:
            chunks = await client.completions.create(**body, stream=True)
            out.retries = int(chunks.response.headers.get("x-antumbra-retries", 0))
            n = 0
            try:
                async for chunk in chunks:
                    if chunk.choices:
                        n += 1
                        out.ttft = out.ttft if out.ttft is not None else time.monotonic() - started
                        if disconnect_after is not None and n >= disconnect_after:
                            break
                        out.ok = out.ok or chunk.choices[0].finish_reason is not None
            finally:
                await chunks.close()
    except openai.APIStatusError as exc:
        out.status = exc.status_code
        headers = exc.response.headers  # the official client reads `retry-after-ms` first
        wait_ms = headers.get("retry-after-ms")
        out.retry_after = float(wait_ms) / 1000 if wait_ms else float(headers.get("retry-after") or 0)
        out.error = exc.message
    except openai.APIError as exc:  # an SSE error event (answered), or no answer at all
        out.answered = isinstance(exc.body, dict)
        out.error = repr(exc)
    out.latency = time.monotonic() - started
    return out


class Soak:
    def __init__(self, url: str, keys: dict[str, str], admin: dict[str, str], seed: int) -> None:
        self.url, self.keys, self.admin = url, keys, admin
        self.counts = Counts()
        self.rng = random.Random(seed)
        self.stop = asyncio.Event()

    def client(self, tenant: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.keys[tenant], max_retries=0,
                                  timeout=120)

    async def logical(self, client: openai.AsyncOpenAI, prompt: str, max_tokens: int, stream: bool) -> None:
        """One request the client means to make: sent again after each refusal, up to 4 times."""
        c = self.counts
        c.sent += 1
        for attempt in range(5):
            r = await call(client, prompt, max_tokens, stream)
            c.ingress_retries += r.retries
            if r.status in (429, 503) and r.retry_after > 0 and attempt < 4:
                c.client_retries += 1
                await asyncio.sleep(r.retry_after)
                continue
            if r.ok:
                c.succeeded += 1
            elif r.status in (429, 503):
                c.refused += 1
            elif r.status is not None or r.answered:
                c.failed_answered += 1
                c.note(f"answered failure: {r.status} {r.error}")
            else:
                c.lost += 1
                c.note(f"LOST: {r.error}")
            return

    async def limited(self) -> None:
        client = self.client("capped")
        try:
            while not self.stop.is_set():
                await self.logical(client, f"capped {time.monotonic()}", 4, stream=False)
                await asyncio.sleep(3.0)
        finally:
            await client.close()

    # ------------------------------------------------------------------ faults
    def replicas(self) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/admin/models/{MODEL}/replicas", headers=self.admin, timeout=60)
        r.raise_for_status()
        return dict(r.json())

    async def kill_replica(self) -> dict[str, Any]:
        victim = self.rng.choice((await asyncio.to_thread(self.replicas))["data"])
        os.kill(victim["pid"], signal.SIGKILL)
        return {"fault": "replica_kill", "replica": victim["replica_id"], "pid": victim["pid"]}

    async def restart_redis(self, redis: Any) -> dict[str, Any]:
        await asyncio.to_thread(redis.kill)
        await asyncio.sleep(10.0)
        await asyncio.to_thread(redis.start)
        return {"fault": "redis_restart", "down_s": 10.0}

    async def disconnect_storm(self) -> dict[str, Any]:
        tenants = [t for t in self.keys if t != "capped"]
        clients = {t: self.client(t) for t in tenants}
        try:
            outs = await asyncio.gather(*(
                call(clients[tenants[i % len(tenants)]], f"storm {i} " + words(self.rng, 20), 2000, True,
                     disconnect_after=self.rng.randint(1, 30))
                for i in range(12)))
        finally:
            for c in clients.values():
                await c.close()
        return {"fault": "disconnect_storm", "streams": len(outs), "answered": sum(o.answered for o in outs)}


# ---------------------------------------------------------------------------------------------- memory


def ray_processes() -> dict[int, str]:
    """pid -> name of every process of this driver's Ray session (raylet, GCS, the raylet's children)."""
    import psutil
    import ray

    node = ray._private.worker._global_node
    found: dict[int, str] = {}
    for key in ("raylet", "gcs_server"):
        for info in node.all_processes.get(key, []):
            found[info.process.pid] = key
    raylet = next((pid for pid, name in found.items() if name == "raylet"), None)
    if raylet is not None:
        for p in psutil.Process(raylet).children(recursive=True):
            try:
                # Ray titles a worker "ray::<actor>.<task it runs now>": keep the actor's part.
                found[p.pid] = re.sub(r"\.[a-z_]+$", "", " ".join(p.cmdline()).strip())[:80]
            except psutil.Error:
                continue
    return found


def rss(pids: dict[int, str]) -> dict[str, dict[str, Any]]:
    import psutil

    out = {}
    for pid, name in pids.items():
        try:
            resident = psutil.Process(pid).memory_info().rss
            out[f"{name} [{pid}]"] = {"pid": pid, "name": name, "rss_bytes": resident}
        except psutil.Error:
            continue
    return out


def memory_check(start: dict[str, dict[str, Any]], end: dict[str, dict[str, Any]],
                 replaced: dict[int, int]) -> list[dict[str, Any]]:
    """Start and end RSS per long-lived process (a killed replica against its successor), and whether
    it is within the bound."""
    by_pid = {v["pid"]: v for v in end.values()}
    rows = []
    for v in start.values():
        now = by_pid.get(replaced.get(v["pid"], v["pid"]))
        if now is None or "worker" in v["name"] and "Serve" not in v["name"]:
            continue  # an idle Ray worker that came and went
        bound = RSS_FACTOR * v["rss_bytes"] + RSS_SLACK
        rows.append({"process": v["name"], "pid_start": v["pid"], "pid_end": now["pid"],
                     "rss_start_mib": round(v["rss_bytes"] / 2**20, 1),
                     "rss_end_mib": round(now["rss_bytes"] / 2**20, 1),
                     "within_bound": now["rss_bytes"] <= bound})
    return rows


# --------------------------------------------------------------------------------------------- after the soak



async def refusals_at_capacity(soak: Soak, count: int = 40) -> dict[str, Any]:
    """The slots held by long streams, then `count` requests one at a time: each is refused. Their
    latency is the refusal path's alone, without 3x overload's load on the same cores."""
    clients = [soak.client(("alpha", "beta")[i % 2]) for i in range(2)]
    hold = asyncio.Event()

    async def holder(i: int) -> None:
        stream = await clients[i % 2].completions.create(model=MODEL, prompt=f"hold {i}", max_tokens=2000,
                                                         stream=True, extra_body={"ignore_eos": True})
        try:
            async for _ in stream:
                if hold.is_set():
                    break
        finally:
            await stream.close()

    holders = [asyncio.create_task(holder(i)) for i in range(SLOTS)]
    try:
        await asyncio.sleep(3.0)
        replies = [await call(clients[0], f"refused {i}", 4, False) for i in range(count)]
    finally:
        hold.set()
        await asyncio.gather(*holders, return_exceptions=True)
        for c in clients:
            await c.close()
    waits = [r.latency for r in replies if r.status == 503]
    return {"requests": count, "refused": len(waits),
            "latency_p50_ms": 1000 * (percentile(waits, 0.5) or 0),
            "latency_p99_ms": 1000 * (percentile(waits, 0.99) or 0),
            "p99_under_50_ms": (percentile(waits, 0.99) or 1) < 0.05}


async def overload(soak: Soak, rounds: int = 3, phase_s: float = 4.0) -> dict[str, Any]:
    """16 clients for the 16 slots throughout; 32 more join and leave every `phase_s` (3x capacity)."""
    tenants = ("alpha", "beta")
    clients = {t: soak.client(t) for t in tenants}
    t0 = time.monotonic() + 1.0
    end = t0 + 2 * rounds * phase_s
    rows: list[tuple[int, Reply, float]] = []  # (phase index, reply, started)

    async def loop(i: int, excess: bool) -> None:
        rng = random.Random(f"overload:{i}:{excess}")
        while time.monotonic() < end:
            if excess and int((time.monotonic() - t0) // phase_s) % 2 == 0:
                await asyncio.sleep(0.05)
                continue
            started = time.monotonic()
            r = await call(clients[tenants[i % 2]], f"{rng.random()} " + words(rng, 40), 8, True)
            rows.append((int((started - t0) // phase_s), r, started))
            if r.status is not None:
                await asyncio.sleep(r.retry_after or 1.0)

    try:
        await asyncio.gather(*(loop(i, False) for i in range(SLOTS)),
                             *(loop(i, True) for i in range(2 * SLOTS)))
    finally:
        for c in clients.values():
            await c.close()
    usable = [(p, r) for p, r, s in rows if s >= t0 and 0 <= p < 2 * rounds]
    refusals = [r.latency for p, r in usable if p % 2 and r.status is not None]
    admitted = [r.ttft for p, r in usable if p % 2 and r.ok and r.ttft is not None]
    at_capacity = [r.ttft for p, r in usable if p % 2 == 0 and r.ok and r.ttft is not None]
    return {
        "clients": 3 * SLOTS, "slots": SLOTS, "refused": len(refusals), "admitted": len(admitted),
        "refusal_statuses": sorted({r.status for p, r in usable if r.status is not None}),
        "refusal_latency_p50_ms": 1000 * (percentile(refusals, 0.5) or 0),
        "refusal_latency_p99_ms": 1000 * (percentile(refusals, 0.99) or 0),
        "refusal_latency_max_ms": 1000 * max(refusals, default=0),
        "refusal_p99_under_50_ms": (percentile(refusals, 0.99) or 1) < 0.05,
        "admitted_ttft_p50_ms": 1000 * statistics.median(admitted) if admitted else None,
        "at_capacity_ttft_p50_ms": 1000 * statistics.median(at_capacity) if at_capacity else None,
        "admitted_over_at_capacity_ttft": (statistics.median(admitted) / statistics.median(at_capacity))
        if admitted and at_capacity else None,
    }


async def neighbours(soak: Soak, rounds: int = 4, phase_s: float = 3.0) -> dict[str, Any]:
    """A tenant's TTFT alone and beside one that sends 20 requests a second past its limit, in turns."""
    measured, capped = soak.client("beta"), soak.client("capped")
    alone: list[float] = []
    beside: list[float] = []
    hammer: list[Reply] = []
    rng = random.Random("neighbours")

    async def hammering(stop: asyncio.Event) -> None:
        while not stop.is_set():
            hammer.append(await call(capped, f"hammer {rng.random()}", 4, False))
            await asyncio.sleep(0.05)

    try:
        for r in range(2 * rounds):
            stop = asyncio.Event()
            task = asyncio.create_task(hammering(stop)) if r % 2 else None
            phase_end, samples = time.monotonic() + phase_s, []
            while time.monotonic() < phase_end:
                out = await call(measured, f"{rng.random()} " + words(rng, 40), 4, True)
                if out.ok and out.ttft is not None:
                    samples.append(out.ttft)
            stop.set()
            if task is not None:
                await task
            (beside if r % 2 else alone).extend(samples[1:])
    finally:
        await measured.close()
        await capped.close()
    return {"samples_alone": len(alone), "samples_beside": len(beside), "hammer_requests": len(hammer),
            "hammer_429": sum(h.status == 429 for h in hammer),
            "ttft_p50_alone_ms": 1000 * statistics.median(alone),
            "ttft_p50_beside_ms": 1000 * statistics.median(beside),
            "ratio": statistics.median(beside) / statistics.median(alone)}


# ---------------------------------------------------------------------------------------------- the run


def locust_tenants(keys: dict[str, str]) -> list[dict[str, Any]]:
    return [{"name": t, "api_key": keys[t], **load} for t, load in LOCUST_TENANTS.items()]


async def soak_for(soak: Soak, redis: Any, minutes: float, fault_every_s: float,
                   locust_out: Path, users: int) -> tuple[list[dict[str, Any]], int | None]:
    """Locust's load and the rate-limited tenant for `minutes`, a fault every `fault_every_s`; the
    faults and Locust's exit code (None: no soak)."""
    if minutes <= 0:
        return [], None
    duration_s = max(1, round(60 * minutes))
    locust = start_locust(soak.url, locust_tenants(soak.keys), locust_out, duration_s=duration_s, users=users)
    tasks = [asyncio.create_task(soak.limited())]
    t0, faults = time.monotonic(), []
    end = t0 + 60 * minutes
    k = 0
    while t0 + fault_every_s * k + fault_every_s / 2 < end - 15:  # the last fault has time to heal
        await asyncio.sleep(max(0.0, t0 + fault_every_s * k + fault_every_s / 2 - time.monotonic()))
        at = time.monotonic() - t0
        fault = await _fault(soak, redis, k % 3)
        faults.append({"at_s": round(at, 1), **fault})
        c = soak.counts
        print(f"  {at:6.1f} s  {fault}  rate-limited tenant so far: {c.succeeded} ok / {c.sent} sent, "
              f"{c.lost} lost", flush=True)
        k += 1
    await asyncio.sleep(max(0.0, end - time.monotonic()))
    soak.stop.set()
    await asyncio.gather(*tasks)
    return faults, await asyncio.to_thread(locust.wait)


async def _fault(soak: Soak, redis: Any, which: int) -> dict[str, Any]:
    if which == 0:
        return await soak.kill_replica()
    if which == 1:
        return await soak.restart_redis(redis)
    return await soak.disconnect_storm()


def run(ctx: Context) -> dict[str, Any]:
    minutes = ctx.option("minutes", SMOKE_MINUTES if ctx.smoke else 10.0)
    fault_every_s = ctx.option("fault_every_s", 60.0)
    seed = ctx.option("seed", 0)
    users = ctx.option("users", 8)
    locust_out = (SMOKE_DIR if ctx.smoke else RESULTS_DIR) / "reliability-locust"
    rounds = 1 if ctx.smoke else None

    import redis as redis_py

    from antumbra.platform.launch.redis_server import LocalRedis, free_port
    from antumbra.platform.launch.serve_cli import local_platform
    from antumbra.replicas.model.tiny import TinyModelSpec, make_tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix="antumbra-soak-") as tmp:
        model = make_tiny_checkpoint(Path(tmp) / "model", TinyModelSpec())
        redis = LocalRedis(data_dir=Path(tmp) / "redis")
        redis.start()
        spec = {"path": str(model), "replicas": 2, "max_ongoing_requests": SLOTS // 2,
                "max_queued_requests": 8, "max_model_len": 4096}
        config = {"redis_url": redis.url, "stream_idle_timeout_s": 30, "models": {MODEL: spec}}
        try:
            with local_platform(config, port=free_port(), num_cpus=2, create_default_tenant=False) as running:
                admin = {"Authorization": f"Bearer {running.admin_key}"}
                keys = {}
                specs = [{"id": t, "weight": load["weight"]} for t, load in LOCUST_TENANTS.items()]
                for spec in (*specs, {"id": "capped", "rpm": 6}):
                    r = httpx.post(f"{running.base_url}/admin/tenants", json=spec, headers=admin, timeout=30)
                    r.raise_for_status()
                    keys[spec["id"]] = r.json()["api_key"]
                soak = Soak(running.base_url, keys, admin, seed)
                _wait(lambda: soak.replicas()["ingress"]["capacity"] == SLOTS, 120)
                info = redis_py.Redis.from_url(redis.url)
                redis_start = info.info("memory")["used_memory"]
                mem_start = rss({**ray_processes(), redis.pid: "redis-server"})
                started = time.monotonic()
                faults, locust_rc = asyncio.run(
                    soak_for(soak, redis, minutes, fault_every_s, locust_out, users))
                soak_s = time.monotonic() - started
                _wait(lambda: len(soak.replicas()["data"]) == 2, 120)
                _wait(lambda: soak.replicas()["ingress"]["capacity"] == SLOTS, 60)
                _wait(lambda: all(_idle(s["stats"]) for s in soak.replicas()["data"]), 60)
                checked = httpx.get(f"{running.base_url}/admin/models/{MODEL}/replicas", headers=admin,
                                    params={"check_integrity": "true"}, timeout=60).json()["data"]
                mem_end = rss({**ray_processes(), redis.pid: "redis-server"})
                redis_end = info.info("memory")["used_memory"]
                at_capacity = asyncio.run(refusals_at_capacity(soak, count=8 if rounds else 40))
                over = asyncio.run(overload(soak, rounds=rounds or 3))
                near = asyncio.run(neighbours(soak, rounds=rounds or 4))
        finally:
            redis.stop()
    memory = memory_check(mem_start, mem_end, _successors(mem_start, mem_end))
    c = soak.counts
    locust_summary, locust_report = locust_results(locust_out) if locust_rc is not None else ({}, {})
    return {
        "minutes": minutes, "soak_wall_s": round(soak_s, 1),
        "fault_every_s": fault_every_s, "faults": faults,
        "locust": {"users": users, "tenants": LOCUST_TENANTS, "exit_code": locust_rc,
                   "dir": str(locust_out.relative_to(REPO)), "summary": locust_summary,
                   "usage_received": locust_report.get("tenants", {})},
        "rate_limited_tenant": {"sent": c.sent, "succeeded": c.succeeded, "refused_after_retries": c.refused,
                     "failed_answered": c.failed_answered, "lost": c.lost, "client_retries": c.client_retries,
                     "ingress_retries": c.ingress_retries, "examples": c.examples},
        "integrity": [s.get("integrity") for s in checked],
        "memory_bound": f"end RSS <= {RSS_FACTOR} x start + {RSS_SLACK >> 20} MiB per process",
        "memory": memory, "memory_within_bound": all(m["within_bound"] for m in memory),
        "redis_used_memory_start": redis_start, "redis_used_memory_end": redis_end,
        "refusals_at_capacity": at_capacity, "overload": over, "rate_limited_neighbour": near,
        "ratios": {"admitted_over_at_capacity_ttft": over["admitted_over_at_capacity_ttft"],
                   "rate_limited_neighbour_ttft_vs_alone": near["ratio"]},
    }


def _idle(stats: dict[str, float]) -> bool:
    held = ("request_vpages", "request_swa_pages", "locked_cache_pages", "hot_buffers")
    busy = stats["num_running"] + stats["num_waiting"] + stats["in_flight"]
    return busy == 0 and not any(stats[k] for k in held)


def _wait(predicate: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError, KeyError):  # a replica restarting answers nothing yet
            if predicate():
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"not settled within {timeout_s} s")
        time.sleep(0.5)


def _successors(start: dict[str, dict[str, Any]], end: dict[str, dict[str, Any]]) -> dict[int, int]:
    """Killed processes (replicas, Redis) -> the process of the same name that replaced them."""
    alive = {v["pid"] for v in end.values()}
    new = {v["pid"]: v["name"] for v in end.values() if v["pid"] not in {s["pid"] for s in start.values()}}
    out = {}
    for v in start.values():
        if v["pid"] in alive:
            continue
        heir = next((pid for pid, name in new.items() if name == v["name"] and pid not in out.values()), None)
        if heir is not None:
            out[v["pid"]] = heir
    return out
