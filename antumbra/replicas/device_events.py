"""CUDA events recorded on the current stream of a named device."""

from __future__ import annotations

import torch


def recorded_event(device: torch.device) -> torch.cuda.Event:
    """An event recorded on `device`'s current stream. The stream is looked up by the device's index:
    `Event.record()` without a stream finds the current device first, which costs a step's hot path
    tens of microseconds of Python per event."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(index))
    return event
