"""SLO attainment per tenant on one replica: what the admin API, the metrics and the SLO
autoscaling policy read.

A finished request of a tenant with SLO targets is one outcome: its time to first token (arrival
at the replica to the first token) against `ttft_slo_s`, its mean time per output token after
the first against `tpot_slo_s`; it met its SLO when it met every target it has. Counts are kept
for all time and for the last `window_s` seconds; `pressure` is how close a request came to its
targets (the largest observed / target ratio: above 1 it missed one).
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from antumbra.platform.messages import SLO_COUNT_NAMES, add_slo_counts
from antumbra.replicas.tenancy import Tenancy


@dataclass(frozen=True)
class SloOutcome:
    at_s: float
    tenant_id: str
    ttft_met: bool | None  # None: no TTFT target
    tpot_met: bool | None  # None: no TPOT target, or fewer than two tokens
    pressure: float

    @property
    def met(self) -> bool:
        return self.ttft_met is not False and self.tpot_met is not False

    def counts(self) -> dict[str, int]:
        return {
            "requests": 1,
            "met": int(self.met),
            "ttft_requests": int(self.ttft_met is not None),
            "ttft_met": int(self.ttft_met is True),
            "tpot_requests": int(self.tpot_met is not None),
            "tpot_met": int(self.tpot_met is True),
        }


def outcome(tenancy: Tenancy, ttft_s: float, tpot_s: float | None, at_s: float) -> SloOutcome | None:
    """The outcome of one finished request (None when its tenant has no SLO)."""
    if not tenancy.has_slo:
        return None
    ratios = []
    ttft_met = tpot_met = None
    if tenancy.ttft_slo_s is not None:
        ratios.append(ttft_s / tenancy.ttft_slo_s)
        ttft_met = ttft_s <= tenancy.ttft_slo_s
    if tenancy.tpot_slo_s is not None and tpot_s is not None:
        ratios.append(tpot_s / tenancy.tpot_slo_s)
        tpot_met = tpot_s <= tenancy.tpot_slo_s
    return SloOutcome(at_s, tenancy.tenant_id, ttft_met, tpot_met, max(ratios, default=0.0))


class SloTracker:
    """Outcomes of one replica's requests: all-time counts per tenant, and the last `window_s`."""

    def __init__(self, window_s: float = 60.0, max_recent: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._recent: collections.deque[SloOutcome] = collections.deque(maxlen=max_recent)
        self._totals: dict[str, dict[str, int]] = {}

    def record(self, tenancy: Tenancy, ttft_s: float, tpot_s: float | None) -> SloOutcome | None:
        result = outcome(tenancy, ttft_s, tpot_s, self.clock())
        if result is not None:
            self._recent.append(result)
            add_slo_counts(self._totals.setdefault(result.tenant_id, {}), result.counts())
        return result

    def recent(self) -> list[SloOutcome]:
        horizon = self.clock() - self.window_s
        return [o for o in self._recent if o.at_s >= horizon]

    def snapshot(self) -> dict[str, dict[str, dict[str, int]]]:
        """Per tenant: {"window": counts, "total": counts} (plain ints, so replicas' answers add up)."""
        window: dict[str, dict[str, int]] = {}
        for o in self.recent():
            add_slo_counts(window.setdefault(o.tenant_id, {}), o.counts())
        return {t: {"window": window.get(t, dict.fromkeys(SLO_COUNT_NAMES, 0)), "total": dict(total)}
                for t, total in self._totals.items()}

    def worst_attainment(self) -> float | None:
        """The lowest recent attainment over tenants (None without recent outcomes)."""
        per_tenant: dict[str, list[bool]] = {}
        for o in self.recent():
            per_tenant.setdefault(o.tenant_id, []).append(o.met)
        return min((sum(m) / len(m) for m in per_tenant.values()), default=None)

    def pressure(self, quantile: float = 0.9) -> float | None:
        """The nearest-rank quantile of recent outcomes' pressure (None without any)."""
        values = sorted(o.pressure for o in self.recent())
        if not values:
            return None
        return values[max(0, math.ceil(quantile * len(values)) - 1)]
