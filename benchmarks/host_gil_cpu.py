"""The GIL switch interval against a stepping thread that waits for a device, on the CPU.

What a replica on a GPU does, with the device's work stood in for by a wait that releases the GIL
(as a CUDA synchronisation does): a stepping thread waits `DEVICE_MS` for each step, runs a little
Python (applying the step, building the next one) and hands every stream its delta on an asyncio
event loop, whose tasks each do `work` units of Python per delta (formatting and framing it, as
the replica and Ray Serve's streaming do). When the event loop is running Python while the stepping
thread's wait ends, the thread takes the GIL back only once the loop's switch interval has passed
(Python's default: 5000 us); the loop's share of the time grows with the streams and their work.

Reported per interval and per-delta work: the stepping thread's period p50 / p99 and steps/s, and
the deltas the event loop finished per second (what clients receive); the intervals alternate within
each repetition. The platform's default interval (`ModelSpec.gil_switch_interval_us`) is compared
with Python's in `ratios`.

    python -m benchmarks.host_gil_cpu [--reps 3]   # -> benchmarks/results/host-gil.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from typing import Any

from antumbra.platform.launch.platform_config import DEFAULT_GIL_SWITCH_INTERVAL_US

from .lib.records import RESULTS_DIR, provenance

DEVICE_MS = 2.0  # the device's share of a step (a decode step of the slice at B8-B32)
STEP_UNITS = 200  # the stepping thread's Python per step, in work units
STREAMS = 32
WORKS = (10, 100, 300)  # work units per delta on the event loop
INTERVALS_US = tuple(sorted({5000, 1000, 200, 50, int(DEFAULT_GIL_SWITCH_INTERVAL_US)}, reverse=True))
SECONDS = 2.0
DELTA = {"choices": [{"text": "x", "index": 0, "logprobs": None, "finish_reason": None}], "usage": None,
         "model": "m", "object": "text_completion", "id": "cmpl-0"}


def _units(n: int) -> int:
    """About n x 0.3 us of pure Python (holds the GIL throughout)."""
    total = 0
    for i in range(n * 10):
        total += i
    return total


def one_run(interval_us: int, work: int) -> dict[str, float]:
    """The stepping thread's period over `SECONDS` at this interval and per-delta work."""
    sys.setswitchinterval(interval_us * 1e-6)
    loop = asyncio.new_event_loop()
    queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(STREAMS)]
    periods: list[float] = []
    delivered = [0]  # deltas the event loop finished: what clients receive
    stop = threading.Event()

    def stepping() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(DEVICE_MS * 1e-3)  # releases the GIL, as waiting for the device does
            _units(STEP_UNITS)
            for q in queues:
                loop.call_soon_threadsafe(q.put_nowait, "x")
            now = time.perf_counter()
            periods.append(now - last)
            last = now

    async def stream(q: asyncio.Queue) -> None:
        while True:
            text = await q.get()
            json.dumps({**DELTA, "choices": [{**DELTA["choices"][0], "text": text}]})
            _units(work)
            delivered[0] += 1

    async def main() -> None:
        tasks = [asyncio.create_task(stream(q)) for q in queues]
        await asyncio.sleep(SECONDS)
        stop.set()
        for t in tasks:
            t.cancel()

    thread = threading.Thread(target=stepping)
    thread.start()
    try:
        loop.run_until_complete(main())
    finally:
        thread.join()
        loop.close()
    kept = sorted(periods[5:])
    return {"period_p50_ms": statistics.median(kept) * 1e3,
            "period_p99_ms": kept[int(0.99 * len(kept))] * 1e3, "steps_per_s": len(periods) / SECONDS,
            "deltas_per_s": delivered[0] / SECONDS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    before = sys.getswitchinterval()
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        str(w): {str(i): [] for i in INTERVALS_US} for w in WORKS}
    try:
        for rep in range(args.reps):
            for work in WORKS:
                order = INTERVALS_US if rep % 2 == 0 else INTERVALS_US[::-1]
                for interval in order:
                    runs[str(work)][str(interval)].append(one_run(interval, work))
    finally:
        sys.setswitchinterval(before)
    median = {w: {i: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for i, rs in by.items()}
              for w, by in runs.items()}
    default, python = str(int(DEFAULT_GIL_SWITCH_INTERVAL_US)), "5000"
    result: dict[str, Any] = {
        **provenance("cpu"), "device_ms": DEVICE_MS, "step_units": STEP_UNITS, "streams": STREAMS,
        "works": list(WORKS), "intervals_us": list(INTERVALS_US), "reps": args.reps, "median": median,
        "runs": runs,
        "ratios": {
            **{f"step_period_p50_default_vs_python_interval_work{w}":
               median[w][default]["period_p50_ms"] / median[w][python]["period_p50_ms"] for w in median},
            **{f"deltas_per_s_default_vs_python_interval_work{w}":
               median[w][default]["deltas_per_s"] / median[w][python]["deltas_per_s"] for w in median}},
    }
    out = RESULTS_DIR / "host-gil.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    for w, by in median.items():
        figures = {i: (round(v["period_p50_ms"], 2), round(v["period_p99_ms"], 2), round(v["deltas_per_s"]))
                   for i, v in by.items()}
        print(f"work {w}:", figures)
    print(json.dumps(result["ratios"], indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
