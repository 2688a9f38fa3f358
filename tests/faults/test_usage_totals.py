"""Usage totals per tenant equal what the clients received, across a SIGKILL of a model replica
under load: no token lost, none counted twice.

Two tenants with different request shapes keep both replicas busy (closed-loop workers; alpha
sends long prompts for short answers, half of them streamed, beta short prompts for long streams);
a replica running a stream and a plain request is killed mid-load. Every request ends by itself
(finished; a plain one started over on the other replica; a stream ended by an error event): a
client that closes a stream early cannot know how many tokens were already on their way, so none
does here. Afterwards, per tenant, what `GET /admin/usage`
added equals what the clients counted (`usage_count.py`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

from tests.faults.app import FaultApp
from tests.faults.load import Outcome, SteadyLoad, summary
from tests.faults.usage_count import client_counts, grown, metered, prompt_sizes
from tests.waiting import wait_until

TENANTS = ("alpha", "beta")
ALPHA_TOKENS, BETA_TOKENS = 48, 160
AFTER_KILL_S = 4.0  # load on the survivor before the workers stop


def test_usage_totals_equal_what_clients_received_across_a_replica_kill(app: FaultApp) -> None:
    before = {t: metered(app, t) for t in TENANTS}
    outcomes = asyncio.run(_kill_under_load(app))
    cut = [o for o in outcomes if o.stream and o.error_event]
    assert cut, f"no stream was running on the killed replica: {summary(outcomes)}"
    assert not [o for o in outcomes if o.failed and not (o.stream and o.error_event)], summary(outcomes)
    restarted = [o for o in outcomes if not o.stream and o.retries]
    assert restarted, f"no plain request was started over: {summary(outcomes)}"
    assert all(o.tokens == (ALPHA_TOKENS if o.tenant == "alpha" else BETA_TOKENS) for o in outcomes if o.ok)
    sizes = asyncio.run(prompt_sizes(app, outcomes))
    for tenant in TENANTS:
        mine = [o for o in outcomes if o.tenant == tenant]
        expected = client_counts(mine, sizes)
        wait_until(lambda t=tenant, e=expected: grown(app, t, before[t])["requests"] >= e["requests"], 30,
                   f"{tenant}'s usage written")
        assert grown(app, tenant, before[tenant]) == expected, (tenant, summary(mine))
    chunky = sum(o.tokens > o.chunks for o in outcomes if o.stream)
    print(f"\nusage across a replica kill: {len(outcomes)} requests, {len(cut)} streams cut by the kill, "
          f"{len(restarted)} plain ones started over, {chunky} streams with a chunk of several tokens; "
          "totals equal per tenant")


async def _kill_under_load(app: FaultApp) -> list[Outcome]:
    streams: set[str] = set()  # ids of streams once their first token is in
    loads = [
        SteadyLoad(app, tenants=("alpha",), workers=2, max_tokens=ALPHA_TOKENS, prompt_words=60,
                   stream_every=2, seed=3, logprobs=True, on_token=lambda o: streams.add(str(o.id))),
        SteadyLoad(app, tenants=("beta",), workers=2, max_tokens=BETA_TOKENS, prompt_words=6,
                   stream_every=1, seed=4, logprobs=True, on_token=lambda o: streams.add(str(o.id))),
    ]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(load.run(stop)) for load in loads]
    try:
        victim = None
        deadline = time.monotonic() + 60
        while victim is None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            states = await asyncio.to_thread(app.replicas)
            # A stream under way, and a request that is not a known stream: a plain one, mostly.
            both = [s for s in states if set(s["request_ids"]) & streams and set(s["request_ids"]) - streams]
            victim = both[0] if both else None
        assert victim is not None, "no replica ever ran a stream and a plain request together"
        os.kill(victim["pid"], signal.SIGKILL)
        await asyncio.sleep(AFTER_KILL_S)
    finally:
        stop.set()
        results = await asyncio.gather(*tasks)
    return [o for outcomes in results for o in outcomes]
