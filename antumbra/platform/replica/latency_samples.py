"""What a replica measures of its own streams: time to first token and the gaps between chunks.

Both are taken where the replica yields a stream's items, so they hold what the engine and the replica
add; a client's figures minus these are what the ingress, Serve's proxy and the network add. The
recent TTFTs (a sliding window) drive TTFT autoscaling (`ttft_p90`); the untaken ones are handed out
once each (`take_ttft` / `take_gaps`) to a benchmark or an operator, which splits a platform's latency
into its hops. Every store is bounded: a sample past the bound is dropped, never the process's memory.
"""

from __future__ import annotations

import collections
import math

TTFT_WINDOW_S = 60.0
MAX_SAMPLES = 1024
MAX_GAP_SAMPLES = 65536  # a level of a benchmark: 64 requests of 256 tokens, and more


def nearest_rank(samples: list[float], quantile: float) -> float:
    """The nearest-rank `quantile` of a non-empty list."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(quantile * len(ordered)) - 1)]


class LatencySamples:
    """A replica's TTFTs (seconds, arrival here to the first token) and inter-chunk gaps (seconds
    between two yields of one stream that each carry new tokens). Times are `time.monotonic()`
    readings the caller passes in."""

    def __init__(self, max_samples: int = MAX_SAMPLES, max_gap_samples: int = MAX_GAP_SAMPLES,
                 window_s: float = TTFT_WINDOW_S) -> None:
        self._recent: collections.deque[tuple[float, float]] = collections.deque(maxlen=max_samples)
        self._ttft_untaken: list[float] = []
        self._gaps_untaken: list[float] = []
        self._max_samples = max_samples
        self._max_gap_samples = max_gap_samples
        self._window_s = window_s

    def first_token(self, now_s: float, ttft_s: float) -> None:
        self._recent.append((now_s, ttft_s))
        if len(self._ttft_untaken) < self._max_samples:
            self._ttft_untaken.append(ttft_s)

    def next_chunk(self, gap_s: float) -> None:
        if len(self._gaps_untaken) < self._max_gap_samples:
            self._gaps_untaken.append(gap_s)

    def ttft_p90(self, now_s: float) -> float | None:
        """p90 of the TTFTs of the last `window_s` (None: none)."""
        recent = [ttft for at, ttft in self._recent if at >= now_s - self._window_s]
        return nearest_rank(recent, 0.9) if recent else None

    def take_ttft(self) -> list[float]:
        samples, self._ttft_untaken = self._ttft_untaken, []
        return samples

    def take_gaps(self) -> list[float]:
        samples, self._gaps_untaken = self._gaps_untaken, []
        return samples
