"""SIGKILL of a model replica's process while two tenants keep the app busy.

Asserted: no non-streaming request fails (the ingress starts them over on the other replica,
whatever they had generated), and each one started over answers the text the same greedy request
gives undisturbed afterwards; every stream the dead replica was serving ends with an SSE error event
(an OpenAI error object, not a broken connection) within 5 s of the kill, and every other stream
keeps streaming; Serve brings the replica back; the dead replica's entries leave the prefix
directory.

The 5 s is the behaviour under test: a client must learn that its stream is dead, not wait on it
(the ingress notices the dead replica at once; 5 s leaves room for a loaded machine).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from typing import Any

import redis

from tests.faults.app import MODEL, FaultApp
from tests.faults.load import Outcome, SteadyLoad, request, sentence, summary
from tests.waiting import wait_until

ERROR_EVENT_BOUND_S = 5.0
LONG_TOKENS = 3000  # long enough that no long stream can finish during the test
LONG_PLAIN_TOKENS = 300  # running when the replica dies, then again from the start on another one
LONG_STREAMS = LONG_PLAIN = 2


def directory_entries(app: FaultApp, replica_id: str) -> tuple[int, int]:
    """(members of the replica's own entry set, block keys that still list it) in Redis."""
    client = redis.Redis.from_url(app.redis.url)
    try:
        prefix = f"{app.key_prefix}:blk:{MODEL}:"
        own = client.scard(f"{app.key_prefix}:rblk:{MODEL}:{replica_id}")
        listed = 0
        for key in client.scan_iter(f"{prefix}*", count=1000):
            listed += any(m.decode().startswith(f"{replica_id}|") for m in client.smembers(key))
        return int(own), listed
    finally:
        client.close()


async def prime_both_replicas(app: FaultApp, rng: random.Random) -> None:
    """Prompts of two full pages, sent together so that both replicas cache some."""
    client = app.client("alpha")
    try:
        prompts = [f"prime {i}: " + sentence(rng, 300) for i in range(8)]
        outs = await asyncio.gather(*(request(client, "alpha", p, 2, stream=False) for p in prompts))
    finally:
        await client.close()
    assert all(o.ok for o in outs), summary(outs)


def test_sigkill_of_a_replica_under_load(app: FaultApp) -> None:
    rng = random.Random(14)
    asyncio.run(prime_both_replicas(app, rng))
    before = {s["replica_id"]: s for s in app.replicas()}
    for rid in before:  # both replicas hold blocks in the directory (the publisher is quick)
        wait_until(lambda r=rid: directory_entries(app, r)[0] > 0, 10, f"{rid}'s directory entries")
    result = asyncio.run(_kill_under_load(app, rng))
    killed, killed_at, on_victim = result["killed"], result["killed_at"], set(result["victim_ids"])
    steady: list[Outcome] = result["steady"]
    long_streams: list[Outcome] = result["long_streams"]
    long_plain: list[Outcome] = result["long_plain"]

    # Non-streaming: none failed; those the dead replica was running started over on the other one.
    plain = [o for o in steady + long_plain if not o.stream]
    assert plain and not [o for o in plain if o.failed], summary(plain)
    restarted = [o for o in plain if o.id in on_victim and o.ended > killed_at]
    assert restarted and all(o.retries >= 1 for o in restarted), [(o.id, o.retries) for o in restarted]
    # Streams: each one that failed was running at the kill and ended with an error event within 5 s.
    failed_streams = [o for o in steady + long_streams if o.stream and o.failed]
    late = [
        round(o.ended - killed_at, 2) for o in failed_streams if o.ended - killed_at > ERROR_EVENT_BOUND_S
    ]
    assert not late, f"streams ended {late} s after the kill"
    assert all(o.error_event and o.started < killed_at for o in failed_streams), summary(failed_streams)
    # Every long stream on the dead replica ended so; every other one kept streaming past the bound
    # (the test cut those off at its end).
    assert {o.id for o in long_streams if o.failed} == {o.id for o in long_streams if o.id in on_victim}
    assert any(o.id in on_victim for o in long_streams)
    survivors = [o for o in long_streams if o.id not in on_victim]
    assert all(o.disconnected and o.ended - killed_at > ERROR_EVENT_BOUND_S for o in survivors)
    # Serve replaced the replica; the dead one's entries are gone from the directory.
    wait_until(lambda: app.running_replicas() == {"RUNNING": 2}, 120, "a replacement replica", poll_s=0.5)
    # Serve counts the replacement RUNNING a moment before the ingress's handle routes to it.
    wait_until(lambda: len(app.replicas()) == 2, 60, "the replacement answering", poll_s=0.5)
    after = {s["replica_id"] for s in app.replicas()}
    assert killed not in after and len(after) == 2
    wait_until(
        lambda: directory_entries(app, killed) == (0, 0), 15, "the dead replica's directory entries gone"
    )
    # A restarted greedy request answers what it answers undisturbed (the replicas idle now).
    again = asyncio.run(_undisturbed(app, restarted))
    assert [o.text for o in restarted] == [o.text for o in again], [
        (o.id, o.text, a.text) for o, a in zip(restarted, again, strict=True) if o.text != a.text]
    print(f"\nreplica kill: {len(plain)} plain requests, 0 failed, {len(restarted)} started over; "
          f"{len(failed_streams)} streams ended with an error event "
          f"{sorted(round(o.ended - killed_at, 2) for o in failed_streams)} s after the kill; "
          f"replacement RUNNING after {result['replaced_s']:.1f} s")


async def _undisturbed(app: FaultApp, outcomes: list[Outcome]) -> list[Outcome]:
    """Each request of `outcomes` sent again, one at a time, on the idle app."""
    again = []
    for o in outcomes:
        client = app.client(o.tenant)
        try:
            assert o.prompt is not None
            again.append(await request(client, o.tenant, o.prompt, o.tokens, stream=False))
        finally:
            await client.close()
    assert all(a.ok for a in again), summary(again)
    return again


async def _kill_under_load(app: FaultApp, rng: random.Random) -> dict[str, Any]:
    stop = asyncio.Event()
    streams: set[str] = set()  # ids of every stream once its first token is in (the rest are plain)
    # Plain requests long enough that one the victim holds is still running when the kill lands
    # (the replicas' state is read, then the kill sent: a request may end in between).
    load = SteadyLoad(app, workers=2, max_tokens=48, stream_every=2, seed=1,
                      on_token=lambda o: streams.add(str(o.id)))
    steady_task = asyncio.create_task(load.run(stop))
    clients = {t: app.client(t) for t in ("alpha", "beta")}
    cut = asyncio.Event()
    started: dict[str, Outcome] = {}  # long streams by id, once their first token is in

    async def long_stream(i: int, tenant: str) -> Outcome:
        prompt = f"long stream {i} {tenant}: " + sentence(rng, 30)
        return await request(clients[tenant], tenant, prompt, LONG_TOKENS, stream=True, cut=cut,
                             on_token=lambda o: started.setdefault(str(o.id), o))

    async def long_plain(i: int, tenant: str) -> Outcome:
        prompt = f"long plain {i} {tenant}: " + sentence(rng, 30)
        return await request(clients[tenant], tenant, prompt, LONG_PLAIN_TOKENS, stream=False)

    # 4 steady + 2 long streams + 2 long plain requests: the surviving replica's 8 slots hold all of
    # them, so no request is refused for capacity while one replica is gone.
    tenants = ("alpha", "beta")
    stream_tasks = [asyncio.create_task(long_stream(i, tenants[i % 2])) for i in range(LONG_STREAMS)]
    plain_tasks = [asyncio.create_task(long_plain(i, tenants[i % 2])) for i in range(LONG_PLAIN)]
    replaced_s = float("nan")
    try:
        # The victim: a replica running a long stream and a plain request (of the steady load or long),
        # of two such the one running more plain requests.
        def pick() -> dict[str, Any] | None:
            if len(started) < LONG_STREAMS:
                return None
            candidates = []
            for state in app.replicas():
                ids = set(state["request_ids"])
                plain_ids = ids - set(started) - streams
                if ids & set(started) and plain_ids:
                    candidates.append((len(plain_ids), state))
            return max(candidates, key=lambda c: c[0])[1] if candidates else None

        victim = None
        deadline = time.monotonic() + 60
        while victim is None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            victim = await asyncio.to_thread(pick)
        assert victim is not None, "the load never reached both replicas"
        killed_at = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        await asyncio.sleep(ERROR_EVENT_BOUND_S + 2)  # load continues on the survivor meanwhile
        await asyncio.to_thread(
            wait_until, lambda: app.running_replicas() == {"RUNNING": 2}, 120, "the replacement", 0.5
        )
        replaced_s = time.monotonic() - killed_at
        await asyncio.sleep(1.0)  # load on the new replica too
    finally:
        stop.set()
        cut.set()
        long_streams = await asyncio.gather(*stream_tasks)
        long_plains = await asyncio.gather(*plain_tasks)
        steady = await steady_task
        for c in clients.values():
            await c.close()
    return {
        "killed": victim["replica_id"],
        "killed_at": killed_at,
        "victim_ids": victim["request_ids"],
        "steady": steady,
        "long_streams": long_streams,
        "long_plain": long_plains,
        "replaced_s": replaced_s,
    }
