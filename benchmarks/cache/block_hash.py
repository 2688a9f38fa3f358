"""How long the ingress spends hashing a prompt: `block_hashes` over 100k tokens, CPU.

The ingress hashes every prompt before routing it (`cachestore/block_hash.py`: a chained 64-bit
blake2b per page), so this is latency every request pays. Per page size: the best of `REPEATS`
runs over 100,000 random token ids, and, measured in the same run, one unchained blake2b over the
same packed bytes: the floor any per-byte hash has to pay. The ratio says what the chaining and the
per-block calls cost above that floor.

    python -m benchmarks run cache --only block_hash [--smoke]
"""

from __future__ import annotations

import random
import time
from array import array
from collections.abc import Callable
from hashlib import blake2b
from typing import Any

from ..lib.context import Context

DEVICE = "cpu"

NUM_TOKENS = 100_000
PAGE_SIZES = (16, 128, 256)
REPEATS = 20


def _best_s(fn: Callable[[], object], repeats: int) -> float:
    # The best of several runs: the machine is shared, and the minimum is the least disturbed.
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def run(ctx: Context) -> dict[str, Any]:
    repeats = 2 if ctx.smoke else REPEATS
    from antumbra.cachestore.block_hash import block_hashes

    rng = random.Random(0)
    tokens = [rng.randrange(200_000) for _ in range(NUM_TOKENS)]
    floor_s = _best_s(lambda: blake2b(array("q", tokens).tobytes(), digest_size=8).digest(), repeats)
    cases = []
    for page_size in PAGE_SIZES:
        hashes = block_hashes(tokens, page_size, "tiny:tenant-a")
        seconds = _best_s(lambda p=page_size: block_hashes(tokens, p, "tiny:tenant-a"), repeats)
        cases.append({
            "page_size": page_size,
            "blocks": len(hashes),
            "ms": seconds * 1e3,
            "tokens_per_s": NUM_TOKENS / seconds,
            "vs_one_blake2b_pass": seconds / floor_s,
        })
    return {
        "num_tokens": NUM_TOKENS,
        "repeats": repeats,
        "one_blake2b_pass_ms": floor_s * 1e3,
        "cases": cases,
        "ratios": {f"block_hashes_vs_one_blake2b_pass_p{c['page_size']}": c["vs_one_blake2b_pass"]
                   for c in cases},
    }
