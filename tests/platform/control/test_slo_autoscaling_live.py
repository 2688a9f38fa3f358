"""SLO autoscaling, live: a tenant whose targets its load breaches scales a model from one replica to
two, and the model goes back to one once the load stops.

Real Ray Serve, a real redis-server and the tiny model; the model deployment runs our `slo` policy
alone. The tenant's TTFT and TPOT targets are far below what a CPU replica can do, so every request
misses them. The load is one stream that never pauses: Ray Serve's default policy (two ongoing
requests per replica) and our queue-depth policy would both keep one replica, so the scale-up shows
that the SLO attainment is what decides.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from antumbra.platform.launch.redis_server import free_port
from antumbra.platform.launch.serve_cli import RunningPlatform, local_platform
from tests.platform.control.live import FAST_AUTOSCALING, StreamLoad, metric_values, running_replicas
from tests.waiting import wait_until

MODEL = "tiny"
TENANT = "tight"
TARGET_ATTAINMENT = 0.9
SLO_TARGET_S = 1e-4  # both TTFT and time per output token: no CPU replica meets it
MAX_TOKENS = 16  # short requests, so outcomes reach the replicas' SLO windows quickly
AUTOSCALING = {
    "policy": "slo",
    "policy_kwargs": {"target_attainment": TARGET_ATTAINMENT},
    **FAST_AUTOSCALING,
}


@dataclass
class SloPlatform:
    running: RunningPlatform
    api_key: str


@pytest.fixture(scope="module")
def platform(tiny_checkpoint: Path) -> Iterator[SloPlatform]:
    config = {"models": {MODEL: {"path": str(tiny_checkpoint), "autoscaling": AUTOSCALING}}}
    with local_platform(config, port=free_port(), num_cpus=2, create_default_tenant=False) as running:
        spec = {"id": TENANT, "ttft_slo_s": SLO_TARGET_S, "tpot_slo_s": SLO_TARGET_S}
        r = httpx.post(f"{running.base_url}/admin/tenants", json=spec,
                       headers={"Authorization": f"Bearer {running.admin_key}"}, timeout=30)
        assert r.status_code == 201, r.text
        yield SloPlatform(running, r.json()["api_key"])


def test_an_slo_breach_scales_a_model_to_two_replicas_and_back(platform: SloPlatform) -> None:
    wait_until(lambda: running_replicas(MODEL) == 1, 60, "the initial replica")
    load = StreamLoad(platform.running.base_url, platform.api_key, MODEL, streams=1, max_tokens=MAX_TOKENS)
    seen: list[float] = []  # the SLO attainment the controller held while the load ran

    def scaled_up() -> bool:
        seen.extend(metric_values(MODEL, "slo_attainment"))
        return running_replicas(MODEL) == 2

    load.start()
    try:
        wait_until(scaled_up, 120, "a second replica under the breach", poll_s=0.5)
        assert running_replicas(MODEL) == 2  # held while the breach lasts
    finally:
        load.finish()
    wait_until(lambda: running_replicas(MODEL) == 1, 120, "one replica once the load stopped", poll_s=0.5)

    assert not load.failures(), load.failures()
    assert seen and max(seen) < TARGET_ATTAINMENT, seen
