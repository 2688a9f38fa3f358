"""Whether the prefix directory's publisher slows a stepping thread that shares its interpreter, on the CPU.

    python -m benchmarks.host_publisher_beside_steps [--steps 2000] [--rounds 3]
        [--wait-ms 4.0] [--work-us 800] [--events-per-step 2]

In an engine process the engine's stepping thread and the publisher's thread share one interpreter
lock, at the engine process's switch interval (`DEFAULT_GIL_SWITCH_INTERVAL_US`). A step here is
what the stepping thread does on a GPU: a wait with the lock released (the device's share of the
step; `--wait-ms`, a sleep), then `--work-us` of Python (scheduling, inputs, outputs), then
`--events-per-step` cache events made, as the engine's tree makes them, and handed to the
publisher's callback when there is one.
The publisher (`Publisher`, its own thread and asyncio loop) flushes them into a redis-server this
benchmark starts on a free port, every `flush_interval_s` (its default, and 20 ms).

Timed: the mean step with no publisher, then with it at each flush interval, in `--rounds` passes
whose order alternates, medians over the passes. Ratios: `step_with_publisher_vs_without_flush_<ms>ms`.
Writes benchmarks/results/host-publisher-beside-steps.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Any

from .host_engine_process_wire import standalone_publisher
from .lib.records import provenance, write_results

FLUSH_INTERVALS_S = (0.1, 0.02)


def _python_work(work_us: float) -> None:
    """Pure Python for about `work_us` (it holds the interpreter lock throughout)."""
    end = time.perf_counter() + work_us * 1e-6
    total = 0
    while time.perf_counter() < end:
        for i in range(50):
            total += i * i


def _steps_ms(args: argparse.Namespace, on_event: Any) -> float:
    """Mean ms per step of the stepping loop (this thread)."""
    from antumbra.cachestore.block_hash import BlockStored

    rng = random.Random(0)
    start = time.perf_counter()
    for _ in range(args.steps):
        time.sleep(args.wait_ms * 1e-3)
        _python_work(args.work_us)
        # The engine's tree makes its events whether or not anyone listens.
        for _ in range(args.events_per_step):
            event = BlockStored((rng.getrandbits(63),), "device")
            if on_event is not None:
                on_event(0, event)
    return (time.perf_counter() - start) / args.steps * 1e3


def _with_publisher(url: str, flush_s: float, args: argparse.Namespace) -> tuple[float, int]:
    """Mean ms per step with a started publisher beside; -> (ms, batches it wrote)."""
    publisher = standalone_publisher(url, f"bench-{flush_s}", flush_interval_s=flush_s).start()
    try:
        ms = _steps_ms(args, publisher.on_event)
    finally:
        publisher.close()
    return ms, publisher.batches


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from antumbra.platform.launch.platform_config import DEFAULT_GIL_SWITCH_INTERVAL_US
    from antumbra.platform.launch.redis_server import LocalRedis

    settings: list[float | None] = [None, *FLUSH_INTERVALS_S]
    runs: dict[str, list[float]] = {str(s): [] for s in settings}
    batches: dict[str, list[int]] = {str(s): [] for s in FLUSH_INTERVALS_S}
    previous = sys.getswitchinterval()
    sys.setswitchinterval(DEFAULT_GIL_SWITCH_INTERVAL_US * 1e-6)
    try:
        with LocalRedis() as server:
            for r in range(args.rounds):
                for setting in settings if r % 2 == 0 else settings[::-1]:
                    if setting is None:
                        ms = _steps_ms(args, None)
                    else:
                        ms, written = _with_publisher(server.url, setting, args)
                        batches[str(setting)].append(written)
                    runs[str(setting)].append(ms)
    finally:
        sys.setswitchinterval(previous)
    median = {key: statistics.median(values) for key, values in runs.items()}
    ratios = {f"step_with_publisher_vs_without_flush_{round(s * 1e3)}ms": median[str(s)] / median["None"]
              for s in FLUSH_INTERVALS_S}
    return {"switch_interval_us": DEFAULT_GIL_SWITCH_INTERVAL_US, "steps": args.steps, "rounds": args.rounds,
            "wait_ms": args.wait_ms, "work_us": args.work_us, "events_per_step": args.events_per_step,
            "step_ms": runs, "step_ms_median": median, "batches_written": batches, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--wait-ms", type=float, default=4.0)
    parser.add_argument("--work-us", type=float, default=800.0)
    parser.add_argument("--events-per-step", type=int, default=2)
    args = parser.parse_args()
    write_results("host-publisher-beside-steps.json", {**provenance("cpu"), **measure(args)})


if __name__ == "__main__":
    main()
