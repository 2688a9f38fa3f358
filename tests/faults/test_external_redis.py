"""An external Redis (the fault app's, given as `redis_url`) that dies is reported, never restarted:
the platform only restarts a Redis it started itself."""

from __future__ import annotations

import httpx

from antumbra.platform.launch.redis_server import HOST, ping
from tests.faults.app import FaultApp
from tests.waiting import wait_until

WATCH_S = 3.0  # many rounds of a supervisor's 0.2 s poll, had there been one


def test_an_external_redis_is_reported_and_not_restarted(app: FaultApp) -> None:
    assert app.running.redis_supervisor is None
    assert httpx.get(f"{app.url}/health", timeout=10).json()["redis_owner"] == "external"
    app.redis.kill()
    try:
        wait_until(lambda: httpx.get(f"{app.url}/health", timeout=10).json()["status"] == "degraded", 30,
                   "the ingress to report the outage")
        wait_until(lambda: httpx.get(f"{app.url}/health", timeout=10).json()["redis_down_s"] >= WATCH_S, 30,
                   f"{WATCH_S} s of the outage seen by the ingress")
        assert not ping(HOST, app.redis.port), "something restarted the external Redis"
        health = httpx.get(f"{app.url}/health", timeout=10).json()
        assert health["redis"] == "unavailable" and health["redis_owner"] == "external", health
        assert health["redis_down_s"] >= WATCH_S, health
    finally:
        app.redis.start()
