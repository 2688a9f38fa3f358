"""Device facts the kernels' launch plans read."""

from __future__ import annotations

import functools

import torch


def multiprocessor_count(device: torch.device, off_gpu: int = 4) -> int:
    """The device's streaming multiprocessors; `off_gpu` elsewhere (the CPU interpreter, where a
    small count keeps the grids tiny)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_multiprocessors(index)
    return off_gpu


@functools.cache
def _cuda_multiprocessors(index: int) -> int:
    """Read once per device: launch plans ask for it on every call, and the properties lookup costs
    more than many a launch's own arithmetic."""
    return int(torch.cuda.get_device_properties(index).multi_processor_count)
