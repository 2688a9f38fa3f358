"""How long an ingress holds a stream's chunk for its usage entry, on the CPU, against a real Redis.

    python -m benchmarks.host_usage_cpu [--streams 8] [--tokens 400] [--token-ms 5]

`--streams` streams each send `--tokens` one-token chunks, one every `--token-ms` (a decode step's
pace at concurrency 32 on the GPU), through the ingress's open usage entries
(`antumbra/platform/ingress/usage_open.py`) on a `redis-server` started here. Measured per chunk:
the time `before_send` holds it (a stream more than `MAX_UNWRITTEN_TOKENS` ahead of its written
entry waits for a write), with the writer hurried (the product: a stream past half its bound makes
the next round due `HURRY_INTERVAL_S` after the last) and without (rounds every `WRITE_INTERVAL_S`
or when a stream waits). Writes benchmarks/results/host-usage.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from .lib.records import RESULTS_DIR, provenance
from .lib.timing import percentile

HELD_MS = 0.1  # a chunk held longer than this waited on a write


@dataclass
class _Builder:
    """What a usage record reads of a response builder."""

    prompt_tokens: int = 1024


async def _streams(redis_url: str, streams: int, tokens: int, token_s: float, hurry: bool) -> dict[str, Any]:
    from antumbra.platform.ingress.usage import UsageKeys, UsageRecord
    from antumbra.platform.ingress.usage_open import (
        HURRY_INTERVAL_S,
        WRITE_INTERVAL_S,
        OpenEntries,
        RequestUsage,
    )
    from antumbra.platform.redis_client import redis_client

    client = redis_client(redis_url, timeout_s=0.5)
    # Not hurried: a hurry makes the next round due no sooner than the interval would.
    hurry_s = HURRY_INTERVAL_S if hurry else WRITE_INTERVAL_S
    entries = OpenEntries(client, UsageKeys("bench"), hurry_interval_s=hurry_s)
    held_s: list[float] = []

    async def one(index: int) -> None:
        def record(acc: _Builder, completion_tokens: int) -> UsageRecord:
            return UsageRecord(f"s{index}", "t", "m", time.time(), acc.prompt_tokens, 0, completion_tokens)

        usage, acc = RequestUsage(entries, lambda rec: None, record), _Builder()
        await usage.open(acc)
        for sent in range(tokens):
            await asyncio.sleep(token_s)
            start = time.perf_counter()
            await usage.before_send(sent, 1)
            held_s.append(time.perf_counter() - start)
            usage.sent(acc, sent + 1)
        usage.finish(acc, tokens)

    try:
        await asyncio.gather(*(one(i) for i in range(streams)))
    finally:
        await entries.close()
        await client.aclose()
    held_ms = [s * 1e3 for s in held_s]
    return {"chunks": len(held_ms), "chunks_held": sum(1 for h in held_ms if h > HELD_MS),
            "held_p50_ms": percentile(held_ms, 0.5), "held_p99_ms": percentile(held_ms, 0.99),
            "held_max_ms": max(held_ms), "write_rounds": entries.rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--token-ms", type=float, default=5.0)
    args = parser.parse_args()
    from antumbra.platform.launch.redis_server import LocalRedis

    with LocalRedis() as server:
        runs = {name: asyncio.run(_streams(server.url, args.streams, args.tokens, args.token_ms / 1e3, hurry))
                for name, hurry in (("not_hurried", False), ("hurried", True))}
    result = {**provenance("cpu"), "streams": args.streams, "tokens": args.tokens, "token_ms": args.token_ms,
              **runs}
    out = RESULTS_DIR / "host-usage.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(runs))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
