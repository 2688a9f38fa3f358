"""Who a request runs for, as the scheduler needs it: tenant, weight, priority class, SLO targets.

The platform builds one from the tenant's spec and it travels with the request to the engine;
requests made through the engine's own API carry the default (one anonymous tenant).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Served in this order: every `interactive` request goes before any `batch` one.
PRIORITY_CLASSES = ("interactive", "batch")


@dataclass(frozen=True)
class Tenancy:
    tenant_id: str = ""
    weight: float = 1.0  # share of the engine relative to other tenants' weights
    priority_class: str = "interactive"
    ttft_slo_s: float | None = None  # target time to first token
    tpot_slo_s: float | None = None  # target time per output token after the first

    def __post_init__(self) -> None:
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"weight must be a finite number > 0, got {self.weight!r}")
        if self.priority_class not in PRIORITY_CLASSES:
            raise ValueError(f"priority_class must be one of {PRIORITY_CLASSES}, got {self.priority_class!r}")
        for name in ("ttft_slo_s", "tpot_slo_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0 or None, got {value!r}")

    @property
    def class_rank(self) -> int:
        """0 for the class served first."""
        return PRIORITY_CLASSES.index(self.priority_class)

    @property
    def has_slo(self) -> bool:
        return self.ttft_slo_s is not None or self.tpot_slo_s is not None


DEFAULT_TENANCY = Tenancy()
