"""What the live autoscaling tests share: the running replica count, the replica metrics the Serve
controller holds, and a load of streaming completions that never pause until stopped."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field

import httpx

from antumbra.platform.launch.app import model_deployment_name
from antumbra.platform.launch.serve_cli import APP_NAME

# Short windows and delays so one test sees both transitions in about a minute.
FAST_AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "initial_replicas": 1,
    "upscale_delay_s": 2.0,
    "downscale_delay_s": 4.0,
    "look_back_period_s": 3.0,
    "metrics_interval_s": 0.5,
}


def running_replicas(model: str) -> int:
    from ray import serve

    status = serve.status().applications[APP_NAME].deployments[model_deployment_name(model)]
    return int(status.replica_states.get("RUNNING", 0))


def controller_metrics(model: str) -> dict[str, list]:
    """The replica metrics the Serve controller holds for the model: one time series per replica and name."""
    import ray
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    deployment = DeploymentID(name=model_deployment_name(model), app_name=APP_NAME)
    return dict(ray.get(controller._get_metrics_for_deployment_for_testing.remote(deployment)))


def metric_values(model: str, name: str) -> list[float]:
    """Every value of one metric the controller holds for the model, over all its replicas."""
    return [float(point.value) for series in controller_metrics(model).get(name, []) for point in series]


@dataclass
class StreamLoad:
    """`streams` threads, each sending one streaming completion of `max_tokens` after another until
    stopped; each request's outcome is "ok" or what went wrong."""

    base_url: str
    api_key: str
    model: str
    streams: int
    max_tokens: int
    stop: threading.Event = field(default_factory=threading.Event)
    outcomes: list[str] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.streams)
        ]
        for thread in self.threads:
            thread.start()

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)
        assert not any(t.is_alive() for t in self.threads), "a load thread hung"

    def failures(self) -> list[str]:
        return [o for o in self.outcomes if o != "ok"]

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
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {"Authorization": f"Bearer {self.api_key}"}
        url = f"{self.base_url}/v1/completions"
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
        if usage.get("completion_tokens") != self.max_tokens:
            return f"usage {usage}"
        return "ok"
