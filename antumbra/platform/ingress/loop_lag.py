"""How late an ingress's event loop runs: the lag of a timer that should fire every `interval_s`.

Every chunk of every stream an ingress serves passes its event loop, so whatever holds that loop
(a long synchronous step, a worker thread's Python holding the GIL, the garbage collector) delays
them all. `LoopLag.run` sleeps `interval_s` again and again and records how much later than due
each wake-up came; `take()` hands over the samples since the last call (the benchmarks read them
through the ingress's `take_loop_lags`). Past `max_samples` the oldest are dropped, so a monitor
nobody reads holds a bounded list.

`GcPauses` records each of the process's cyclic garbage collections (its generation and how long it
ran, holding the GIL all along), so that a lag can be set beside the collections of the same time.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections import deque
from collections.abc import Callable
from typing import Any


class LoopLag:
    """Samples of the running loop's lag, seconds (module docstring). The clock is injectable."""

    def __init__(self, interval_s: float = 0.005, max_samples: int = 100_000,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.interval_s = interval_s
        self.clock = clock
        self._samples: deque[float] = deque(maxlen=max_samples)

    async def run(self) -> None:
        """Sample until cancelled."""
        while True:
            due = self.clock() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self._samples.append(max(0.0, self.clock() - due))

    def take(self) -> list[float]:
        """The lags recorded since the last call, oldest first."""
        samples = list(self._samples)
        self._samples.clear()
        return samples


class GcPauses:
    """The process's garbage collections as `(generation, seconds)`, through `gc.callbacks`.

    The collector calls back on whichever thread triggered the collection, at its start and at its
    stop, with nothing else running in between; so one start time is enough. The clock is injectable.
    """

    def __init__(self, max_samples: int = 100_000, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._started_at = 0.0
        self._samples: deque[tuple[int, float]] = deque(maxlen=max_samples)

    @classmethod
    def installed(cls) -> GcPauses:
        """A recorder already called by the collector."""
        pauses = cls()
        gc.callbacks.append(pauses)
        return pauses

    def uninstall(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started_at = self.clock()
        else:
            self._samples.append((int(info["generation"]), self.clock() - self._started_at))

    def take(self) -> list[tuple[int, float]]:
        """The collections since the last call, oldest first."""
        samples = list(self._samples)
        self._samples.clear()
        return samples
