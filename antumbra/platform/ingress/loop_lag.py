"""How late an ingress's event loop runs: the lag of a timer that should fire every `interval_s`.

Every chunk of every stream an ingress serves passes its event loop, so whatever holds that loop
(a long synchronous step, a worker thread's Python holding the GIL, the garbage collector) delays
them all. `LoopLag.run` sleeps `interval_s` again and again and records how much later than due
each wake-up came; `take()` hands over the samples since the last call (the benchmarks read them
through the ingress's `take_loop_lags`). Past `max_samples` the oldest are dropped, so a monitor
nobody reads holds a bounded list.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable


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
