"""A step that raises (injected by `injection.py`: a step holding a prompt with `FAULT_TOKEN`), while
two tenants keep the app busy: only the poisoned requests fail, each with a 500 naming the engine
error (never retried: the request itself is the problem), every other request completes, and the
engines count exactly the poisoned ones as failed and stay intact."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from tests.faults.app import FAULT_TOKEN, FaultApp, idle
from tests.faults.load import Outcome, SteadyLoad, request, summary

POISONED = 6


def _failed_count(app: FaultApp) -> float:
    return sum(s["stats"]["num_failed_requests"] for s in app.replicas())


def test_a_failing_step_fails_only_its_requests(app: FaultApp) -> None:
    before = _failed_count(app)
    result = asyncio.run(_poison_under_load(app, random.Random(6)))
    steady: list[Outcome] = result["steady"]
    poisoned: list[Outcome] = result["poisoned"]
    assert len(steady) >= 20 and not [o for o in steady if o.failed], summary(steady)
    assert all(o.status == 500 and o.code == "engine_error" and o.retries == 0 for o in poisoned), [
        (o.status, o.code, o.retries, o.error) for o in poisoned]
    assert all("injected fault" in (o.error or "") for o in poisoned)
    assert _failed_count(app) == before + POISONED
    states = app.replicas(check_integrity=True)
    assert all(s["integrity"] is None for s in states) and all(idle(s["stats"]) for s in states)
    print(f"\nfailing step: {POISONED} poisoned requests failed (500 engine_error), "
          f"{len(steady)} others all completed")


async def _poison_under_load(app: FaultApp, rng: random.Random) -> dict[str, Any]:
    stop = asyncio.Event()
    steady_task = asyncio.create_task(SteadyLoad(app, workers=2, max_tokens=16, seed=9).run(stop))
    clients = {t: app.client(t) for t in ("alpha", "beta")}
    try:
        await asyncio.sleep(1.5)

        async def poisoned(i: int) -> Outcome:
            t = ("alpha", "beta")[i % 2]
            await asyncio.sleep(rng.uniform(0, 1.5))
            prompt = [rng.randrange(40, 200) for _ in range(20)] + [FAULT_TOKEN] + [50] * rng.randint(0, 30)
            return await request(clients[t], t, prompt, 16, stream=bool(i % 2))

        outs = await asyncio.gather(*(poisoned(i) for i in range(POISONED)))
        await asyncio.sleep(1.5)
    finally:
        stop.set()
        steady = await steady_task
        for c in clients.values():
            await c.close()
    await asyncio.to_thread(_wait_settled, app)
    return {"steady": steady, "poisoned": outs}


def _wait_settled(app: FaultApp) -> None:
    from tests.waiting import wait_until

    wait_until(app.settled, 10, "the engines to settle", poll_s=0.1)
