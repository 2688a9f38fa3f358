"""Per-tenant SLO attainment: the tracker on a fake clock, then a model server (tiny model, no Ray)
whose requests of two tenants, one with a target no request can meet, show up in its admin state,
its autoscaling stats and the metrics."""

from __future__ import annotations

import asyncio

import pytest

from antumbra.config import SchedulerConfig
from antumbra.platform.messages import GenerateRequest, ReplicaQuery
from antumbra.platform.messages import slo_attainment as attainment
from antumbra.platform.metrics import default_metrics
from antumbra.platform.replica.model_server import ModelServer
from antumbra.platform.replica.slo import SloTracker
from antumbra.replicas.sampling_params import SamplingParams
from antumbra.replicas.tenancy import Tenancy


def test_outcomes_count_per_target_and_age_out_of_the_window() -> None:
    now = [0.0]
    tracker = SloTracker(window_s=10.0, clock=lambda: now[0])
    both = Tenancy("a", ttft_slo_s=1.0, tpot_slo_s=0.1)
    assert tracker.record(Tenancy("no-slo"), 5.0, 1.0) is None  # no targets: no outcome
    late = tracker.record(both, ttft_s=2.0, tpot_s=0.05)
    assert late is not None
    assert (late.met, late.ttft_met, late.tpot_met, late.pressure) == (False, False, True, 2.0)
    now[0] = 5.0
    one_token = tracker.record(both, ttft_s=0.5, tpot_s=None)  # no second token: no TPOT verdict
    assert one_token is not None and one_token.met and one_token.tpot_met is None
    tracker.record(Tenancy("b", tpot_slo_s=0.1), ttft_s=9.0, tpot_s=0.02)
    window = tracker.snapshot()["a"]["window"]
    assert window == {"requests": 2, "met": 1, "ttft_requests": 2, "ttft_met": 1, "tpot_requests": 1,
                      "tpot_met": 1}
    assert attainment(window) == {"attainment": 0.5, "ttft_attainment": 0.5, "tpot_attainment": 1.0}
    assert tracker.worst_attainment() == 0.5 and tracker.pressure() == 2.0
    now[0] = 12.0  # the late one leaves the window; the totals keep it
    counts = tracker.snapshot()["a"]
    assert counts["window"]["requests"] == 1 and counts["total"]["requests"] == 2
    assert tracker.worst_attainment() == 1.0 and tracker.pressure() == pytest.approx(0.5)
    now[0] = 100.0
    assert tracker.worst_attainment() is None and tracker.pressure() is None


def test_a_replica_reports_each_tenants_attainment(tiny_checkpoint) -> None:
    sched = SchedulerConfig(max_model_len=512)
    server = ModelServer("tiny", str(tiny_checkpoint), engine_kwargs={"scheduler": sched})
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    tenants = {"strict": Tenancy("strict", ttft_slo_s=1e-6), "easy": Tenancy("easy", ttft_slo_s=600.0,
                                                                           tpot_slo_s=600.0)}

    async def main() -> tuple[dict, dict]:
        for i, tenancy in enumerate(tenants.values()):
            request = GenerateRequest(f"r{i}", [5, 6, 7 + i], params, namespace="tiny:t", tenancy=tenancy)
            items = [item async for item in server.generate(request)]
            assert items[-1]["finish_reason"] == "length"
        return await server.record_autoscaling_stats(), await server.replica_state(ReplicaQuery())

    stats, state = asyncio.run(main())
    assert stats["slo_attainment"] == 0.0 and stats["slo_pressure"] > 1.0  # "strict" missed; the worst counts
    slo = state["slo"]
    assert attainment(slo["strict"]["total"])["attainment"] == 0.0
    assert attainment(slo["easy"]["window"]) == dict.fromkeys(("attainment", "ttft_attainment",
                                                               "tpot_attainment"), 1.0)
    metrics = default_metrics()
    assert metrics.count("slo_requests", "strict", "tiny", "ttft", "no") == 1
    assert metrics.count("slo_requests", "easy", "tiny", "all", "yes") == 1
    assert metrics.count("slo_requests", "easy", "tiny", "tpot", "yes") == 1
