"""The model server with its engine in a process of its own (`engine_process=True`), without Ray:
the same tokens and logprobs as the engine in this process, bad input refused with nothing lost,
a consumer that stops reading aborts its request there, a failed step or a stopped engine gives
the items an in-process engine gives, and a killed engine process ends every open request and
the health check; a replica that dies takes its engine process with it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from antumbra.config import SchedulerConfig
from antumbra.platform.messages import (
    ENGINE_ERROR,
    REPLICA_UNAVAILABLE,
    GenerateRequest,
    ReplicaQuery,
    WeightsUpdate,
)
from antumbra.platform.replica.engine_wire import OutputAccumulator, decode_error, delta_of, encode_error
from antumbra.platform.replica.model_server import ModelServer
from antumbra.replicas.engine import Engine
from antumbra.replicas.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from antumbra.replicas.sampling_params import SamplingParams
from tests.checkpoint_edits import checkpoint_with_new_head
from tests.faults.injection import in_new_processes
from tests.waiting import wait_until

RAISE, FATAL = 6, 5
SCHEDULER = SchedulerConfig(max_model_len=512)
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
PROMPTS = [[7, 8, 9], [11, 12, 13, 14, 15], list(range(20, 160)), [3]]


def _server(tiny_checkpoint: Path, *faults: str) -> ModelServer:
    with in_new_processes(*faults) if faults else contextlib.nullcontext(lambda: None) as started:
        server = ModelServer("tiny", str(tiny_checkpoint), engine_kwargs={"scheduler": SCHEDULER},
                             engine_process=True)
        started()
    return server


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path):  # type: ignore[no-untyped-def]
    server = _server(tiny_checkpoint, f"raise={RAISE}")
    yield server
    server.engine.close()


def _items(server: ModelServer, request_id: str, token_ids: list[int],
           params: SamplingParams = PARAMS) -> list[dict]:
    async def collect() -> list[dict]:
        request = GenerateRequest(request_id, token_ids, params, namespace="tiny:test")
        return [dict(item) async for item in server.generate(request)]

    return asyncio.run(collect())


def _together(server: ModelServer, prompts: list[list[int]]) -> list[list[dict]]:
    async def one(i: int, prompt: list[int]) -> list[dict]:
        request = GenerateRequest(f"cmpl-{i}", prompt, PARAMS, namespace="tiny:test")
        return [dict(item) async for item in server.generate(request)]

    async def all_of() -> list[list[dict]]:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    return asyncio.run(all_of())


def test_it_streams_the_in_process_engines_tokens_and_logprobs(server: ModelServer,
                                                               tiny_checkpoint: Path) -> None:
    want = Engine.from_pretrained(tiny_checkpoint, scheduler=SCHEDULER).generate(PROMPTS, PARAMS)
    got = _together(server, PROMPTS)
    for items, out in zip(got, want, strict=True):
        assert [t for item in items for t in item["token_ids"]] == out.token_ids
        streamed = [dict(pairs) for item in items for pairs in item["logprobs"]]
        assert out.logprobs is not None and [d.keys() for d in streamed] == [d.keys() for d in out.logprobs]
        # The two engines may batch the prompts apart, which moves float32 sums in the last places.
        assert [list(d.values()) for d in streamed] == [
            pytest.approx(list(d.values()), abs=1e-5) for d in out.logprobs]
        assert "".join(item["text"] for item in items) == out.text
        assert items[-1]["finish_reason"] == "length" and items[-1]["completion_tokens"] == 6
    state = asyncio.run(server.replica_state(ReplicaQuery(check_integrity=True)))
    assert state["integrity"] is None and state["request_ids"] == []
    assert state["engine_pid"] != state["pid"] == os.getpid()
    assert state["stats"]["engine_process_gil_switch_interval_us"] == pytest.approx(5000)  # Python's own


def test_the_engine_process_takes_the_gil_interval_and_freezes_its_heap(tiny_checkpoint: Path) -> None:
    interval_s = sys.getswitchinterval()  # the replica's side sets this test process's too
    try:
        server = ModelServer("tiny", str(tiny_checkpoint), engine_kwargs={"scheduler": SCHEDULER},
                             engine_process=True, gil_switch_interval_s=1e-4, freeze_heap=True)
        stats = asyncio.run(server.engine_stats())
        assert stats["engine_process_gil_switch_interval_us"] == pytest.approx(100, abs=1)
        assert stats["engine_process_gc_frozen_objects"] > 10_000
        assert _items(server, "cmpl-frozen", PROMPTS[0])[-1]["finish_reason"] == "length"
        # The engine process's threads by name, not this process's.
        names = asyncio.run(server.engine_thread_names())
        assert {"engine-driver", "engine-output", "engine-outputs", "MainThread"} <= set(names.values())
        assert threading.get_native_id() not in names
        server.engine.close()
    finally:
        gc.unfreeze()  # the replica's side froze this test process's heap (heap.py)
        sys.setswitchinterval(interval_s)


def test_bad_input_is_refused_and_loses_nothing(server: ModelServer) -> None:
    before = _items(server, "cmpl-before", PROMPTS[0])
    bad = _items(server, "cmpl-bad", [10**9])
    assert len(bad) == 1 and bad[0]["status"] == 400 and bad[0]["error"]["param"] == "prompt"
    failed = _items(server, "cmpl-poisoned", [7, RAISE, 8])  # the engine process's fault hook
    assert failed[0]["status"] == 500 and failed[0]["error"]["code"] == ENGINE_ERROR
    assert "cmpl-poisoned" in failed[0]["error"]["message"]
    after = _items(server, "cmpl-after", PROMPTS[0])
    assert [i["token_ids"] for i in after] == [i["token_ids"] for i in before]
    asyncio.run(server.check_health())
    server.engine.check_integrity()
    assert server.engine.request_ids() == []


def test_a_consumer_that_stops_reading_aborts_its_request(server: ModelServer) -> None:
    long_run = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def read_two() -> None:
        request = GenerateRequest("cmpl-dropped", PROMPTS[1], long_run, namespace="tiny:test")
        stream = server.generate(request)
        await anext(stream)
        assert server.engine.request_ids() == ["cmpl-dropped"]
        await stream.aclose()

    asyncio.run(read_two())
    wait_until(lambda: server.engine.request_ids() == [], 10, "the engine process to abort the request")
    server.engine.check_integrity()


def test_a_stopped_engine_answers_503_and_fails_its_health_check(tiny_checkpoint: Path) -> None:
    server = _server(tiny_checkpoint, f"fatal={FATAL}")
    try:
        first = _items(server, "cmpl-fatal", [7, FATAL, 8])
        assert first[0]["status"] == 503 and first[0]["error"]["code"] == REPLICA_UNAVAILABLE
        with pytest.raises(EngineDeadError):
            asyncio.run(server.check_health())
    finally:
        server.engine.close()


def test_a_killed_engine_process_ends_open_requests_and_the_health_check(tiny_checkpoint: Path) -> None:
    server = _server(tiny_checkpoint)
    long_run = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def killed_mid_stream() -> list[dict]:
        request = GenerateRequest("cmpl-open", PROMPTS[1], long_run, namespace="tiny:test")
        items = []
        async for item in server.generate(request):
            items.append(dict(item))
            if len(items) == 2:
                os.kill(server.engine.pid, signal.SIGKILL)
        return items

    items = asyncio.run(killed_mid_stream())
    assert items[-1]["status"] == 503 and items[-1]["error"]["code"] == REPLICA_UNAVAILABLE
    with pytest.raises(EngineDeadError, match="status -9"):
        asyncio.run(server.check_health())
    assert _items(server, "cmpl-later", PROMPTS[0])[0]["status"] == 503
    with pytest.raises(EngineDeadError):
        server.engine.submit(PROMPTS[0], PARAMS, lambda item: None, "cmpl-refused")
    assert server.engine.abort("cmpl-refused") is False  # never admitted, nothing left open


def test_a_replica_that_dies_takes_its_engine_process_with_it(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The replica's process (here a child of the test) is killed while its engine serves; the
    engine process notices its parent is gone and exits."""
    script = textwrap.dedent(f"""
        from antumbra.platform.replica.model_server import ModelServer
        server = ModelServer("tiny", {str(tiny_checkpoint)!r}, engine_process=True)
        print(server.engine.pid, flush=True)
        input()
    """)
    replica = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, cwd=Path(__file__).resolve().parents[3])
    assert replica.stdout is not None
    engine_pid = int(replica.stdout.readline())
    assert _alive(engine_pid)
    replica.kill()
    replica.wait()
    wait_until(lambda: not _alive(engine_pid), 15, "the engine process to exit after its replica")


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped by its new parent, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_deltas_rebuild_the_snapshots_and_a_lost_one_is_caught(tiny_checkpoint: Path) -> None:
    engine = Engine.from_pretrained(tiny_checkpoint, scheduler=SCHEDULER)
    snapshots = []
    rid = engine.submit(PROMPTS[0], PARAMS, snapshots.append)
    wait_until(lambda: bool(snapshots) and snapshots[-1].finished, 60, "the request to finish")
    assert len(snapshots) >= 2
    rebuilt = OutputAccumulator(rid, PROMPTS[0])
    for out in snapshots:
        again = rebuilt.apply(delta_of(out))
        assert (again.token_ids, again.logprobs, again.finish_reason) == (out.token_ids, out.logprobs,
                                                                         out.finish_reason)
    lossy = OutputAccumulator(rid, PROMPTS[0])
    with pytest.raises(ValueError, match="tokens rebuilt"):
        lossy.apply(delta_of(snapshots[1]))


