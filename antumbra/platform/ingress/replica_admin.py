"""The SLO attainment report built from every replica's state (`admin.each_replica` asks them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from antumbra.platform.ingress.admin import each_replica
from antumbra.platform.messages import SLO_COUNT_NAMES, ReplicaQuery, add_slo_counts, slo_attainment


def slo_report(model: str, states: dict[str, dict[str, Any]], tenant: str | None) -> list[dict[str, Any]]:
    """Per tenant with SLO targets (only `tenant` when given): the counts of every replica of `model`
    added up, for the replicas' recent window and for all time, with the fractions met."""
    merged: dict[str, dict[str, dict[str, int]]] = {}
    for state in states.values():
        for tenant_id, counts in (state.get("slo") or {}).items():
            if tenant is None or tenant_id == tenant:
                into = merged.setdefault(tenant_id, {"window": {}, "total": {}})
                add_slo_counts(into["window"], counts["window"])
                add_slo_counts(into["total"], counts["total"])
    return [
        {
            "tenant": tenant_id,
            "model": model,
            "replicas": len(states),
            **{span: {**{n: c[span].get(n, 0) for n in SLO_COUNT_NAMES}, **slo_attainment(c[span])}
               for span in ("window", "total")},
        }
        for tenant_id, c in sorted(merged.items())
    ]


async def slo_reports(models: Mapping[str, Any], tenant: str | None) -> list[dict[str, Any]]:
    """`slo_report` of every served model (values with a Serve `handle`), asking each live replica."""
    data: list[dict[str, Any]] = []
    for name, served in models.items():
        handle = served.handle
        states = await each_replica(lambda answered: handle.replica_state.remote(  # noqa: B023
            ReplicaQuery(answered, False)))
        data += slo_report(name, states, tenant)
    return data
