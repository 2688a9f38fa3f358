"""Timing: kernel time on the device (CUDA graphs between events), host-side waits, percentiles."""

from __future__ import annotations

import contextlib
import functools
import math
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch


def sync(device: str) -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Parts:
    """Seconds spent inside each wrapped callable (outermost call only, per name): wall and the calling
    thread's CPU time, and the calls counted. `drain`: called before and after each outermost call (a
    device sync, so a part's time includes the device work it queued); None: nothing waits."""

    def __init__(self, drain: Callable[[], None] | None = None) -> None:
        self.drain = drain
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._depth: dict[str, int] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            depth = self._depth.get(name, 0)
            self._depth[name] = depth + 1
            if depth == 0 and self.drain is not None:
                self.drain()
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth[name] = depth
                if depth == 0:
                    if self.drain is not None:
                        self.drain()
                    self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                    cpu = time.thread_time() - start_cpu
                    self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + cpu
                    self.calls[name] = self.calls.get(name, 0) + 1

        return timed

    def reset(self) -> None:
        self.seconds, self.cpu_seconds, self.calls = {}, {}, {}

    def mean_ms(self) -> dict[str, dict[str, float]]:
        """name -> {"mean_ms": wall ms per call, "calls"}."""
        return {name: {"mean_ms": 1e3 * seconds / self.calls[name], "calls": self.calls[name]}
                for name, seconds in self.seconds.items()}


def ms_per_call(fn: Callable[[], object], calls: int, device: str) -> float:
    """ms per call of `fn` over `calls` calls back to back, the device drained before and after."""
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - start) * 1e3 / calls


def timed_steps_ms(engine: Any, steps: int, device: str) -> float:
    """ms per `engine.core.step()` over `steps` steps, the device drained before and after."""
    return ms_per_call(engine.core.step, steps, device)


def time_us(calls: list[Callable[[], object]], device: str, *, reps: int = 20, graph: bool = True) -> float:
    """Median microseconds per call over `reps` passes through `calls`.

    CUDA: warmed up, then (graph=True) captured once into a CUDA graph and replayed between events,
    which removes launch gaps; graph=False times eager passes between events. Several distinct
    input sets in `calls` keep repeats from hitting L2. CPU: one eager pass on the wall clock
    (the interpreter: a smoke check, not a measurement).
    """
    if not device.startswith("cuda"):
        start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - start) * 1e6 / len(calls)
    for call in calls:
        call()
    torch.cuda.synchronize()

    def eager() -> None:
        for call in calls:
            call()

    run = eager
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            eager()
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            eager()
        run = cuda_graph.replay
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_ev.record()
        run()
        end_ev.record()
        end_ev.synchronize()
        times.append(start_ev.elapsed_time(end_ev) * 1e3 / len(calls))
    return statistics.median(times)


def time_zipped(fn: Callable[..., object], arg_sets: tuple[list[Any], ...], device: str, reps: int,
                **kwargs: Any) -> float:
    """Median us per call of fn over the argument sets zipped (one call per position: rotating
    inputs keep repeats off L2), as `time_us` times them."""
    calls: list[Callable[[], object]] = [functools.partial(fn, *args, **kwargs)
                                         for args in zip(*arg_sets, strict=True)]
    return time_us(calls, device, reps=reps)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (`q` in 0..1); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`fn()`, or its error: one failing configuration must not hide the other figures of a run."""
    try:
        return fn()
    except Exception as exc:
        if torch.cuda.is_available():
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()
        # A compiler's message follows the kernel's source: keep its end too.
        return {"error": repr(exc)[:500], "error_end": str(exc)[-1500:],
                "traceback": traceback.format_exc()[-3000:]}