@pytest.mark.parametrize("error", [InvalidRequestError("no such thing", "prompt"), EngineDeadError("gone"),
                                   RequestFailedError("cmpl-1", "a step raised"), AssertionError("pools"),
                                   ValueError("bad weights"), FileNotFoundError("no file")])
def test_errors_cross_with_their_type_and_fields(error: BaseException) -> None:
    back = decode_error(encode_error(error))
    assert type(back) is type(error) and str(back) == str(error)
    assert getattr(back, "param", None) == getattr(error, "param", None)
    assert getattr(back, "request_id", None) == getattr(error, "request_id", None)


def test_n_choices_are_the_in_process_engines(server: ModelServer, tiny_checkpoint: Path) -> None:
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=11, ignore_eos=True)
    want = Engine.from_pretrained(tiny_checkpoint, scheduler=SCHEDULER).generate([PROMPTS[2]], params, n=3)

    async def collect() -> list[dict]:
        request = GenerateRequest("cmpl-n3", PROMPTS[2], params, namespace="tiny:test", n=3)
        return [dict(item) async for item in server.generate(request)]

    tokens: dict[int, list[int]] = {}
    for item in asyncio.run(collect()):
        tokens.setdefault(item["index"], []).extend(item["token_ids"])
    assert [tokens[i] for i in range(3)] == [out.token_ids for out in want]


def test_weights_update_through_the_engine_process(server: ModelServer, tiny_checkpoint: Path,
                                                   tmp_path: Path) -> None:
    new = checkpoint_with_new_head(tiny_checkpoint, tmp_path / "new")
    before = _items(server, "cmpl-w0", PROMPTS[0])
    refused = asyncio.run(server.update_weights(WeightsUpdate(str(tmp_path / "nowhere"), "x")))
    assert "error" in refused and server.engine.training.weights_version == "0"
    answer = asyncio.run(server.update_weights(WeightsUpdate(str(new), "rl-1")))
    assert answer == {"replica_id": server.replica_id, "version": "rl-1"}
    updated = _items(server, "cmpl-w1", PROMPTS[0])
    assert updated[-1]["weights_version"] == "rl-1"
    assert [i["token_ids"] for i in updated] != [i["token_ids"] for i in before]
    asyncio.run(server.update_weights(WeightsUpdate(str(tiny_checkpoint), "original")))
    assert [i["token_ids"] for i in _items(server, "cmpl-w2", PROMPTS[0])] == [i["token_ids"] for i in before]
    server.engine.check_integrity()
