"""Usage as the clients count it, against what `GET /admin/usage` says, per tenant.

The client side counts what the platform documents it meters (`ingress/generation.py`, `Finisher`):
a request a replica took counts once with its prompt; of its completion, all of it for an answer
that came whole (its `usage`), and for a stream that ended with an error event the tokens of the
chunks it received (each chunk names its tokens through `logprobs`; a chunk may carry several).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import httpx

from tests.faults.app import FaultApp
from tests.faults.load import Outcome, request, summary

COUNTS = ("requests", "prompt_tokens", "completion_tokens")
SIZER = "victim"  # the tenant that resends cut streams' prompts to learn their size


def metered(app: FaultApp, tenant: str) -> dict[str, int]:
    r = httpx.get(f"{app.url}/admin/usage", params={"tenant": tenant}, headers=app.admin(), timeout=30)
    assert r.status_code == 200, r.text
    sums = r.json()["totals"].get(tenant, {})
    return {k: int(sums.get(k, 0)) for k in COUNTS}


def grown(app: FaultApp, tenant: str, before: dict[str, int]) -> dict[str, int]:
    now = metered(app, tenant)
    return {k: now[k] - before[k] for k in COUNTS}


async def prompt_sizes(app: FaultApp, outcomes: Iterable[Outcome]) -> dict[int, int]:
    """Prompt tokens of each answered request whose client never saw usage (by `id()` of its
    outcome): the same prompt sent again by `SIZER`, for one token, reports its size."""
    unsized = [o for o in outcomes if o.answered and o.prompt_tokens is None]
    client = app.client(SIZER)
    try:
        again = await asyncio.gather(
            *(request(client, SIZER, o.prompt or "", 1, stream=False) for o in unsized)
        )
    finally:
        await client.close()
    assert all(a.ok and a.prompt_tokens is not None for a in again), summary(again)
    return {id(o): int(a.prompt_tokens or 0) for o, a in zip(unsized, again, strict=True)}


def client_counts(outcomes: Iterable[Outcome], sizes: dict[int, int]) -> dict[str, int]:
    """What the clients' outcomes add up to, in `GET /admin/usage`'s counters."""
    answered = [o for o in outcomes if o.answered]
    prompts = [o.prompt_tokens if o.prompt_tokens is not None else sizes[id(o)] for o in answered]
    return {
        "requests": len(answered),
        "prompt_tokens": sum(prompts),
        "completion_tokens": sum(o.tokens for o in answered),
    }
