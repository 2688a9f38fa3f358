"""One app for the whole package: 2 replicas of the tiny model (and 1 of it on the HiSparse host
tier) on real Ray Serve, in front of a real redis-server that persists as production's does.

Starting Ray, Serve and three replicas costs ~30-60 s on 2 busy cores, so the app is shared
(package scope: it stops before other packages' tests start Ray themselves). Every test takes it
through the `app` fixture, which first restores the known state: Redis up, every replica RUNNING,
every engine idle with nothing held. So no test depends on what ran before it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from antumbra.platform.launch.redis_server import LocalRedis, free_port
from antumbra.platform.launch.serve_cli import local_platform
from tests.faults.app import (
    FAULT_TOKEN,
    HOST_MODEL,
    MAX_MODEL_LEN,
    MAX_ONGOING,
    MAX_QUEUED,
    MODEL,
    TENANTS,
    FaultApp,
)
from tests.faults.injection import in_new_processes
from tests.waiting import wait_until


@pytest.fixture(scope="package")
def fault_app(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultApp]:
    redis = LocalRedis(data_dir=tmp_path_factory.mktemp("redis-data"))
    redis.start()
    model = {"path": str(tiny_checkpoint), "max_model_len": MAX_MODEL_LEN,
             "max_ongoing_requests": MAX_ONGOING, "max_queued_requests": MAX_QUEUED}
    config = {
        "redis_url": redis.url,
        "models": {
            MODEL: {**model, "replicas": 2},
            HOST_MODEL: {**model, "replicas": 1, "hisparse_rows_per_request": 16},
        },
        "stream_idle_timeout_s": 30,
    }
    try:
        # Every replica's engine, replacements included, raises on a step holding FAULT_TOKEN.
        with in_new_processes(f"raise={FAULT_TOKEN}") as started, \
                local_platform(config, port=free_port(), num_cpus=2, create_default_tenant=False) as running:
            started()
            keys = {}
            for tenant, limits in TENANTS.items():
                r = httpx.post(f"{running.base_url}/admin/tenants", json={"id": tenant, **limits},
                               headers={"Authorization": f"Bearer {running.admin_key}"}, timeout=30)
                assert r.status_code == 201, r.text
                keys[tenant] = r.json()["api_key"]
            yield FaultApp(running, redis, keys)
    finally:
        redis.stop()


@pytest.fixture
def app(fault_app: FaultApp) -> Iterator[FaultApp]:
    """The shared app in its known state: Redis up, both deployments at full strength, every engine
    idle and holding nothing (a previous test may have killed something)."""
    if not fault_app.redis.is_running():
        fault_app.redis.start()
    wait_until(lambda: httpx.get(f"{fault_app.url}/health", timeout=5).json()["status"] == "ok", 30,
               "Redis back in the ingress's view")
    for model, count in ((MODEL, 2), (HOST_MODEL, 1)):
        wait_until(lambda m=model, c=count: fault_app.running_replicas(m) == {"RUNNING": c}, 120,
                   f"{count} running replicas of {model}", poll_s=0.5)
        wait_until(
            lambda m=model, c=count: len(fault_app.replicas(m)) == c, 30, f"{model}'s replicas answering"
        )
        wait_until(lambda m=model: fault_app.settled(m), 30, f"{model}'s engines idle", poll_s=0.2)
        wait_until(lambda m=model, c=count: fault_app.gate(m)["capacity"] == c * MAX_ONGOING, 30,
                   f"the ingress's capacity gate to count {count} replicas of {model}", poll_s=0.2)
    yield fault_app

