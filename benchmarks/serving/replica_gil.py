"""The replica's GIL switch interval, on the CPU: the tiny model served through the whole platform.

A replica is one process: the engine steps on a thread of its own while the replica's event loop
(Ray Serve's request handling, this platform's per-delta work) streams every request. The stepping
thread gives the GIL up at every wait (a device sync on a GPU; on the CPU every torch op) and, while
the event loop is running Python, gets it back only when the holder's switch interval ends (Python's
default: 5000 us). `ModelSpec.gil_switch_interval_us` sets the interval in the replica process.

One run: for each interval, the platform (Ray Serve, a local Redis, the ingress, one replica of the
tiny checkpoint on the CPU) serves independent prompts at each concurrency level, streamed over plain
HTTP (`platform_vs_engine`'s load and clocks): inter-token latency p50 / p99 and output tokens/s.
The intervals run in `rounds` passes, each pass in the reverse order of the one before, so drift
falls on all of them; a figure is the median over the passes. Ratios compare the platform's default
interval with Python's own.

    python -m benchmarks run platform --only replica_gil [--smoke] [--set intervals_us=5000,50]
        [--set concurrency=16,32] [--set rounds=2] [--set new_tokens=64]
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from antumbra.platform.launch.platform_config import DEFAULT_GIL_SWITCH_INTERVAL_US

from ..lib.context import Context
from .platform_vs_engine import Workload, platform_run

DEVICE = "cpu"
PYTHON_DEFAULT_US = 5000  # sys.getswitchinterval() of a fresh interpreter, in us


def passes(settings: list[Any], rounds: int) -> list[list[Any]]:
    """`rounds` orders of `settings`, each the reverse of the one before."""
    return [settings if r % 2 == 0 else settings[::-1] for r in range(rounds)]


def median_over(runs: list[dict[str, Any]], level: str, key: str) -> float | None:
    values = [r[level][key] for r in runs if r[level][key] is not None]
    return statistics.median(values) if values else None


def measure(model_dir: str, vocab: int, intervals: list[int], levels: list[int], rounds: int,
            work: Workload) -> dict[str, Any]:
    runs: dict[int, list[dict[str, Any]]] = {us: [] for us in intervals}
    for order in passes(intervals, rounds):
        for us in order:
            setting = dataclasses.replace(work, gil_switch_interval_us=float(us))
            run = platform_run(model_dir, levels, vocab, setting)
            took = run["gil_switch_interval_us"]
            assert abs(took - us) < 1.5, f"the replica runs at {took} us, not {us}"  # whole us, truncated
            runs[us].append(run)
            print("interval", us, {f"c{c}": run[f"c{c}"] for c in levels}, flush=True)
    table = {
        str(us): {
            f"c{c}": {key: median_over(runs[us], f"c{c}", key)
                      for key in ("itl_p50_s", "itl_p99_s", "output_tokens_per_s", "ttft_p50_s")}
            for c in levels
        }
        for us in intervals
    }
    result: dict[str, Any] = {"intervals_us": intervals, "levels": levels, "rounds": rounds,
                              "workload": dataclasses.asdict(work), "median": table,
                              "runs": {str(us): [{f"c{c}": r[f"c{c}"] for c in levels} for r in rs]
                                       for us, rs in runs.items()},
                              "checks_ok": all(r["smoke"]["all_ok"] for rs in runs.values() for r in rs)}
    default, python = str(int(DEFAULT_GIL_SWITCH_INTERVAL_US)), str(PYTHON_DEFAULT_US)
    if result["checks_ok"] and default in table and python in table:
        ratios = {}
        for c in levels:
            d, p = table[default][f"c{c}"], table[python][f"c{c}"]
            if d["itl_p99_s"] and p["itl_p99_s"]:
                ratios[f"replica_itl_p99_default_vs_python_interval_c{c}"] = d["itl_p99_s"] / p["itl_p99_s"]
                ratios[f"replica_itl_p50_default_vs_python_interval_c{c}"] = d["itl_p50_s"] / p["itl_p50_s"]
            ratios[f"replica_throughput_default_vs_python_interval_c{c}"] = (
                d["output_tokens_per_s"] / p["output_tokens_per_s"])
        result["ratios"] = ratios
    return result


def cpu_load(ctx: Context) -> tuple[list[int], int, Workload]:
    """The concurrency levels, passes and workload of a platform A/B on the CPU (options concurrency,
    rounds, new_tokens): short prompts to the tiny model."""
    levels = ctx.option("concurrency", [2] if ctx.smoke else [16, 32])
    rounds = ctx.option("rounds", 1 if ctx.smoke else 2)
    work = Workload(new_tokens=ctx.option("new_tokens", 8 if ctx.smoke else 64), min_prompt=32,
                    max_prompt=256, smoke=True)
    return levels, rounds, work


def on_tiny_checkpoint(measure_with: Callable[[str, int], dict[str, Any]]) -> dict[str, Any]:
    """`measure_with(model_dir, vocab_size)` over a tiny checkpoint made for the run."""
    from antumbra.config import ModelConfig
    from antumbra.replicas.model.checkpoint_files import load_hf_config
    from antumbra.replicas.model.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_checkpoint(Path(tmp) / "tiny"))
        return measure_with(model, ModelConfig.from_hf(load_hf_config(model)).vocab_size)


def run(ctx: Context) -> dict[str, Any]:
    """Options: intervals_us, concurrency, rounds, new_tokens."""
    default = int(DEFAULT_GIL_SWITCH_INTERVAL_US)
    intervals = ctx.option("intervals_us", [PYTHON_DEFAULT_US, default] if ctx.smoke
                           else sorted({PYTHON_DEFAULT_US, 1000, 200, 50, default}, reverse=True))
    levels, rounds, work = cpu_load(ctx)
    return on_tiny_checkpoint(lambda model, vocab: measure(model, vocab, intervals, levels, rounds, work))
