"""Request routers compared on 4 CPU replicas of the tiny model, multi-tenant shared-prefix load.

Three runs, one per router, each on a fresh app (`build_app(PlatformConfig(...))` through
`serve_cli.local_platform`, a fresh Redis, cold replica caches) in one Ray instance:

  antumbra   `antumbra.platform.routing.router:CacheAffinityRouter` (prefix directory fed by the
             replicas' cache events, per-tenant namespaces, load term and hot-spot gate)
  pow2       Ray Serve's default power-of-two-choices router
  ray_prefix Ray's `PrefixCacheAffinityRouter` (a character trie of the request text that the
             router builds from its own routing history; tenant-blind)

Workload (the same seeded sequence for each router): `tenants` tenants, each with
`prompts_per_tenant` system prompts of about `system_tokens` tokens. The first one is the
same text for every tenant (a common default system prompt: its KV is still per tenant,
since caches are namespaced by tenant), the others are the tenant's own. Each request is a
streamed completion of one of its tenant's system prompts plus a unique question of about
`question_tokens` tokens, `max_tokens` greedy tokens; `concurrency` clients send
`requests` requests in all, after `warmup` requests of unrelated random text.

Per router: the cached share of prompt tokens (`usage.prompt_tokens_details.cached_tokens`),
TTFT mean / p50 / p99 measured at the client (first streamed text), request and output-token
throughput, failures; for ours also its routing decisions by reason (affinity, hot_spot, load,
no_directory) and its failed directory lookups (directory_timeout, directory_error), read from
the `antumbra_routing_decisions` / `antumbra_directory_failures` metrics on Ray's metrics
endpoint. Ratios against pow2 and ray_prefix are computed from the same run.

    python -m benchmarks run platform --only routing [--smoke] [--set rounds=2]

Options: replicas, requests, concurrency, tenants, system_tokens, routers (a comma list), model (a
checkpoint directory), rounds, router_kwargs (JSON for our router). With `rounds` N each router
runs N times (the order rotating each round, so slow phases of a
shared machine spread over all routers); figures are the means over rounds, every round is kept.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..lib.context import Context
from ..lib.timing import percentile

ROUTERS: dict[str, str | None] = {
    "antumbra": "antumbra.platform.routing.router:CacheAffinityRouter",
    "pow2": None,
    "ray_prefix": (
        "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:PrefixCacheAffinityRouter"
    ),
}
MODEL = "antumbra-tiny"


@dataclass(frozen=True)
class Workload:
    tenants: int = 4
    prompts_per_tenant: int = 2
    system_tokens: int = 1024
    question_tokens: int = 48
    max_tokens: int = 8
    requests: int = 96
    concurrency: int = 8
    warmup: int = 8
    seed: int = 0


@dataclass
class Sample:
    tenant: str
    ok: bool
    ttft_s: float | None = None
    total_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""


@dataclass
class RunResult:
    router: str
    wall_s: float
    samples: list[Sample] = field(default_factory=list)
    decisions: dict[str, float] = field(default_factory=dict)  # our router's, by reason

    def summary(self) -> dict[str, Any]:
        ok = [s for s in self.samples if s.ok]
        ttfts = sorted(s.ttft_s for s in ok if s.ttft_s is not None)
        prompt = sum(s.prompt_tokens for s in ok)
        return {
            "requests": len(self.samples),
            "failures": len(self.samples) - len(ok),
            "errors": sorted({s.error for s in self.samples if s.error})[:5],
            "cached_token_ratio": sum(s.cached_tokens for s in ok) / prompt if prompt else 0.0,
            "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
            "ttft_p50_s": percentile(ttfts, 0.50),
            "ttft_p99_s": percentile(ttfts, 0.99),
            "wall_s": self.wall_s,
            "requests_per_s": len(ok) / self.wall_s if self.wall_s else 0.0,
            "output_tokens_per_s": sum(s.completion_tokens for s in ok) / self.wall_s if self.wall_s else 0.0,
            "routing_decisions": self.decisions,
        }



_WORDS = "alpha beta gamma delta kappa lambda sigma omega river stone cloud field light north south".split()


def _text(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of text for the tiny model's V4 tokenizer (a space and one of these
    words are one token, "kappa" two)."""
    out: list[str] = []
    size = 0
    while size < tokens:
        word = rng.choice(_WORDS)
        out.append(word)
        size += 1
    return " ".join(out)


