"""The engine process of a replica run with `engine_process` on (`engine_process.py` starts it as
`python -m antumbra.platform.replica.engine_child FD`, FD its end of a socket pair).

Why a process of its own: the engine's stepping thread then shares its interpreter lock only with
the threads below, not with the replica's event loop and Ray Serve's request handling.

Messages are tuples pickled by `multiprocessing.connection`:
* replica -> engine: ("start", EngineProcessSpec) once; then ("submit", rid, prompt, params, kwargs),
  ("abort", rid), ("call", call_id, name, args) with a name of `CALLS`, ("stop",).
* engine -> replica: ("ready", EngineFacts) or ("failed", encoded error) once; then
  ("outputs", [(rid, OutputDelta or encoded error), ...]) and ("reply", call_id, ok, value or encoded error).

Threads: the main thread reads commands; submits and aborts go to the engine's driver at once (they
never block it); calls run on a small pool (a reader takes the driver's lock and waits at most a step;
a weight update waits for the engine to drain); one sender thread sends every output made since its
last send as one message. The process exits when the replica's end of the pipe closes, or when its
parent changes (the replica died while the engine loaded).
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from antumbra.platform.replica.engine_wire import delta_of, encode_error
from antumbra.platform.replica.heap import freeze_startup_heap
from antumbra.replicas.errors import EngineDeadError, InvalidRequestError

log = logging.getLogger(__name__)

_CALL_THREADS = 4
_PARENT_POLL_S = 1.0


@dataclass(frozen=True)
class EngineProcessSpec:
    """How the engine process builds its engine (`Engine.from_pretrained`'s arguments) and runs."""

    model_path: str
    device: str
    dtype: str
    engine_kwargs: dict[str, Any]
    replica_id: str
    on_start: Callable[[Any, str], Any] | None = None  # as `ModelServer`'s: run here, on the engine
    gil_switch_interval_s: float | None = None
    freeze_heap: bool = False
    log_level: int = logging.INFO


@dataclass(frozen=True)
class EngineFacts:
    """What the replica reads from its engine without asking it each time."""

    pid: int
    model_config: Any  # the engine's `ModelConfig`
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    warmup: Any  # `WarmupReport` or None


def _stats(engine: Any) -> dict[str, float]:
    """The engine's stats and this process's GIL switch interval and objects frozen out of the
    collector's walks (the replica reports its own under the names without `engine_process_`)."""
    return {**engine.stats(), "engine_process_gil_switch_interval_us": sys.getswitchinterval() * 1e6,
            "engine_process_gc_frozen_objects": float(gc.get_freeze_count())}


def thread_names() -> dict[int, str]:
    """This process's Python threads: native thread id -> name (what /proc lists by id only)."""
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


CALLS: dict[str, Callable[..., Any]] = {
    "stats": _stats,
    "thread_names": lambda engine: thread_names(),
    "request_ids": lambda engine: engine.request_ids(),
    "check_integrity": lambda engine: engine.check_integrity(),
    "health": lambda engine: engine.health(),
    "weights_version": lambda engine: engine.training.weights_version,
    "update_weights": lambda engine, path, version: engine.training.update_weights(path, version),
}


class EngineServer:
    """Serves one engine over `conn` until the replica stops it or goes away."""

    def __init__(self, engine: Any, conn: Connection) -> None:
        self.engine = engine
        self._conn = conn
        self._send_lock = threading.Lock()
        self._outbox: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(_CALL_THREADS, thread_name_prefix="engine-call")
        self._sender = threading.Thread(target=self._send_outputs, name="engine-outputs", daemon=True)

    def serve(self) -> None:
        self._sender.start()
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):  # the replica is gone
                break
            if message[0] == "stop":
                break
            self._handle(message)
        self._outbox.put(None)
        self._sender.join(timeout=5.0)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "submit":
            _, rid, prompt, params, kwargs = message
            self._submit(rid, prompt, params, kwargs)
        elif kind == "abort":
            self.engine.abort(message[1])
        elif kind == "call":
            _, call_id, name, args = message
            self._pool.submit(self._call, call_id, name, args)
        else:
            log.error("engine process: unknown message %r ignored", kind)

    def _submit(self, rid: str, prompt: Any, params: Any, kwargs: dict[str, Any]) -> None:
        outbox = self._outbox

        def sink(item: Any) -> None:  # on the engine's output thread: never blocks
            outbox.put((rid, encode_error(item) if isinstance(item, BaseException) else delta_of(item)))

        try:
            self.engine.submit(prompt, params, sink, rid, **kwargs)
        except (InvalidRequestError, EngineDeadError) as exc:  # nothing was queued
            outbox.put((rid, encode_error(exc)))

    def _call(self, call_id: int, name: str, args: tuple[Any, ...]) -> None:
        try:
            if name not in CALLS:
                raise ValueError(f"the engine process has no call {name!r}")
            reply: tuple[Any, ...] = ("reply", call_id, True, CALLS[name](self.engine, *args))
        except BaseException as exc:
            reply = ("reply", call_id, False, encode_error(exc))
        self._send(reply)

    def _send_outputs(self) -> None:
        """One message for every output queued since the last: a step's outputs cross together."""
        while True:
            first = self._outbox.get()
            if first is None:
                return
            batch = [first]
            stopping = False
            while not self._outbox.empty():
                item = self._outbox.get_nowait()
                if item is None:
                    stopping = True
                    break
                batch.append(item)
            self._send(("outputs", batch))
            if stopping:
                return

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as exc:  # the replica is gone; the reader sees it and stops
            log.warning("engine process: a message to the replica was lost: %s", exc)


def _watch_parent(parent_pid: int) -> None:
    """Exit once this process's parent is gone (its children are re-parented)."""

    def watch() -> None:
        while True:
            time.sleep(_PARENT_POLL_S)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="engine-parent-watch", daemon=True).start()


def run(conn: Connection) -> int:
    """Build the engine the replica asks for, then serve it; -> the process's exit status."""
    _watch_parent(os.getppid())
    kind, spec = conn.recv()
    assert kind == "start" and isinstance(spec, EngineProcessSpec), kind
    logging.basicConfig(level=spec.log_level,
                        format=f"[engine {os.getpid()}] %(levelname)s %(name)s: %(message)s")
    if spec.gil_switch_interval_s is not None:
        sys.setswitchinterval(spec.gil_switch_interval_s)
    try:
        from antumbra.replicas.engine import Engine

        engine = Engine.from_pretrained(spec.model_path, device=spec.device, dtype=spec.dtype,
                                        **spec.engine_kwargs)
        started = spec.on_start(engine, spec.replica_id) if spec.on_start is not None else None
    except BaseException as exc:
        log.exception("the engine process could not start")
        conn.send(("failed", encode_error(exc)))
        return 1
    if spec.freeze_heap:
        freeze_startup_heap()
    conn.send(("ready", EngineFacts(pid=os.getpid(), model_config=engine.model_config,
                                    max_model_len=int(engine.max_model_len),
                                    eos_token_ids=tuple(int(t) for t in engine.eos_token_ids),
                                    warmup=engine.warmup)))
    try:
        EngineServer(engine, conn).serve()
    finally:
        close = getattr(started, "close", None)
        if callable(close):
            close()
        engine.shutdown(timeout_s=10.0)
    return 0


if __name__ == "__main__":
    # Run as the module itself, not as `__main__`: the replica pickles this module's classes.
    from antumbra.platform.replica import engine_child

    sys.exit(engine_child.run(Connection(int(sys.argv[1]))))
