"""The ingress's capacity gate: its share of the running slots, refreshed from Serve's status."""

from __future__ import annotations

from ray.serve._private.common import DeploymentStatus, DeploymentStatusTrigger, ReplicaState
from ray.serve.schema import (
    ApplicationStatus,
    ApplicationStatusOverview,
    DeploymentStatusOverview,
    ServeStatus,
)

from antumbra.platform.ingress.capacity import CapacityWatch, Slots, capacity, over_capacity


def _deployment(**states: int) -> DeploymentStatusOverview:
    return DeploymentStatusOverview(
        status=DeploymentStatus.HEALTHY,
        status_trigger=DeploymentStatusTrigger.CONFIG_UPDATE_COMPLETED,
        replica_states={ReplicaState(name): n for name, n in states.items()},
        message="",
    )


def _status(model_replicas: dict[str, int], ingresses: int) -> ServeStatus:
    deployments = {"Ingress": _deployment(RUNNING=ingresses), "Model-m": _deployment(**model_replicas)}
    app = ApplicationStatusOverview(status=ApplicationStatus.RUNNING, message="", last_deployed_time_s=0.0,
                                    deployments=deployments)
    return ServeStatus(applications={"antumbra": app})


def test_the_share_of_slots() -> None:
    assert capacity(2, 8, 1) == 16
    assert capacity(2, 8, 3) == 6  # rounded up: the shares may overbook, Ray's queue takes the rest
    assert capacity(1, 1, 4) == 1  # a running replica always leaves every ingress a slot
    assert capacity(0, 8, 1) is None  # no replica running yet: Ray's queue holds requests for one
    assert capacity(3, 4, 0) == 12


def test_slots_refuse_at_capacity_and_come_back_on_release() -> None:
    slots = Slots()
    assert all(slots.take() for _ in range(100))  # no capacity known yet: the gate is open
    slots = Slots(capacity=2)
    assert slots.take() and slots.take() and not slots.take()
    slots.release()
    assert slots.take() and slots.in_flight == 2
    slots.release(), slots.release(), slots.release()
    assert slots.in_flight == 0
    err = over_capacity("m")
    assert err.status == 503 and err.headers == {"Retry-After": "1"} and err.type == "server_error"


def test_the_watch_counts_running_replicas_only() -> None:
    slots = {"m": Slots(), "other": Slots()}
    watch = CapacityWatch(slots, {"m": "Model-m"}, {"m": 8, "other": 8}, "antumbra", "Ingress", lambda: None)
    watch.apply(_status({"RUNNING": 2}, ingresses=1))
    assert slots["m"].capacity == 16 and slots["other"].capacity is None  # its deployment is unknown
    watch.apply(_status({"RUNNING": 1, "STARTING": 1}, ingresses=2))  # one replica died, one starts
    assert slots["m"].capacity == 4
    watch.apply(ServeStatus(applications={}))  # another app's status: nothing changes
    assert slots["m"].capacity == 4
    watch.apply(_status({"STARTING": 2}, ingresses=1))
    assert slots["m"].capacity is None


def test_the_gate_is_for_models_with_fixed_replicas() -> None:
    from antumbra.platform.launch.app import PlatformConfig

    config = PlatformConfig.from_dict({"redis_url": "redis://x", "models": {
        "fixed": {"path": "p", "replicas": 2, "max_ongoing_requests": 8},
        "scaled": {"path": "p", "autoscaling": {"policy": "queue_depth", "max_replicas": 3}},
    }})
    settings = config.ingress_settings()
    assert settings.model_max_ongoing == {"fixed": 8}  # the autoscaler must see the queue of the other
    assert settings.model_deployments == {"fixed": "Model-fixed", "scaled": "Model-scaled"}
    off = PlatformConfig.from_dict({"redis_url": "redis://x", "capacity_gate": False,
                                    "models": {"m": {"path": "p"}}})
    assert off.ingress_settings().model_max_ongoing == {}
