"""Refusing what the replicas cannot start now, instead of queueing it: the ingress's capacity gate.

Ray Serve queues a request in the handle while every replica runs `max_ongoing_requests`, and
refuses only past `max_queued_requests`. A queued request waits for a whole generation to end,
so under overload every admitted request would pay that wait in its TTFT. The gate admits a
generation only while this ingress has fewer than its share of the model's slots in flight:

    capacity = ceil(RUNNING model replicas x max_ongoing_requests / RUNNING ingress replicas)

and answers the rest at once with a 503 and `Retry-After` (before any rate limit is charged),
unless the slots other ingresses leave idle let it borrow one (`shared_slots.py`: the proxy in
front may spread a burst unevenly over the ingress replicas).
It is for models with a fixed number of replicas (`launch.app` leaves autoscaled ones out: their
demand beyond the running replicas must show in Ray's queue for the autoscaler to see it).
`CapacityWatch` refreshes the replica counts from Serve's controller every `refresh_s` in a thread
(`ControllerDetails`: the answer behind `serve.status()` without the pydantic models it builds,
whose tens of milliseconds of Python a call would hold the GIL from the ingress's loop each second);
until the first answer, for a model whose deployment it cannot find, and while none of a
model's replicas runs (its first start, or all of them replaced: then Ray's queue holds requests
for the replica to come), the gate is open. A generation holds its slot until its replica call has
ended as Ray Serve counts it (the stream closed after its last item; `replica_stream.call_ended`):
a slot given back at the last item would admit a request that Ray's router finds no free replica
for, and that request waits out the router's backoff. A retry on another replica keeps the slot.
Ray's own queue stays behind the gate for what the shares, the counts' lag (at most `refresh_s`
plus the status call) and the routing moment leave over.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from antumbra.platform.ingress.openai_errors import ApiError, unavailable
from antumbra.platform.ingress.shared_slots import SharedSlots

log = logging.getLogger(__name__)


@dataclass
class Slots:
    """One model's generations in flight at this ingress and how many it may have (None: no limit);
    `total`: the model's running slots over all ingresses (what borrowing may fill)."""

    capacity: int | None = None
    in_flight: int = 0
    total: int | None = None

    def take(self) -> bool:
        if self.capacity is not None and self.in_flight >= self.capacity:
            return False
        self.in_flight += 1
        return True

    async def take_or_borrow(self, model: str, shared: SharedSlots | None) -> bool:
        """`take`, or past the share one of the slots other ingresses leave idle (`shared_slots`)."""
        if self.take():
            return True
        if shared is None or self.total is None or not await shared.may_borrow(model, self.in_flight,
                                                                                 self.total):
            return False
        self.in_flight += 1
        return True

    def release(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)


@dataclass(frozen=True)
class RetryHint:
    """When a refused client should come back: `base_ms` moved by a uniform draw within `spread` of
    it, sent as `retry-after-ms` (which the official OpenAI clients read first) and as `Retry-After`
    in whole seconds, rounded up. Clients refused in one burst that all waited the same second would
    come back in one burst and be refused in one again, each burst delaying the admitted requests'
    first tokens; a spread of their waits turns the bursts into a steady trickle."""

    rng: random.Random
    base_ms: int = 1000
    spread: float = 0.5  # the wait lies in [base_ms * (1 - spread), base_ms * (1 + spread)]

    def headers(self) -> dict[str, str]:
        wait_ms = round(self.base_ms * (1.0 + self.spread * (2.0 * self.rng.random() - 1.0)))
        return {"Retry-After": str(max(1, math.ceil(wait_ms / 1000))), "retry-after-ms": str(wait_ms)}


def over_capacity(model: str, hint: RetryHint) -> ApiError:
    err = unavailable(f"the model `{model}` is at capacity; retry shortly")
    err.headers = hint.headers()
    return err


def total_slots(model_replicas: int, max_ongoing: int) -> int | None:
    """The model's running slots over all ingresses; None (no gate) while no replica runs."""
    return model_replicas * max_ongoing if model_replicas > 0 else None


