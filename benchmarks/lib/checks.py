"""Correctness beside every figure: relative errors, tolerances, outputs poisoned before a kernel runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

BF16_TOL = 1e-2  # relative Frobenius error allowed to bf16 outputs against a float32 reference


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of `out` against `ref`, in float64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30)).item()


@contextmanager
def poisoned(module: Any) -> Iterator[None]:
    """Make a kernel module's `_empty` allocate float outputs and workspaces filled with NaN, so an
    output the kernel never writes shows as NaN instead of passing on a lucky zero."""
    saved = module._empty
    module._empty = lambda *shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device)
    try:
        yield
    finally:
        module._empty = saved


def replays_bitwise(fn: Callable[[], tuple[torch.Tensor, ...]], replays: int = 3) -> bool:
    """On CUDA: are a CUDA graph's replays of fn, and a second eager call, bitwise its first eager
    call? fn returns its outputs (fresh tensors each call, or the buffers it writes)."""
    first = [t.clone() for t in fn()]
    again = fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    same = all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        same = same and all(torch.equal(a, b) for a, b in zip(first, captured, strict=True))
    return same
