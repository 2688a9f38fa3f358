"""Autoscaling, live: load scales a model from one replica to two, and back to one once it stops.

Real Ray Serve, a real redis-server and the tiny model; the model deployment runs our
`queue_depth` policy (`antumbra.platform.control.autoscaling`) with a target of one ongoing request per
replica. The load is two streams that never pause: our policy then wants two replicas, while Ray
Serve's default policy (two ongoing requests per replica) would keep one, so the scale-up shows
that our policy is the one deciding.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from antumbra.platform.launch.app import model_deployment_name
from antumbra.platform.launch.redis_server import free_port
from antumbra.platform.launch.serve_cli import APP_NAME, RunningPlatform, local_platform
from tests.waiting import wait_until

MODEL = "tiny"
STREAMS = 2
TARGET_ONGOING_REQUESTS = 1
MAX_TOKENS = 48
# Short windows and delays so one test sees both transitions in about a minute.
AUTOSCALING = {
    "policy": "queue_depth",
    "policy_kwargs": {"target_ongoing_requests": TARGET_ONGOING_REQUESTS},
    "min_replicas": 1,
    "max_replicas": 2,
    "initial_replicas": 1,
    "upscale_delay_s": 2.0,
    "downscale_delay_s": 4.0,
    "look_back_period_s": 3.0,
    "metrics_interval_s": 0.5,
}
CUSTOM_METRICS = {"kv_use_virtual", "kv_use_swa", "queue_len"}  # what record_autoscaling_stats always reports


@pytest.fixture(scope="module")
def platform(tiny_checkpoint: Path) -> Iterator[RunningPlatform]:
    config = {"models": {MODEL: {"path": str(tiny_checkpoint), "autoscaling": AUTOSCALING}}}
    with local_platform(config, port=free_port(), num_cpus=2) as running:
        assert running.api_key is not None
        yield running


def running_replicas() -> int:
    from ray import serve

    status = serve.status().applications[APP_NAME].deployments[model_deployment_name(MODEL)]
    return status.replica_states.get("RUNNING", 0)


def controller_metrics() -> dict[str, list]:
    """The replica metrics the Serve controller holds for the model: one time series per replica and name."""
    import ray
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    deployment = DeploymentID(name=model_deployment_name(MODEL), app_name=APP_NAME)
    return dict(ray.get(controller._get_metrics_for_deployment_for_testing.remote(deployment)))


@dataclass
class Load:
    """`STREAMS` threads, each sending one streaming completion after another until stopped."""

    platform: RunningPlatform
    stop: threading.Event = field(default_factory=threading.Event)
    outcomes: list[str] = field(default_factory=list)  # "ok" or what went wrong, per request
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(STREAMS)]
        for thread in self.threads:
            thread.start()

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)
        assert not any(t.is_alive() for t in self.threads), "a load thread hung"

    def _run(self, stream: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                self.outcomes.append(self._one(f"stream {stream}, request {n}: tell me a long story"))
            except httpx.HTTPError as exc:
                self.outcomes.append(f"{type(exc).__name__}: {exc}")

    def _one(self, prompt: str) -> str:
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {"Authorization": f"Bearer {self.platform.api_key}"}
        url = f"{self.platform.base_url}/v1/completions"
        with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as response:
            if response.status_code != 200:
                return f"HTTP {response.status_code}: {response.read()!r}"
            events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return f"stream did not end with [DONE]: {events[-2:]}"
        chunks = [json.loads(e) for e in events[:-1]]
        if any("error" in c for c in chunks):
            return f"error event: {chunks[-1]}"
        usage = chunks[-1].get("usage") or {}
        if usage.get("completion_tokens") != MAX_TOKENS:
            return f"usage {usage}"
        return "ok"


def test_load_scales_a_model_to_two_replicas_and_back(platform: RunningPlatform) -> None:
    wait_until(lambda: running_replicas() == 1, 60, "the initial replica")
    load = Load(platform)
    load.start()
    try:
        wait_until(lambda: running_replicas() == 2, 120, "a second replica under load", poll_s=0.5)
        # Both replicas push what their `record_autoscaling_stats` returns to the controller.
        wait_until(
            lambda: all(len(controller_metrics().get(name, [])) == 2 for name in CUSTOM_METRICS),
            30,
            "custom metrics from both replicas",
            poll_s=0.5,
        )
        assert running_replicas() == 2  # held while the load lasts
    finally:
        load.finish()
    wait_until(lambda: running_replicas() == 1, 120, "one replica once the load stopped", poll_s=0.5)

    failures = [o for o in load.outcomes if o != "ok"]
    assert not failures, failures
    assert len(load.outcomes) >= STREAMS
    # How long each transition takes against the configured delays is measured in
    # benchmarks/serving/autoscaling.py; the waits above only guard against a scale that never happens.
