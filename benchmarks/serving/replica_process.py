"""The replica's engine in its process or in a process of its own, on the CPU: the tiny model served
through the whole platform (`ModelSpec.engine_process`).

In the replica's process the engine's stepping thread shares one interpreter lock with the replica's
event loop, which streams every request through Ray Serve; in a process of its own it shares it only
with the threads that hand its outputs over. One run: for each setting, the platform (Ray Serve, a
local Redis, the ingress, one replica of the tiny checkpoint on the CPU) serves independent prompts at
each concurrency level, streamed over plain HTTP (`platform_vs_engine`'s load and clocks): inter-token
latency p50 / p99 and output tokens/s. The settings run in `rounds` passes, each pass in the reverse
order of the one before, so drift falls on both; a figure is the median over the passes. On a machine
of few cores the engine's own compute competes with Serve's processes for them, so this measures the
mechanism, not what a GPU replica gains (`platform_vs_engine --set engine_process=on` does).

    python -m benchmarks run platform --only replica_process [--smoke] [--set concurrency=16,32]
        [--set rounds=2] [--set new_tokens=64]
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..lib.context import Context
from .platform_vs_engine import Workload, platform_run
from .replica_gil import cpu_load, median_over, on_tiny_checkpoint, passes

DEVICE = "cpu"
SETTINGS = {"in_replica": False, "own_process": True}
KEYS = ("itl_p50_s", "itl_p99_s", "output_tokens_per_s", "ttft_p50_s")


def measure(model_dir: str, vocab: int, levels: list[int], rounds: int, work: Workload) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
    for order in passes(list(SETTINGS), rounds):
        for name in order:
            setting = dataclasses.replace(work, engine_process=SETTINGS[name])
            run = platform_run(model_dir, levels, vocab, setting)
            runs[name].append(run)
            print(name, {f"c{c}": run[f"c{c}"] for c in levels}, flush=True)
    table = {name: {f"c{c}": {key: median_over(runs[name], f"c{c}", key) for key in KEYS} for c in levels}
             for name in SETTINGS}
    result: dict[str, Any] = {
        "levels": levels, "rounds": rounds, "workload": dataclasses.asdict(work), "median": table,
        "runs": {name: [{f"c{c}": r[f"c{c}"] for c in levels} for r in rs] for name, rs in runs.items()},
        "checks_ok": all(r["smoke"]["all_ok"] for rs in runs.values() for r in rs),
    }
    if result["checks_ok"]:
        ratios = {}
        for c in levels:
            own, in_replica = table["own_process"][f"c{c}"], table["in_replica"][f"c{c}"]
            for key, label in (("itl_p99_s", "itl_p99"), ("itl_p50_s", "itl_p50"),
                               ("output_tokens_per_s", "throughput")):
                if own[key] and in_replica[key]:
                    ratios[f"replica_{label}_engine_process_vs_in_replica_c{c}"] = own[key] / in_replica[key]
        result["ratios"] = ratios
    return result


def run(ctx: Context) -> dict[str, Any]:
    """Options: concurrency, rounds, new_tokens."""
    levels, rounds, work = cpu_load(ctx)
    return on_tiny_checkpoint(lambda model, vocab: measure(model, vocab, levels, rounds, work))
