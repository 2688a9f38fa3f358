"""A replica's engine in a process of its own: `EngineProcess` answers what `ModelServer` asks of an
`Engine` by talking to `engine_child.py` over a socket pair (messages there; deltas in `engine_wire.py`).

Invariants:
* Every request submitted here ends for its consumer: with its finished snapshot, its error, an
  abort from this side, or `EngineDeadError` once the engine process is gone.
* A request's snapshots reach its sink in the order the engine made them, on the reader thread;
  sinks must not block (`awaiting.stream_outputs` hands them to the consumer's event loop).
* Once the engine process is gone (it exited, or `close`), every call and submission raises
  `EngineDeadError` and `health()` says so: Serve then replaces the replica.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from antumbra.platform.replica.engine_child import EngineFacts, EngineProcessSpec
from antumbra.platform.replica.engine_wire import OutputAccumulator, OutputDelta, decode_error
from antumbra.replicas.awaiting import stream_outputs
from antumbra.replicas.driver import Sink
from antumbra.replicas.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from antumbra.replicas.sampling_params import SamplingParams
from antumbra.replicas.tenancy import DEFAULT_TENANCY, Tenancy

log = logging.getLogger(__name__)

_HEALTH_TIMEOUT_S = 10.0
_EXIT_WAIT_S = 2.0


@dataclass
class _Route:
    outputs: OutputAccumulator
    sink: Sink


class RemoteTraining:
    """`engine.training` as a replica reads it: the weights version, live weight updates."""

    def __init__(self, process: EngineProcess) -> None:
        self._process = process

    @property
    def weights_version(self) -> str:
        return str(self._process.call("weights_version"))

    def update_weights(self, path: str, version: str) -> None:
        self._process.call("update_weights", path, version)


class EngineProcess:
    """Starts the engine process, waits until its engine is ready (or raises why it could not
    start), then serves the `Engine` methods a replica uses."""

    def __init__(self, spec: EngineProcessSpec) -> None:
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "antumbra.platform.replica.engine_child", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards the fields below
        self._routes: dict[str, _Route] = {}
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._dead: str | None = None
        self._send(("start", spec))
        self.facts = self._wait_ready()
        self.training = RemoteTraining(self)
        self._reader = threading.Thread(target=self._read, name="engine-process-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> EngineFacts:
        try:
            kind, value = self._conn.recv()
        except (EOFError, OSError):
            code = self._proc.wait()
            raise RuntimeError(f"the engine process exited with status {code} before it was ready") from None
        if kind == "failed":
            self.close()
            raise RuntimeError(f"the engine process could not start: {decode_error(value)}")
        assert kind == "ready" and isinstance(value, EngineFacts), kind
        return value

    # The engine's facts, as `Engine` exposes them.
    pid = property(lambda self: self.facts.pid)
    model_config = property(lambda self: self.facts.model_config)
    max_model_len = property(lambda self: self.facts.max_model_len)
    eos_token_ids = property(lambda self: self.facts.eos_token_ids)
    warmup = property(lambda self: self.facts.warmup)

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: list[int], params: SamplingParams | None, sink: Sink,
               request_id: str | None = None, **kwargs: Any) -> str:
        """Queue one request in the engine process; its snapshots (or its error, among them a
        refusal of bad input) go to `sink`. Raises EngineDeadError once the process is gone."""
        rid = request_id or uuid.uuid4().hex
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            if rid in self._routes:
                raise InvalidRequestError(f"request id {rid!r} is already in the engine", "request_id")
            self._routes[rid] = _Route(OutputAccumulator(rid, list(prompt)), sink)
        try:
            self._send(("submit", rid, prompt, params, kwargs))
        except EngineDeadError:
            with self._lock:
                self._routes.pop(rid, None)
            raise
        return rid

    def abort(self, request_id: str) -> bool:
        """Stop a request; False if it is unknown here or has ended (a gone engine process has
        stopped every request: nothing to send then)."""
        with self._lock:
            known = self._routes.pop(request_id, None) is not None
        if known:
            try:
                self._send(("abort", request_id))
            except EngineDeadError:
                return False
        return known

    async def stream(self, prompt: list[int], params: SamplingParams | None = None,
                     request_id: str | None = None, *, priority: int = 0, namespace: str = "default",
                     tenancy: Tenancy = DEFAULT_TENANCY) -> AsyncIterator[Any]:
        """As `Engine.stream`: snapshots as the request advances; a consumer that stops aborts it."""
        async for item in stream_outputs(self, lambda sink: self.submit(
                prompt, params, sink, request_id, priority=priority, namespace=namespace, tenancy=tenancy)):
            yield item

    # ------------------------------------------------------------------ calls
    def call(self, name: str, *args: Any, timeout_s: float | None = None) -> Any:
        """Run `engine_child.CALLS[name]` on the engine; its error is raised here as the engine's type."""
        future: Future = Future()
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        self._send(("call", call_id, name, args))
        try:
            return future.result(timeout_s)
        finally:
            with self._lock:
                self._calls.pop(call_id, None)

    def stats(self) -> dict[str, float]:
        return dict(self.call("stats"))

    def request_ids(self) -> list[str]:
        return list(self.call("request_ids"))

    def thread_names(self) -> dict[int, str]:
        return dict(self.call("thread_names"))

    def check_integrity(self) -> None:
        self.call("check_integrity")

    def health(self) -> None:
        """Raise EngineDeadError when the engine cannot serve: its process is gone, its engine
        stopped, or it does not answer within `_HEALTH_TIMEOUT_S`."""
        try:
            self.call("health", timeout_s=_HEALTH_TIMEOUT_S)
        except TimeoutError:
            raise EngineDeadError("the engine process did not answer a health check within "
                                  f"{_HEALTH_TIMEOUT_S:.0f} s") from None

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the engine process (after the step in flight); requests still open end with
        EngineDeadError."""
        if self._proc.poll() is None:
            with contextlib.suppress(EngineDeadError):  # a pipe gone already: the wait below still ends it
                self._send(("stop",))
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("the engine process %d did not stop within %.0f s: killed", self._proc.pid,
                            timeout_s)
                self._proc.kill()
                self._proc.wait()
        self._conn.close()
        self._die("the engine process was stopped")

    # ------------------------------------------------------------------ the pipe
    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as exc:  # the process is gone; the reader fails what was open
            raise EngineDeadError(f"the engine process is gone: {exc}") from None

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "outputs":
                for rid, item in message[1]:
                    self._deliver(rid, item)
            elif message[0] == "reply":
                _, call_id, ok, value = message
                with self._lock:
                    future = self._calls.get(call_id)
                if future is not None and not future.done():
                    if ok:
                        future.set_result(value)
                    else:
                        future.set_exception(decode_error(value))
        try:  # the pipe closes as the process exits: its status follows at once
            code: int | None = self._proc.wait(_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            code = None
        self._die(f"the engine process exited (status {code})" if code is not None
                  else "the engine process closed its pipe")

    def _deliver(self, rid: str, item: Any) -> None:
        with self._lock:
            route = self._routes.get(rid)
        if route is None:  # aborted here since
            return
        if isinstance(item, OutputDelta):
            try:
                out: Any = route.outputs.apply(item)
            except ValueError as exc:
                out = RequestFailedError(rid, str(exc))
                self.abort(rid)
        else:
            out = decode_error(item)
        if isinstance(out, BaseException) or out.finished:
            with self._lock:
                self._routes.pop(rid, None)
        _call_sink(route.sink, out)

    def _die(self, reason: str) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = reason
            routes, self._routes = self._routes, {}
            calls, self._calls = self._calls, {}
        for route in routes.values():
            _call_sink(route.sink, EngineDeadError(reason))
        for future in calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))


def _call_sink(sink: Sink, item: Any) -> None:
    try:
        sink(item)
    except Exception:  # one consumer's failure stops no other
        log.exception("a request's sink failed")
