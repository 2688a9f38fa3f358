"""How fast autoscaling follows load: one replica to two under load and back, CPU.

The platform as `antumbra serve` runs it (`serve_cli.local_platform`: Ray Serve, a local
redis-server, the tiny checkpoint) with our `queue_depth` policy (`platform/control/autoscaling.py`)
at one ongoing request per replica and short delays (`AUTOSCALING`, the same as
`tests/platform/control/test_autoscaling_live.py`). Two streams of completions that never pause
want two replicas; once they stop, one is enough. Measured: seconds from the load's start until
the second replica runs, and from its end until one is left; requests served meanwhile.

The configured delays are a floor (the policy must see the load that long), so the ratios to them
say how much the metrics pipeline, the controller and the replica's start add on top.

    python -m benchmarks run platform --only autoscaling [--smoke]
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from ..lib.context import Context

DEVICE = "cpu"

MODEL = "tiny"
STREAMS = 2
MAX_TOKENS = 48
AUTOSCALING = {
    "policy": "queue_depth",
    "policy_kwargs": {"target_ongoing_requests": 1},
    "min_replicas": 1,
    "max_replicas": 2,
    "initial_replicas": 1,
    "upscale_delay_s": 2.0,
    "downscale_delay_s": 4.0,
    "look_back_period_s": 3.0,
    "metrics_interval_s": 0.5,
}


def _running_replicas() -> int:
    from ray import serve

    from antumbra.platform.launch.app import model_deployment_name
    from antumbra.platform.launch.serve_cli import APP_NAME

    status = serve.status().applications[APP_NAME].deployments[model_deployment_name(MODEL)]
    return status.replica_states.get("RUNNING", 0)


def _seconds_until(predicate: Callable[[], bool], timeout_s: float) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"not reached within {timeout_s} s")
        time.sleep(0.25)
    return time.monotonic() - started


class _Load:
    """`STREAMS` threads, each sending one streaming completion after another until stopped."""

    def __init__(self, base_url: str, api_key: str) -> None:
        self.url = f"{base_url}/v1/completions"
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.stop = threading.Event()
        self.ok = 0
        self.failed = 0
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(STREAMS)]

    def _run(self) -> None:
        body = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "stream": True}
        while not self.stop.is_set():
            try:
                with httpx.stream("POST", self.url, json=body, headers=self.headers, timeout=120) as response:
                    done = response.status_code == 200 and any(
                        line == "data: [DONE]" for line in response.iter_lines()
                    )
            except httpx.HTTPError:
                done = False
            if done:
                self.ok += 1
            else:
                self.failed += 1

    def __enter__(self) -> _Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)


def measure(model_dir: Path) -> dict[str, Any]:
    from antumbra.platform.launch.redis_server import free_port
    from antumbra.platform.launch.serve_cli import local_platform

    config = {"models": {MODEL: {"path": str(model_dir), "autoscaling": AUTOSCALING}}}
    with local_platform(config, port=free_port(), num_cpus=2) as platform:
        assert platform.api_key is not None
        _seconds_until(lambda: _running_replicas() == 1, 60)
        with _Load(platform.base_url, platform.api_key) as load:
            scale_up_s = _seconds_until(lambda: _running_replicas() == 2, 180)
            requests_at_two = load.ok
        scale_down_s = _seconds_until(lambda: _running_replicas() == 1, 180)
    return {
        "scale_up_s": scale_up_s,
        "scale_down_s": scale_down_s,
        "requests_ok": load.ok,
        "requests_failed": load.failed,
        "requests_before_second_replica": requests_at_two,
        "checks_ok": load.failed == 0,
        "ratios": {
            "scale_up_vs_upscale_delay": scale_up_s / AUTOSCALING["upscale_delay_s"],
            "scale_down_vs_downscale_delay": scale_down_s / AUTOSCALING["downscale_delay_s"],
        },
    }


def run(ctx: Context) -> dict[str, Any]:
    """One scale-up and one scale-down, in a smoke run too: it is the shortest this can be."""
    from antumbra.replicas.model.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        figures = measure(make_tiny_checkpoint(Path(tmp) / "tiny"))
    return {"autoscaling": AUTOSCALING, "streams": STREAMS, "max_tokens": MAX_TOKENS, **figures}
