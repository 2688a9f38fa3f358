"""Reading usage back: `GET /admin/usage?tenant=&from=&to=` (the layout is `usage.py`'s).

`from` and `to` are ISO 8601 times (a time without a zone is UTC) or Unix seconds. An hour is in
the answer when it overlaps `[from, to)`; the defaults are all time and now. Without `tenant`,
every tenant that has usage.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from antumbra.platform.ingress.openai_errors import invalid
from antumbra.platform.ingress.usage import COUNTERS, HOUR_S, UsageKeys, split_member

MAX_TIME_S = 253_402_300_799  # 9999-12-31T23:59:59Z, the last time an ISO answer can show


def parse_time(value: str, param: str) -> float:
    """Unix seconds from an ISO 8601 time or a number of seconds, from 1970 to the year 9999; a 400
    naming `param` otherwise."""
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            moment = datetime.fromisoformat(text)
        except ValueError:
            raise invalid(
                f"`{param}` must be an ISO 8601 time (e.g. 2026-01-31T12:00:00Z) or Unix seconds, "
                f"not {value!r}", param, code="invalid_time") from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        seconds = moment.timestamp()
    if not 0 <= seconds <= MAX_TIME_S:  # NaN fails this too
        raise invalid(f"`{param}` must lie between 1970 and the year 9999, not {value!r}", param,
                      code="invalid_time")
    return seconds


def iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class UsageWindow:
    """The `[from_s, to_s)` of a usage query, checked."""

    from_s: float
    to_s: float

    @classmethod
    def parse(cls, from_: str | None, to: str | None, now_s: float | None = None) -> UsageWindow:
        start = parse_time(from_, "from") if from_ else 0.0
        end = parse_time(to, "to") if to else (time.time() if now_s is None else now_s)
        if end <= start:
            raise invalid(f"`to` ({iso(end)}) must be later than `from` ({iso(start)})", "to",
                          code="invalid_time_range")
        return cls(start, end)

    def hour_range(self) -> tuple[int, float]:
        """Index scores (hour starts) of the hours that overlap the window."""
        return int(self.from_s // HOUR_S) * HOUR_S, math.nextafter(self.to_s, -math.inf)


async def query_usage(redis: Any, keys: UsageKeys, tenant: str | None, window: UsageWindow) -> dict[str, Any]:
    """The answer of `GET /admin/usage`: one row per tenant, model and hour, and totals per tenant."""
    tenants = [tenant] if tenant else sorted(t.decode() for t in await redis.smembers(keys.tenants))
    low, high = window.hour_range()
    rows: list[dict[str, Any]] = []
    for tenant_id in tenants:
        members = [m.decode() for m in await redis.zrangebyscore(keys.hours(tenant_id), low, high)]
        pipe = redis.pipeline(transaction=False)
        for member in members:
            pipe.hgetall(keys.hour(tenant_id, member))
        for member, counts in zip(members, await pipe.execute(), strict=True):
            hour_s, model = split_member(member)
            values = {name: int(counts.get(name.encode(), 0)) for name in COUNTERS}
            rows.append({"tenant": tenant_id, "model": model, "hour": iso(hour_s), "hour_s": hour_s, **values,
                         "total_tokens": values["prompt_tokens"] + values["completion_tokens"]})
    totals: dict[str, dict[str, int]] = {}
    for row in rows:
        sums = totals.setdefault(row["tenant"], dict.fromkeys((*COUNTERS, "total_tokens"), 0))
        for name in sums:
            sums[name] += row[name]
    return {"object": "usage", "tenant": tenant, "from": iso(window.from_s), "to": iso(window.to_s),
            "data": rows, "totals": totals}
