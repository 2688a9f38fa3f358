"""Redis SIGKILLed for 10 s and started again, while two tenants keep the app busy.

Asserted: zero failed requests, during the outage and after it; rate limits fail open while Redis
is down, as documented (`antumbra/platform/ingress/admission.py`: a tenant over its limit is
served, unlimited) and are enforced again once it is back; the prefix directory is current again
within 30 s of the restart (the replicas' publishers re-send their caches) and cache-affinity
routing is back: every cached prefix is routed to the replica that holds it.

Redis persists as `infra/redis.conf` does (append-only file), so tenants and keys survive the
restart; with nothing persisted every key would be unknown afterwards (that case is
`tests/platform/launch/test_app.py::test_redis_outage_degrades_auth_and_limits`).
"""

from __future__ import annotations

import asyncio
import random
import time
from functools import partial
from typing import Any

import httpx

from tests.faults.app import CAPPED_RPM, FaultApp
from tests.faults.load import Outcome, SteadyLoad, request, sentence, summary
from tests.waiting import wait_until

OUTAGE_S = 10.0
AFFINITY_BOUND_S = 30.0
PRIMED = 6  # prefixes of 6 pages each, cached before the outage


def test_redis_killed_for_10_s_and_restarted(app: FaultApp) -> None:
    rng = random.Random(10)
    prompts = [f"system prompt {i}: " + sentence(rng, 840) for i in range(PRIMED)]
    asyncio.run(_send_all(app, "alpha", prompts))
    for p in prompts:
        wait_until(lambda p=p: _listed(app, p), 10, "the primed prefixes in the directory")
    result = asyncio.run(_outage_under_load(app, prompts))
    steady: list[Outcome] = result["steady"]
    killed_at, back_at = result["killed_at"], result["back_at"]

    during = [o for o in steady if killed_at < o.started and o.ended < back_at]
    assert len(during) >= 8, f"only {len(during)} requests ran during the outage"
    assert not [o for o in steady if o.failed], summary(steady)
    assert result["health_during"] == "degraded"
    # Fail open while Redis is down: the capped tenant, over its limit before, is served unlimited.
    assert result["capped_before"].count(429) >= 1, result["capped_before"]
    assert result["capped_during"] == [200] * len(result["capped_during"]) and len(
        result["capped_during"]) > CAPPED_RPM, result["capped_during"]
    assert 429 in result["capped_after"], result["capped_after"]  # enforced again
    # Affinity: the directory lists the cached prefixes again, and requests reach their replica.
    assert result["relisted_s"] <= AFFINITY_BOUND_S
    probes: list[Outcome] = result["probes"]
    assert all(o.ok and o.cached_tokens >= 5 * 128 for o in probes), [(o.ok, o.cached_tokens) for o in probes]
    print(f"\nredis outage: {len(steady)} requests ({len(during)} during the outage), 0 failed; "
          f"capped tenant {result['capped_during'].count(200)}/{len(result['capped_during'])} served "
          f"while down, "
          f"429 again after; directory current {result['relisted_s']:.1f} s after the restart; "
          f"{len(probes)}/{len(probes)} primed prefixes hit")


def _listed(app: FaultApp, prompt: str) -> bool:
    matched, blocks = app.directory_matches("alpha", prompt)
    return blocks >= 6 and max(matched.values(), default=0) == blocks


async def _send_all(app: FaultApp, tenant: str, prompts: list[str], max_tokens: int = 2) -> list[Outcome]:
    client = app.client(tenant)
    try:
        outs = await asyncio.gather(*(request(client, tenant, p, max_tokens, stream=False) for p in prompts))
    finally:
        await client.close()
    assert all(o.ok for o in outs), summary(outs)
    return list(outs)


async def _capped_statuses(app: FaultApp, count: int, pause_s: float = 0.0) -> list[int]:
    client = app.client("capped")
    statuses = []
    try:
        for i in range(count):
            out = await request(client, "capped", f"capped {i}", 1, stream=False)
            statuses.append(200 if out.ok else (out.status or 0))
            await asyncio.sleep(pause_s)
    finally:
        await client.close()
    return statuses


async def _outage_under_load(app: FaultApp, prompts: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"capped_before": await _capped_statuses(app, CAPPED_RPM + 2)}
    stop = asyncio.Event()
    # Prompts of a page or more, as system prompts are: every request asks the directory, so the
    # router's circuit breaker sees Redis answer again soon after the restart.
    load = SteadyLoad(app, workers=2, max_tokens=12, prompt_words=30, stream_every=2, seed=3)
    steady_task = asyncio.create_task(load.run(stop))
    try:
        await asyncio.sleep(2.0)
        await asyncio.to_thread(app.redis.kill)
        out["killed_at"] = killed_at = time.monotonic()
        await asyncio.sleep(1.0)
        async with httpx.AsyncClient() as http:
            out["health_during"] = (await http.get(f"{app.url}/health", timeout=5)).json()["status"]
        out["capped_during"] = await _capped_statuses(app, CAPPED_RPM + 4, pause_s=0.2)
        await asyncio.sleep(max(0.0, killed_at + OUTAGE_S - time.monotonic()))
        await asyncio.to_thread(app.redis.start)
        out["back_at"] = back_at = time.monotonic()
        await asyncio.sleep(1.0)
        out["capped_after"] = await _capped_statuses(app, 3, pause_s=0.2)
        for p in prompts:
            listed = partial(_listed, app, p)
            await asyncio.to_thread(wait_until, listed, AFFINITY_BOUND_S, "relisted", 0.2)
        out["relisted_s"] = time.monotonic() - back_at
        await asyncio.sleep(2.0)  # steady load on the recovered system
    finally:
        stop.set()
        out["steady"] = await steady_task
    # Affinity, measured one request at a time (the router weighs load against cached tokens):
    # each prefix plus a new question must land where the prefix is cached. The load is over first
    # in the engines and in the routing stats the router reads (polled each second), so no probe is
    # steered away from its replica by the steady load's last requests.
    await asyncio.to_thread(wait_until, app.settled, 30, "the replicas idle after the load", 0.5)
    await asyncio.sleep(2.0)
    out["probes"] = [(await _send_all(app, "alpha", [p + " and one more question?"]))[0] for p in prompts]
    return out
