"""The ingress's capacity gate: its share of the running slots, refreshed from Serve's controller, and
the slots other ingresses leave idle, borrowed through a real redis-server."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import AsyncIterator, Iterator
from functools import partial
from typing import Any

import pytest
from ray.serve._private.common import DeploymentStatus, ReplicaState

from antumbra.platform.ingress.admission import Admission
from antumbra.platform.ingress.capacity import CapacityWatch, RetryHint, Slots, capacity, over_capacity
from antumbra.platform.ingress.replica_stream import call_ended
from antumbra.platform.ingress.shared_slots import SharedSlots
from antumbra.platform.launch.redis_server import LocalRedis, free_port
from antumbra.platform.redis_client import redis_client


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    with LocalRedis(data_dir=tmp_path_factory.mktemp("capacity-redis")) as server:
        yield server


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _deployment(**states: int) -> dict[str, Any]:
    """A deployment as `ControllerDetails` gives it: its replicas with their states (enums, as Ray's
    controller answers, or plain strings)."""
    replicas: list[dict[str, Any]] = []
    for name, n in states.items():
        replicas += [{"state": ReplicaState(name)}] * n
    return {"name": "d", "status": DeploymentStatus.HEALTHY, "replicas": replicas}


def _status(model_replicas: dict[str, int], ingresses: int) -> dict[str, Any]:
    deployments = {"Ingress": _deployment(RUNNING=ingresses), "Model-m": _deployment(**model_replicas)}
    return {"applications": {"antumbra": {"name": "antumbra", "deployments": deployments}}}


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


def test_refusals_spread_their_retry_waits() -> None:
    hint, waits = RetryHint(random.Random(4)), []
    for _ in range(200):
        err = over_capacity("m", hint)
        wait_ms = int(err.headers["retry-after-ms"])
        assert err.status == 503 and err.type == "server_error" and 500 <= wait_ms <= 1500
        assert int(err.headers["Retry-After"]) == math.ceil(wait_ms / 1000)  # whole seconds, rounded up
        waits.append(wait_ms)
    assert min(waits) < 700 and max(waits) > 1300 and len(set(waits)) > 100  # a spread, not one second
    again = [int(over_capacity("m", RetryHint(random.Random(5))).headers["retry-after-ms"]) for _ in range(3)]
    assert len(set(again)) == 1  # the draw is the injected generator's
    assert RetryHint(random.Random(5), base_ms=4000, spread=0.0).headers() == {
        "Retry-After": "4", "retry-after-ms": "4000"}


async def _replica_call(ended: asyncio.Event, fail: bool = False) -> AsyncIterator[dict[str, Any]]:
    """A replica call as the ingress reads it: the finishing item, then the stream stays open until
    `ended` (Ray Serve counts the call on its replica until then)."""
    yield {"finish_reason": "stop"}
    await ended.wait()
    if fail:
        raise RuntimeError("the replica died after its last item")


@pytest.mark.parametrize("how", ["closes", "fails", "times_out"])
def test_the_capacity_slot_is_held_until_the_replica_call_ends(how: str) -> None:
    async def run() -> None:
        slots, tasks = Slots(capacity=1), set[asyncio.Task]()
        assert slots.take()
        ended = asyncio.Event()
        response = _replica_call(ended, fail=how == "fails")
        assert (await response.__anext__())["finish_reason"] == "stop"  # the generation finished
        admission = Admission(None, None, None, None, {}, on_settle=slots.release)
        timeout_s = 0.05 if how == "times_out" else 30.0
        admission.settle(10, tasks, partial(call_ended, response, timeout_s))
        await asyncio.sleep(0)
        assert slots.in_flight == 1 and not slots.take()  # Ray still counts the call: no new one yet
        if how != "times_out":
            ended.set()
        await asyncio.gather(*tasks)
        assert slots.in_flight == 0 and slots.take()
        admission.settle(10, tasks, partial(call_ended, response, timeout_s))  # settled once only
        await asyncio.gather(*tasks)
        assert slots.in_flight == 1

    asyncio.run(run())


def test_a_settle_without_a_call_gives_the_slot_back_at_once() -> None:
    async def run() -> None:
        slots, tasks = Slots(capacity=1), set[asyncio.Task]()
        assert slots.take()
        Admission(None, None, None, None, {}, on_settle=slots.release).settle(0, tasks)
        assert slots.in_flight == 0
        await asyncio.gather(*tasks)

    asyncio.run(run())


def test_the_watch_counts_running_replicas_only() -> None:
    slots = {"m": Slots(), "other": Slots()}
    watch = CapacityWatch(slots, {"m": "Model-m"}, {"m": 8, "other": 8}, "antumbra", "Ingress", dict)
    watch.apply(_status({"RUNNING": 2}, ingresses=1))
    assert slots["m"].capacity == 16 and slots["other"].capacity is None  # its deployment is unknown
    assert slots["m"].total == 16 and slots["other"].total is None
    watch.apply(_status({"RUNNING": 1, "STARTING": 1}, ingresses=2))  # one replica died, one starts
    assert slots["m"].capacity == 4 and slots["m"].total == 8
    watch.apply({"applications": {}})  # another app's status: nothing changes
    assert slots["m"].capacity == 4
    watch.apply(_status({"STARTING": 2}, ingresses=1))
    assert slots["m"].capacity is None
    as_text = {"applications": {"antumbra": {"deployments": {
        "Ingress": {"replicas": [{"state": "RUNNING"}]},
        "Model-m": {"replicas": [{"state": "RUNNING"}, {"state": "STOPPING"}]}}}}}
    watch.apply(as_text)
    assert slots["m"].capacity == 8 and slots["m"].total == 8


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


def test_an_ingress_past_its_share_borrows_only_what_the_others_leave_idle(redis_server: LocalRedis) -> None:
    """Two ingresses with a share of 2 of 4 slots: one that got the whole burst borrows the other's
    idle slots, never past the total; a silent ingress's count expires and is removed."""
    clock = Clock()

    async def body() -> None:
        client = redis_client(redis_server.url, timeout_s=0.5)
        try:
            await client.flushdb()
            a = SharedSlots(client, "test", "ingress-a", ttl_s=5.0, clock=clock)
            b = SharedSlots(client, "test", "ingress-b", ttl_s=5.0, clock=clock)
            busy, idle = Slots(capacity=2, total=4), Slots(capacity=2, total=4)
            await b.publish({"m": idle.in_flight})
            assert [await busy.take_or_borrow("m", a) for _ in range(4)] == [True, True, True, True]
            assert not await busy.take_or_borrow("m", a)  # 4 in flight of 4: nothing left to borrow
            assert busy.in_flight == 4
            busy.release()
            assert idle.take()  # the other ingress's own share is never borrowed away from it
            await b.publish({"m": idle.in_flight})
            assert not await busy.take_or_borrow("m", a)  # 3 here + 1 there: the total is full
            assert busy.in_flight == 3
            clock.now += 5.1  # b stopped publishing: its count no longer holds slots
            assert await busy.take_or_borrow("m", a)
            assert await client.hkeys(a.key("m")) == [b"ingress-a"]
            assert not await busy.take_or_borrow("m", a)  # 4 of 4 again
            assert not await busy.take_or_borrow("m", None)  # no shared counts: the share alone decides
            assert 0 < await client.pttl(a.key("m")) <= 5000  # stopped platforms leave nothing behind
        finally:
            await client.aclose()

    asyncio.run(body())


def test_redis_away_means_no_borrowing() -> None:
    async def body() -> None:
        client = redis_client(f"redis://127.0.0.1:{free_port()}", timeout_s=0.2)
        try:
            shared = SharedSlots(client, "test", "ingress-a")
            await shared.publish({"m": 1})  # logged, not raised
            slots = Slots(capacity=1, total=8)
            assert await slots.take_or_borrow("m", shared)
            assert not await slots.take_or_borrow("m", shared)
            assert slots.in_flight == 1
        finally:
            await client.aclose()

    asyncio.run(body())
