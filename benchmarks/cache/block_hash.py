"""How long the ingress spends hashing a prompt: `block_hashes` over 100k tokens, CPU.

The ingress hashes every prompt before routing it (`cachestore/block_hash.py`: a chained 64-bit
blake2b per page), so this is latency every request pays. Per page size: the best of `REPEATS`
runs over 100,000 random token ids, and, measured in the same run, one unchained blake2b over the
same packed bytes: the floor any per-byte hash has to pay. The ratio says what the chaining and the
per-block calls cost above that floor.

    python -m benchmarks.block_hash_cpu
"""

from __future__ import annotations

import random
import time
from array import array
from collections.abc import Callable
from hashlib import blake2b
from typing import Any

from .common import environment, write_result

NUM_TOKENS = 100_000
PAGE_SIZES = (16, 128, 256)
REPEATS = 20


def _best_s(fn: Callable[[], object]) -> float:
    # The best of several runs: the machine is shared, and the minimum is the least disturbed.
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def run() -> dict[str, Any]:
    from antumbra.cachestore.block_hash import block_hashes

    rng = random.Random(0)
    tokens = [rng.randrange(200_000) for _ in range(NUM_TOKENS)]
    floor_s = _best_s(lambda: blake2b(array("q", tokens).tobytes(), digest_size=8).digest())
    cases = []
    for page_size in PAGE_SIZES:
        hashes = block_hashes(tokens, page_size, "tiny:tenant-a")
        seconds = _best_s(lambda p=page_size: block_hashes(tokens, p, "tiny:tenant-a"))
        cases.append({
            "page_size": page_size,
            "blocks": len(hashes),
            "ms": seconds * 1e3,
            "tokens_per_s": NUM_TOKENS / seconds,
            "vs_one_blake2b_pass": seconds / floor_s,
        })
    return {
        "benchmark": "block_hash_cpu",
        **environment(),
        "num_tokens": NUM_TOKENS,
        "repeats": REPEATS,
        "one_blake2b_pass_ms": floor_s * 1e3,
        "cases": cases,
        "ratios": {f"block_hashes_vs_one_blake2b_pass_p{c['page_size']}": c["vs_one_blake2b_pass"]
                   for c in cases},
    }


def main() -> None:
    result = run()
    for case in result["cases"]:
        print(f"page {case['page_size']:4d}: {case['ms']:7.2f} ms for {NUM_TOKENS} tokens "
              f"({case['vs_one_blake2b_pass']:.1f}x one blake2b pass)")
    print(write_result("cpu-block-hash", result))


if __name__ == "__main__":
    main()