def capacity(model_replicas: int, max_ongoing: int, ingress_replicas: int) -> int | None:
    """This ingress's share of the model's slots (at least one); None (no gate) while no replica runs."""
    if model_replicas <= 0:
        return None
    return max(1, math.ceil(model_replicas * max_ongoing / max(1, ingress_replicas)))


class ControllerDetails:
    """Serve's view of every application (`ServeInstanceDetails`' fields, as plain data), asked of
    Serve's controller actor as `serve.status()` asks it, without the pydantic models
    `serve.status()` then builds: tens of milliseconds of Python a call, which on the watch's
    thread would hold the GIL from the ingress's loop every second. The actor's name and namespace
    are Serve's own (`ray.serve` keeps its constants private); the faults tests read the gate's
    capacity through this call on a live cluster."""

    NAME, NAMESPACE = "SERVE_CONTROLLER_ACTOR", "serve"

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self._controller: Any = None

    def __call__(self) -> Mapping[str, Any]:
        import ray

        if self._controller is None:
            self._controller = ray.get_actor(self.NAME, namespace=self.NAMESPACE)
        try:
            return ray.get(self._controller.get_serve_instance_details.remote(), timeout=self.timeout_s)
        except Exception:
            self._controller = None  # looked up again next time: the controller may have been replaced
            raise


def _running(deployment: Mapping[str, Any] | None) -> int:
    """RUNNING replicas of one deployment of a `ControllerDetails` answer."""
    replicas = (deployment or {}).get("replicas") or []
    return sum(1 for r in replicas if str(getattr(r.get("state"), "value", r.get("state"))) == "RUNNING")


class CapacityWatch:
    """Keeps each model's `Slots.capacity` current (module docstring); `status` is `ControllerDetails`."""

    def __init__(
        self,
        slots: Mapping[str, Slots],
        deployments: Mapping[str, str],  # model -> its Serve deployment
        max_ongoing: Mapping[str, int],  # model -> max_ongoing_requests per replica
        app_name: str,
        ingress_deployment: str,
        status: Callable[[], Mapping[str, Any]],
        refresh_s: float = 1.0,
        shared: SharedSlots | None = None,
    ) -> None:
        self.slots = slots
        self.deployments = deployments
        self.max_ongoing = max_ongoing
        self.app_name = app_name
        self.ingress_deployment = ingress_deployment
        self.status = status
        self.refresh_s = refresh_s
        self.shared = shared

    def apply(self, details: Mapping[str, Any]) -> None:
        """Set every known model's capacity from one `ControllerDetails` answer."""
        app = (details.get("applications") or {}).get(self.app_name)
        if app is None:
            return
        deployments = app.get("deployments") or {}
        ingresses = _running(deployments.get(self.ingress_deployment))
        for model, slots in self.slots.items():
            deployment = deployments.get(self.deployments.get(model, ""))
            if deployment is not None and model in self.max_ongoing:
                running = _running(deployment)
                slots.capacity = capacity(running, self.max_ongoing[model], ingresses)
                slots.total = total_slots(running, self.max_ongoing[model])

    async def run(self) -> None:
        while True:
            try:
                self.apply(await asyncio.to_thread(self.status))
            except Exception as exc:  # the controller is busy or restarting: keep the last counts
                log.debug("could not read the replica counts: %r", exc)
            if self.shared is not None:
                gated = {model: s.in_flight for model, s in self.slots.items() if s.total is not None}
                await self.shared.publish(gated)
            await asyncio.sleep(self.refresh_s)


def start_watch(
    slots: Mapping[str, Slots],
    deployments: Mapping[str, str],
    max_ongoing: Mapping[str, int],
    redis: Redis,
    key_prefix: str,
    refresh_s: float,
) -> tuple[SharedSlots, asyncio.Task]:
    """In an ingress replica: its counts shared under its Serve replica id, and the watch's task."""
    from ray import serve

    replica = serve.get_replica_context().replica_id
    shared = SharedSlots(redis, key_prefix, replica.unique_id)
    here = replica.deployment_id
    watch = CapacityWatch(slots, deployments, max_ongoing, here.app_name, here.name, ControllerDetails(),
                          refresh_s, shared)
    return shared, asyncio.get_running_loop().create_task(watch.run())
