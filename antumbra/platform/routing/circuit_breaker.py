"""The circuit breaker that turns a failing prefix directory into load-only routing."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

BreakerState = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    """Closed → open after `failure_threshold` consecutive failures; open → half-open after `cooldown_s`.

    Algorithm:
      * closed: every call is allowed; a success resets the consecutive-failure count, a
        failure increments it, and reaching `failure_threshold` opens the breaker.
      * open: calls are refused (the caller falls back) until `cooldown_s` has passed on
        `clock` since it opened; then the breaker is half-open.
      * half-open: exactly one trial call is allowed at a time; its success closes the
        breaker, its failure opens it again for another `cooldown_s`. A trial that ends
        without a verdict (cancelled) is `abandon`ed, freeing the slot for another.
    """

    def __init__(
        self,
        *,
        failure_threshold: int = 3,
        cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError("failure_threshold must be at least 1")
        self._threshold = failure_threshold
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._state: BreakerState = "closed"
        self._consecutive = 0
        self._opened_at = 0.0
        self._trial_in_flight = False
        self.failures = 0  # all failures ever recorded
        self.opens = 0  # times the breaker opened
        self.rejected = 0  # calls refused while open or during a trial

    @property
    def state(self) -> BreakerState:
        if self._state == "open" and self._clock() - self._opened_at >= self._cooldown_s:
            self._state = "half_open"
            self._trial_in_flight = False
        return self._state

    def allow(self) -> bool:
        """Whether the caller may try the protected operation now (then it must report the outcome)."""
        state = self.state
        if state == "closed":
            return True
        if state == "half_open" and not self._trial_in_flight:
            self._trial_in_flight = True
            return True
        self.rejected += 1
        return False

    def record_success(self) -> None:
        self._state = "closed"
        self._consecutive = 0
        self._trial_in_flight = False

    def record_failure(self) -> None:
        self.failures += 1
        self._consecutive += 1
        if self._state == "half_open" or self._consecutive >= self._threshold:
            if self._state != "open":
                self.opens += 1
            self._state = "open"
            self._opened_at = self._clock()
            self._trial_in_flight = False

    def abandon(self) -> None:
        """An allowed call ended without a verdict (e.g. it was cancelled)."""
        self._trial_in_flight = False
