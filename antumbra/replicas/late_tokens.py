"""Token ids on their way from the device: their count is known at once, their values on first use.

A greedy draft cycle's drafts are copied to pinned host memory behind an event right after the cycle
is enqueued (`LateRead`); each request's drafts are a `LateTokenIds` over its row. The scheduler
applies the step and schedules the next one knowing only how many drafts each request has (`len`,
slicing); the first access to a value (the next verify step's inputs) waits for the copy, so the
host's work in between runs while the drafter does. A verify step's argmax goes the same way, so the
draft cycle can be queued behind the step before the host waits for its verdict.

Invariant: a `LateTokenIds` behaves as the tuple of its values in every use (iteration, indexing,
equality, hashing); only the moment the host waits differs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import torch

from .device_events import recorded_event


class LateRead:
    """Rows of int64 token ids [B, k] copied to the host behind an event (None: already there);
    read once, on first use."""

    def __init__(self, host: torch.Tensor, event: torch.cuda.Event | None) -> None:
        self._host, self._event = host, event
        self._rows: list[list[int]] | None = None

    @staticmethod
    def start(values: torch.Tensor) -> LateRead:
        """Start copying values [B, k] int64 (any device) to the host, behind the work queued so far."""
        if not values.is_cuda:
            return LateRead(values.clone(), None)
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        return LateRead(host, recorded_event(values.device))

    @property
    def is_read(self) -> bool:
        """Whether the host has waited for the rows (a value was used)."""
        return self._rows is not None

    def rows(self) -> list[list[int]]:
        if self._rows is None:
            if self._event is not None:
                self._event.synchronize()
            self._rows = self._host.tolist()
        return self._rows


class LateTokenIds(Sequence[int]):
    """`count` token ids of row `row` of `read`, from column `start`."""

    def __init__(self, read: LateRead, row: int, count: int, start: int = 0) -> None:
        self._read, self._row, self._count, self._start = read, row, count, start

    def values(self) -> tuple[int, ...]:
        return tuple(self._read.rows()[self._row][self._start : self._start + self._count])

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...

    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._count)
            if step == 1:  # still late: a prefix or a window of the same row
                return LateTokenIds(self._read, self._row, max(0, stop - start), self._start + start)
        return self.values()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.values())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and not isinstance(other, str) and self.values() == tuple(other)

    def __hash__(self) -> int:
        return hash(self.values())

    def __repr__(self) -> str:
        return f"LateTokenIds({list(self.values())})"
