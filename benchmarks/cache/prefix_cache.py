"""Prefix caching on the tiny model, fp32 on this CPU.

1. Shared-prefix workload (system prompts of 500-3000 tokens, several users each,
   two turns per user), served one request at a time: time to first token with
   the cache against without, and the hit rate (cached / prompt tokens).
2. The same workload with the SWA pool squeezed (tails get evicted): hit rate with
   SWA replay against without.

    python -m benchmarks run cache --only prefix_cache [--smoke]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from antumbra import Engine, SamplingParams
from antumbra.config import CacheConfig, SchedulerConfig
from antumbra.replicas.model.tiny import TinyModelSpec, make_tiny_checkpoint

from ..lib.context import Context

DEVICE = "cpu"

SYSTEM_LENGTHS = (500, 1000, 2000, 3000)
USERS_PER_SYSTEM = 3
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 261, (n,), generator=g).tolist()


def ttft_and_output(engine: Engine, prompt: list[int]) -> tuple[float, list[int]]:
    start = time.perf_counter()
    rid = engine.core.add_request(prompt, PARAMS)
    ttft = None
    while True:
        for out in engine.core.step():
            if out.request_id != rid:
                continue
            if ttft is None and out.new_token_ids:
                ttft = time.perf_counter() - start
            if out.finished:
                assert ttft is not None
                return ttft, out.token_ids


def run_workload(engine: Engine, lengths: tuple[int, ...], users: int) -> dict[str, float]:
    ttfts = []
    for s, length in enumerate(lengths):
        system = tokens(length, seed=10 + s)
        for user in range(users):
            first = system + tokens(60, seed=100 * s + user)
            ttft, output = ttft_and_output(engine, first)
            ttfts.append(ttft)
            ttft, _ = ttft_and_output(engine, first + output + tokens(40, seed=1000 + 100 * s + user))
            ttfts.append(ttft)
    stats = engine.stats()
    return {
        "requests": len(ttfts),
        "ttft_mean_s": statistics.mean(ttfts),
        "ttft_p50_s": statistics.median(ttfts),
        "hit_rate": stats["hit_rate"],
        "cached_tokens": stats["cached_tokens"],
        "prompt_tokens": stats["prompt_tokens"],
        "replays": stats["replays"],
        "replayed_tokens": stats["replayed_tokens"],
        "swa_evictions": stats["swa_evictions"],
    }


def run(ctx: Context) -> dict[str, Any]:
    """Options: threads (torch intra-op threads)."""
    torch.set_num_threads(ctx.option("threads", 1))
    lengths, users = ((500, 1000), 1) if ctx.smoke else (SYSTEM_LENGTHS, USERS_PER_SYSTEM)
    squeezed = CacheConfig(num_swa_pages=8)
    sched = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=512)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "model", TinyModelSpec())

        def workload(cache: CacheConfig, scheduler: SchedulerConfig | None = None) -> dict[str, float]:
            engine = Engine.from_pretrained(path, device="cpu", dtype="float32", cache=cache,
                                            scheduler=scheduler)
            return run_workload(engine, lengths, users)

        cached = workload(CacheConfig())
        uncached = workload(CacheConfig(enable_prefix_caching=False))
        replay = workload(squeezed, sched)
        no_replay = workload(CacheConfig(num_swa_pages=8, enable_swa_replay=False), sched)
    return {
        "workload": {"system_lengths": lengths, "users_per_system": users, "turns": 2},
        "cache_on": cached,
        "cache_off": uncached,
        "swa_pressure_replay_on": replay,
        "swa_pressure_replay_off": no_replay,
        "ratios": {
            "ttft_mean_off_over_on": uncached["ttft_mean_s"] / cached["ttft_mean_s"],
            "hit_rate_cache_on": cached["hit_rate"],
            "hit_rate_swa_pressure_replay_on": replay["hit_rate"],
            "hit_rate_swa_pressure_replay_off": no_replay["hit_rate"],
        },
    }
