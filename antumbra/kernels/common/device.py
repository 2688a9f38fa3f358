"""Device facts the kernels' launch plans read."""

from __future__ import annotations

import torch


def multiprocessor_count(device: torch.device, off_gpu: int = 4) -> int:
    """The device's streaming multiprocessors; `off_gpu` elsewhere (the CPU interpreter, where a
    small count keeps the grids tiny)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return off_gpu
