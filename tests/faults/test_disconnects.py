"""Clients that go away mid-stream, at random, while two tenants keep the app busy.

Asserted: within 2 s of the last disconnect (and of the last steady request's end) every engine
is idle and holds nothing beyond its prefix cache (no request's pages, no locked cache page, no
HiSparse buffer; `engine_stats` via the admin API), and its invariants hold (`check_integrity()`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from typing import Any

from tests.faults.app import HELD, FaultApp, idle
from tests.faults.load import Outcome, SteadyLoad, request, sentence, summary

RELEASE_BOUND_S = 2.0
STREAMS = 10
PLAIN = 3  # with the steady load, within the 2 x 8 requests the replicas take


def test_random_disconnects_release_everything(app: FaultApp) -> None:
    result = asyncio.run(_storm(app, random.Random(2)))
    storm: list[Outcome] = result["storm"]
    assert sum(o.disconnected for o in storm) == STREAMS + PLAIN, summary(storm)
    assert result["peak_running"] >= 5, result["peak_running"]  # the storm did reach the engines
    assert result["peak_locked"] >= 1, "no request shared a cached prefix"
    assert not [o for o in result["steady"] if o.failed], summary(result["steady"])
    released = result["released_at"] - result["reference"]
    assert released <= RELEASE_BOUND_S, f"released {released:.2f} s after the last disconnect"
    states = app.replicas(check_integrity=True)
    assert all(s["integrity"] is None for s in states), [s["integrity"] for s in states]
    assert all(idle(s["stats"]) for s in states), [{k: s["stats"][k] for k in HELD} for s in states]
    print(f"\ndisconnects: {STREAMS} streams and {PLAIN} plain requests abandoned "
          f"(peak {result['peak_running']} running, {result['peak_locked']} locked cache pages); "
          f"everything released {released:.2f} s after the last disconnect or steady request "
          f"({result['after_last_disconnect']:.2f} s after the last disconnect); "
          f"pool use {result['pool_use']}")


async def _storm(app: FaultApp, rng: random.Random) -> dict[str, Any]:
    tenants = ("alpha", "beta")
    clients = {t: app.client(t) for t in tenants}
    shared = {t: f"{t} shared instructions: " + sentence(rng, 360) for t in tenants}  # two pages
    for t in tenants:  # cached, so that storm requests lock cache pages while they run
        assert (await request(clients[t], t, shared[t], 1, stream=False)).ok
    stop = asyncio.Event()
    steady_task = asyncio.create_task(SteadyLoad(app, workers=1, max_tokens=8, seed=5).run(stop))
    last_disconnect = 0.0
    peak = {"running": 0, "locked": 0}
    watching = True
    not_started = STREAMS + PLAIN

    def started() -> None:  # the steady load stops once the storm is all out, so it ends first
        nonlocal not_started
        not_started -= 1
        if not not_started:
            stop.set()

    async def watch() -> None:
        while watching:
            states = await asyncio.to_thread(app.replicas)
            peak["running"] = max(peak["running"], sum(int(s["stats"]["num_running"]) for s in states))
            peak["locked"] = max(peak["locked"], sum(int(s["stats"]["locked_cache_pages"]) for s in states))
            await asyncio.sleep(0.2)

    async def stream(i: int) -> Outcome:
        nonlocal last_disconnect
        t = tenants[i % 2]
        await asyncio.sleep(rng.uniform(0, 2.0))
        prompt = (shared[t] if i % 3 else "") + f" stream {i}: " + sentence(rng, 8)
        started()
        out = await request(clients[t], t, prompt, 2000, stream=True, disconnect_after=rng.randint(0, 40))
        last_disconnect = max(last_disconnect, time.monotonic())
        return out

    async def plain(i: int) -> Outcome:
        nonlocal last_disconnect
        t = tenants[i % 2]
        await asyncio.sleep(rng.uniform(0, 1.0))
        out = Outcome(t, False, time.monotonic(), disconnected=True)
        started()
        # The client gives up (a timeout): its connection closes with the cancelled call.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(request(clients[t], t, shared[t] + f" plain {i}", 2000, stream=False),
                                   rng.uniform(0.5, 2.5))
            out.disconnected = False
        last_disconnect = max(last_disconnect, time.monotonic())
        out.ended = time.monotonic()
        return out

    watcher = asyncio.create_task(watch())
    try:
        storm = await asyncio.gather(*(stream(i) for i in range(STREAMS)), *(plain(i) for i in range(PLAIN)))
    finally:
        watching = False
        stop.set()
        steady = await steady_task
        await watcher
    steady_done = max(o.ended for o in steady)
    reference = max(last_disconnect, steady_done)
    while True:  # poll until every engine is idle and holds nothing (the test's timeout bounds it)
        states = await asyncio.to_thread(app.replicas)
        if all(idle(s["stats"]) for s in states):
            released_at = time.monotonic()
            break
        if time.monotonic() - reference > 30:
            held = [{k: s["stats"][k] for k in HELD} for s in states]
            raise AssertionError(f"not released after 30 s: {held}")
        await asyncio.sleep(0.05)
    for c in clients.values():
        await c.close()
    return {"storm": storm, "steady": steady, "reference": reference, "released_at": released_at,
            "after_last_disconnect": released_at - last_disconnect,
            "peak_running": peak["running"], "peak_locked": peak["locked"],
            "pool_use": [round(s["stats"]["pool_use_virtual"], 4) for s in states]}