def build_requests(w: Workload) -> tuple[list[tuple[int, str]], list[str]]:
    """(tenant index, prompt) per measured request, and the warm-up prompts; seeded, so every
    router gets the same."""
    rng = random.Random(w.seed)
    common = "You are a helpful assistant. " + _text(rng, w.system_tokens)
    systems = [
        [common]
        + [
            f"You are tenant {t}'s agent {k}. " + _text(rng, w.system_tokens)
            for k in range(1, w.prompts_per_tenant)
        ]
        for t in range(w.tenants)
    ]
    requests = []
    for i in range(w.requests):
        t = rng.randrange(w.tenants)
        requests.append(
            (t, f"{rng.choice(systems[t])}\nQuestion {i}: {_text(rng, w.question_tokens)}\nAnswer:")
        )
    warmup = [f"Warm-up {i}: {_text(rng, 64)}" for i in range(w.warmup)]
    return requests, warmup


async def _one(client: Any, key: str, tenant: str, prompt: str, max_tokens: int) -> Sample:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    sample = Sample(tenant=tenant, ok=False)
    try:
        async with client.stream(
            "POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as resp:
            if resp.status_code != 200:
                sample.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return sample
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    sample.ok = True
                    break
                event = json.loads(data)
                if "error" in event:
                    sample.error = str(event["error"])[:200]
                    break
                if any(c.get("text") for c in event.get("choices") or []) and sample.ttft_s is None:
                    sample.ttft_s = time.perf_counter() - start
                usage = event.get("usage")
                if usage:
                    sample.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    sample.completion_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    sample.cached_tokens = int(details.get("cached_tokens") or 0)
    except Exception as exc:  # a failed request is a data point, not the end of the benchmark
        sample.error = repr(exc)[:200]
    sample.total_s = time.perf_counter() - start
    return sample


async def drive(base_url: str, keys: list[str], w: Workload) -> tuple[list[Sample], float]:
    """Warm up, then send the measured requests from `concurrency` clients; returns samples and wall time."""
    import httpx

    requests, warmup = build_requests(w)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(300.0)) as client:
        await asyncio.gather(
            *(_one(client, keys[i % len(keys)], "warmup", p, 2) for i, p in enumerate(warmup))
        )
        queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
        for item in requests:
            queue.put_nowait(item)
        samples: list[Sample] = []

        async def worker() -> None:
            while not queue.empty():
                t, prompt = queue.get_nowait()
                samples.append(await _one(client, keys[t], f"tenant-{t}", prompt, w.max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(w.concurrency)))
        return samples, time.perf_counter() - start


async def _create_tenants(redis_url: str, prefix: str, count: int) -> list[str]:
    import redis.asyncio as aioredis

    from antumbra.platform.ingress.tenant_spec import TenantSpec
    from antumbra.platform.ingress.tenants import TenantStore

    client = aioredis.Redis.from_url(redis_url)
    try:
        store = TenantStore(client, prefix)
        return [(await store.create(TenantSpec(id=f"tenant-{t}")))[1] for t in range(count)]
    finally:
        await client.aclose()


def routing_decisions() -> dict[str, float]:
    """Our router's decisions so far in this Ray session, by reason, from the node's metrics endpoint."""
    import urllib.request

    import ray

    totals: dict[str, float] = {}
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if not node.get("Alive") or not port:
            continue
        try:
            url = f"http://{node['NodeManagerAddress']}:{port}/metrics"
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            for metric, label in (("routing_decisions", "decision"), ("directory_failures", "kind")):
                if line.startswith(f"ray_antumbra_{metric}_total{{"):
                    labels, _, value = line.rpartition(" ")
                    name = labels.split(f'{label}="', 1)[1].split('"', 1)[0]
                    key = name if metric == "routing_decisions" else f"directory_{name}"
                    totals[key] = totals.get(key, 0.0) + float(value)
    return totals


