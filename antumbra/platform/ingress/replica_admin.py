"""Asking every replica of a model for its state, and the SLO attainment report built from it.

Each call through the model's handle reaches one replica; the query names the replicas that already
answered, so the cache-affinity router sends it to another one while one is left, and a replica
answering twice means every live replica has answered (`messages.ReplicaQuery`).
"""

from __future__ import annotations

from typing import Any

from antumbra.platform.messages import SLO_COUNT_NAMES, ReplicaQuery, add_slo_counts, slo_attainment

MAX_REPLICAS = 1024  # bounds a round of replicas (each answers once, then repeats)


async def replica_states(handle: Any, check_integrity: bool = False) -> dict[str, dict[str, Any]]:
    """Every live replica's `replica_state` answer, by replica id."""
    states: dict[str, dict[str, Any]] = {}
    for _ in range(MAX_REPLICAS):
        answer = await handle.replica_state.remote(ReplicaQuery(frozenset(states), check_integrity))
        if answer["replica_id"] in states:
            break
        states[answer["replica_id"]] = answer
    return states


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
