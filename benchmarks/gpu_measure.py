"""Measurement helpers shared by the kernel benchmarks: timing, ceilings, errors, poisoning."""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

COPY_CEILING_GBPS = 4077.0  # device-to-device copy on the project's H200 (BASELINES.md)
MATMUL_CEILING_TFLOPS = 780.0  # bf16 8192^3 on random data, same machine (BASELINES.md)
BF16_TOL = 1e-2  # relative Frobenius error for bf16 outputs (METHOD.md)


def time_us(calls: list[Callable[[], object]], device: str, *, reps: int = 20, graph: bool = True) -> float:
    """Median microseconds per call over `reps` passes through `calls`.

    CUDA: warmed up, then (graph=True) captured once into a CUDA graph and replayed between events,
    which removes launch gaps; graph=False times eager passes between events. Several distinct
    input sets in `calls` keep repeats from hitting L2. CPU: one eager pass on the wall clock
    (the interpreter: a smoke check, not a measurement).
    """
    if device == "cpu":
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


def copy_gbps(device: str) -> float | None:
    """Measured device-to-device copy bandwidth (bytes read + written), GB/s; None on CPU."""
    if device == "cpu":
        return None
    src = torch.empty(2**30, dtype=torch.float32, device=device).normal_()  # 4 GiB
    dst = torch.empty_like(src)
    us = time_us([functools.partial(dst.copy_, src)], device, reps=5, graph=False)
    return 2 * src.numel() * 4 / us / 1e3


def matmul_tflops(device: str) -> float | None:
    """Measured bf16 matmul rate on random 8192^3 operands, TFLOP/s; None on CPU."""
    if device == "cpu":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    us = time_us([lambda: a @ b], device, reps=10, graph=False)
    return 2 * 8192**3 / us / 1e6


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of `out` against `ref`, in float64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30)).item()


@contextmanager
def poisoned(module: Any) -> Iterator[None]:
    """Make a kernel module's `_empty` allocate float outputs and workspaces filled with NaN."""
    saved = module._empty
    module._empty = lambda *shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device)
    try:
        yield
    finally:
        module._empty = saved


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")
