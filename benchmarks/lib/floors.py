"""Floors from rates measured in the same run: a copy-bandwidth probe and a matmul-rate probe.

A byte floor is the bytes an op must move at the copy bandwidth this device shows now; a FLOP floor
the FLOPs at the bf16 matmul rate it shows now. Both probes run once per process (a suite's
benchmarks share them) and on a CPU too, at small sizes, so a smoke run computes its floors the
same way. No floor ever comes from a constant.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .timing import time_us


@dataclass(frozen=True)
class Rates:
    copy_gbps: float  # device-to-device copy, bytes read + written per second / 1e9
    matmul_tflops: float  # bf16 (float32 on a CPU) square matmul on random operands

    def byte_floor_us(self, nbytes: float) -> float:
        return nbytes / (self.copy_gbps * 1e3)

    def flop_floor_us(self, flops: float) -> float:
        return flops / (self.matmul_tflops * 1e6)

    def frac_copy(self, nbytes: float, us: float) -> float:
        """Share of the measured copy bandwidth an op that moved `nbytes` in `us` reached."""
        return self.byte_floor_us(nbytes) / us

    def as_dict(self) -> dict[str, float]:
        return {"copy_gbps": self.copy_gbps, "matmul_tflops": self.matmul_tflops}


@functools.cache
def measure(device: str) -> Rates:
    on_gpu = device.startswith("cuda")
    elements = 2**30 if on_gpu else 2**24  # 4 GiB on a GPU (past every cache), 64 MiB on a CPU
    src = torch.empty(elements, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    copy_us = time_us([functools.partial(dst.copy_, src)], device, reps=5, graph=False)
    del src, dst
    n = 8192 if on_gpu else 512
    dtype = torch.bfloat16 if on_gpu else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm_us = time_us([lambda: a @ b], device, reps=10, graph=False)
    return Rates(copy_gbps=2 * elements * 4 / copy_us / 1e3, matmul_tflops=2 * n**3 / mm_us / 1e6)
