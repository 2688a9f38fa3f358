"""What the capacity gate's watch costs the ingress's process, on the CPU: `serve.status()` against
the controller's plain details.

    python -m benchmarks.host_capacity_watch_cpu [--rounds 2] [--seconds 4]

Every ingress replica refreshes the running replica counts once a second on a worker thread
(`platform/ingress/capacity.py`, `CapacityWatch`). The thread's Python holds the GIL that the
ingress's event loop needs to stream tokens. Here the platform serves the tiny checkpoint on this
machine; in this (the driver's) process an event loop ticks every 0.2 ms while a thread asks for
the counts every 0.25 s (four times the watch's rate, to gather samples), through `serve.status()`
(what the watch called before) and through `ControllerDetails` (what it calls now), alternating
`--rounds` times, with an idle pass beside each. Recorded per variant: the thread's CPU time per
call and the loop's lag (how late its ticks ran: max, p99.9, p99). Ratios:
`watch_call_cpu_details_vs_status` and `loop_lag_p999_details_vs_status`. The machine's other
processes (the platform's) share its cores, so lags are noisy; compare within a round. Writes
benchmarks/results/host-capacity-watch.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .lib.records import provenance, write_results
from .lib.timing import percentile

TICK_S = 0.0002
CALL_EVERY_S = 0.25


async def _pass(call: Callable[[], object] | None, seconds: float) -> dict[str, Any]:
    """Tick the loop for `seconds` while a thread runs `call` every `CALL_EVERY_S` (none: idle)."""
    lags: list[float] = []
    cpu_ms: list[float] = []
    stop = time.perf_counter() + seconds

    def timed_call() -> None:
        assert call is not None
        started = time.thread_time()
        call()
        cpu_ms.append((time.thread_time() - started) * 1e3)

    async def caller() -> None:
        while time.perf_counter() < stop:
            await asyncio.to_thread(timed_call)
            await asyncio.sleep(CALL_EVERY_S)

    task = asyncio.create_task(caller()) if call is not None else None
    while time.perf_counter() < stop:
        due = time.perf_counter() + TICK_S
        await asyncio.sleep(TICK_S)
        lags.append(max(0.0, time.perf_counter() - due) * 1e3)
    if task is not None:
        await task
    return {"lag_max_ms": max(lags), "lag_p999_ms": percentile(lags, 0.999),
            "lag_p99_ms": percentile(lags, 0.99), "calls": len(cpu_ms),
            "call_cpu_ms": statistics.median(cpu_ms) if cpu_ms else None}


def measure(rounds: int, seconds: float) -> dict[str, Any]:
    from ray import serve

    from antumbra.platform.ingress.capacity import ControllerDetails
    from antumbra.platform.launch.redis_server import free_port
    from antumbra.platform.launch.serve_cli import local_platform
    from antumbra.replicas.model.tiny import make_tiny_checkpoint

    variants: dict[str, Callable[[], object] | None] = {"idle": None, "status": serve.status,
                                                         "details": ControllerDetails()}
    passes: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_checkpoint(Path(tmp) / "tiny")
        config = {"ingress_replicas": 2, "models": {"tiny": {"path": str(model), "max_model_len": 1024}}}
        with local_platform(config, port=free_port(), num_cpus=2):
            for r in range(rounds):
                for name, call in variants.items():
                    result = {"variant": name, "round": r, **asyncio.run(_pass(call, seconds))}
                    passes.append(result)
                    print(result, flush=True)

    def median_of(variant: str, key: str) -> float:
        return statistics.median(p[key] for p in passes if p["variant"] == variant)

    ratios = {key: median_of("details", field) / median_of("status", field)
              for key, field in (("watch_call_cpu_details_vs_status", "call_cpu_ms"),
                                 ("loop_lag_p999_details_vs_status", "lag_p999_ms"))}
    return {"passes": passes, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    result = {**provenance("cpu"), "tick_s": TICK_S, "call_every_s": CALL_EVERY_S,
              **measure(args.rounds, args.seconds)}
    write_results("host-capacity-watch.json", result)


if __name__ == "__main__":
    main()
