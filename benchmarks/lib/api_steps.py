"""A decode step as a user of the public API sees it: the difference of two `generate` calls of
1 and 1 + N tokens over cached prompts, divided by N (start-up and prefill excluded)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from .timing import sync


def timed_generate(engine: Any, prompts: list[list[int]], params: Any,
                   device: str) -> tuple[float, list[Any]]:
    """(seconds, outputs) of one `engine.generate`, the device drained before and after."""
    sync(device)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    sync(device)
    return time.perf_counter() - start, outs


def api_decode_step_ms(engine: Any, prompts: list[list[int]], new_tokens: int, reps: int,
                       device: str) -> dict[str, Any]:
    """Median ms per decode step over `reps` pairs of greedy runs, and the tokens the last long run
    generated (one list per prompt: the prefill's token, then one per timed step)."""
    from antumbra import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    many = SamplingParams(max_tokens=1 + new_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, one)  # computes and caches the prompts
    engine.generate(prompts, many)  # warms every graph size the batch passes through
    steps = []
    outs: list[Any] = []
    for _ in range(reps):
        short_s, _ = timed_generate(engine, prompts, one, device)
        long_s, outs = timed_generate(engine, prompts, many, device)
        steps.append((long_s - short_s) * 1e3 / new_tokens)
    return {"step_ms": statistics.median(steps), "step_ms_all": steps, "new_tokens": new_tokens,
            "token_ids": [list(o.token_ids) for o in outs]}