def _decisions_of_run(before: dict[str, float], expected: int, timeout_s: float = 30.0) -> dict[str, float]:
    """This run's decisions: wait until the exported counters cover `expected` routed requests."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = routing_decisions()
        diff = {k: v - before.get(k, 0.0) for k, v in now.items() if v - before.get(k, 0.0) > 0}
        routed = sum(v for k, v in diff.items() if not k.startswith("directory_"))
        if routed >= expected or time.monotonic() > deadline:
            return diff
        time.sleep(2.0)


def run_router(
    name: str,
    router: str | None,
    model_path: Path,
    w: Workload,
    replicas: int,
    port: int,
    router_kwargs: dict[str, Any] | None = None,
) -> RunResult:
    from antumbra.platform.launch.serve_cli import local_platform

    spec: dict[str, Any] = {
        "path": str(model_path),
        "replicas": replicas,
        "num_cpus": 0,
        "max_ongoing_requests": 16,
    }
    if router is not None:
        spec["router"] = router
    if name == "antumbra" and router_kwargs:
        spec["router_kwargs"] = router_kwargs
    config = {"models": {MODEL: spec}}
    with local_platform(config, port=port, create_default_tenant=False) as platform:
        keys = asyncio.run(_create_tenants(platform.redis_url, platform.config.key_prefix, w.tenants))
        before = routing_decisions()
        samples, wall = asyncio.run(drive(platform.base_url, keys, w))
        decisions = _decisions_of_run(before, w.requests + w.warmup) if name == "antumbra" else {}
    return RunResult(name, wall, samples, decisions)


DEVICE = "cpu"


def run(ctx: Context) -> dict[str, Any]:
    import ray

    from antumbra.cli import default_tiny_model_dir
    from antumbra.platform.launch.redis_server import free_port

    logging.getLogger("httpx").setLevel(logging.WARNING)
    small = ctx.smoke
    w = Workload(
        tenants=ctx.option("tenants", 2 if small else Workload.tenants),
        system_tokens=ctx.option("system_tokens", 256 if small else Workload.system_tokens),
        requests=ctx.option("requests", 8 if small else Workload.requests),
        concurrency=ctx.option("concurrency", 2 if small else Workload.concurrency),
        warmup=2 if small else Workload.warmup,
    )
    replicas = ctx.option("replicas", 2 if small else 4)
    model = ctx.option("model", "")
    model_path = Path(model) if model else default_tiny_model_dir()
    router_kwargs = json.loads(ctx.option("router_kwargs", "{}"))
    names = ctx.option("routers", "antumbra" if small else ",".join(ROUTERS)).split(",")
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        for r in range(ctx.option("rounds", 1)):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                outcome = run_router(name, ROUTERS[name], model_path, w, replicas, free_port(), router_kwargs)
                rounds[name].append(outcome.summary())
    finally:
        ray.shutdown()
    results = {name: _mean_of(runs) for name, runs in rounds.items()}
    ratios: dict[str, Any] = {}
    ours = results.get("antumbra")
    for peer in ("pow2", "ray_prefix"):
        theirs = results.get(peer)
        if not ours or not theirs:
            continue
        ratios[f"cached_ratio_vs_{peer}"] = _ratio(ours["cached_token_ratio"], theirs["cached_token_ratio"])
        ratios[f"ttft_mean_speedup_vs_{peer}"] = _ratio(theirs["ttft_mean_s"], ours["ttft_mean_s"])
        ratios[f"ttft_p99_speedup_vs_{peer}"] = _ratio(theirs["ttft_p99_s"], ours["ttft_p99_s"])
        ratios[f"throughput_vs_{peer}"] = _ratio(ours["requests_per_s"], theirs["requests_per_s"])
    return {
        "cpu_count": os.cpu_count(),
        "workload": {**vars(w), "replicas": replicas, "model": str(model_path),
                     "router_kwargs": router_kwargs},
        "results": results,
        "rounds": rounds,
        "ratios": ratios,
    }


def _mean_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each numeric figure averaged over the rounds (counts summed); the last round's errors."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        values = [run[key] for run in runs]
        if key in ("requests", "failures"):
            out[key] = sum(values)
        elif isinstance(value, dict):
            out[key] = {k: sum(v.get(k, 0) for v in values) for k in sorted({k for v in values for k in v})}
        elif isinstance(value, int | float) and all(v is not None for v in values):
            out[key] = statistics.fmean(values)
        else:
            out[key] = values[-1]
    out["rounds"] = len(runs)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
