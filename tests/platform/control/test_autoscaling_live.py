"""Autoscaling, live: load scales a model from one replica to two, and back to one once it stops.

Real Ray Serve, a real redis-server and the tiny model; the model deployment runs our
`queue_depth` policy (`antumbra.platform.control.autoscaling`) with a target of one ongoing request per
replica. The load is two streams that never pause: our policy then wants two replicas, while Ray
Serve's default policy (two ongoing requests per replica) would keep one, so the scale-up shows
that our policy is the one deciding.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from antumbra.platform.launch.redis_server import free_port
from antumbra.platform.launch.serve_cli import RunningPlatform, local_platform
from tests.platform.control.live import FAST_AUTOSCALING, StreamLoad, controller_metrics, running_replicas
from tests.waiting import wait_until

MODEL = "tiny"
STREAMS = 2
TARGET_ONGOING_REQUESTS = 1
MAX_TOKENS = 48
AUTOSCALING = {
    "policy": "queue_depth",
    "policy_kwargs": {"target_ongoing_requests": TARGET_ONGOING_REQUESTS},
    **FAST_AUTOSCALING,
}
CUSTOM_METRICS = {"kv_use_virtual", "kv_use_swa", "queue_len"}  # what record_autoscaling_stats always reports


@pytest.fixture(scope="module")
def platform(tiny_checkpoint: Path) -> Iterator[RunningPlatform]:
    config = {"models": {MODEL: {"path": str(tiny_checkpoint), "autoscaling": AUTOSCALING}}}
    with local_platform(config, port=free_port(), num_cpus=2) as running:
        assert running.api_key is not None
        yield running


def test_load_scales_a_model_to_two_replicas_and_back(platform: RunningPlatform) -> None:
    wait_until(lambda: running_replicas(MODEL) == 1, 60, "the initial replica")
    assert platform.api_key is not None
    load = StreamLoad(platform.base_url, platform.api_key, MODEL, STREAMS, MAX_TOKENS)
    load.start()
    try:
        wait_until(lambda: running_replicas(MODEL) == 2, 120, "a second replica under load", poll_s=0.5)
        # Both replicas push what their `record_autoscaling_stats` returns to the controller.
        wait_until(
            lambda: all(len(controller_metrics(MODEL).get(name, [])) == 2 for name in CUSTOM_METRICS),
            30,
            "custom metrics from both replicas",
            poll_s=0.5,
        )
        assert running_replicas(MODEL) == 2  # held while the load lasts
    finally:
        load.finish()
    wait_until(lambda: running_replicas(MODEL) == 1, 120, "one replica once the load stopped", poll_s=0.5)

    assert not load.failures(), load.failures()
    assert len(load.outcomes) >= STREAMS
    # How long each transition takes against the configured delays is measured in
    # benchmarks/serving/autoscaling.py; the waits above only guard against a scale that never happens.
