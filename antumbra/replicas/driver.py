"""The one loop that steps an `EngineCore`, and the queues between it and the engine's callers.

Threading contract:
* One driver thread, started by the first submission, owns stepping. Between steps it applies
  queued submissions and aborts in order, then runs `core.step()` and hands every output to its
  request's sink. With nothing to do it sleeps on a condition variable; it wakes only for work.
* Any thread may `submit`, `abort`, `wait_idle` or `health`; they touch only the queues (under
  `_cv`). Readers of core state take `lock`, a re-entrant lock the driver holds while it steps
  (so a reader waits at most one step). Cache-event subscribers run on the driver thread with
  `lock` held.
* A sink receives its request's snapshots in order; the last is finished, or the sink gets the
  error that failed the request (`RequestFailedError`). Sinks run on the output thread, which
  detokenizes each step's outputs and finds stop strings (`text_outputs.py`) while the driver
  steps on; they must not block, and an exception in one is logged and stops nothing. A stop
  string found there comes back as a command: the driver cuts and finishes the request
  (`EngineCore.stop_at`) before its next step.
* While a step is in flight (overlapped decoding), the outputs of the step that launched it go to
  the output thread just before the core reads those tokens back (`OverlapStepper.before_readback`:
  after the next launch, when the driver waits for the device), so the output thread runs while
  the device does, not while the driver prepares the launch (not on a CPU, whose launch computes
  the step: `hold_outputs`). Outputs reach the output thread in the order the core made them.
* Finished, failed and aborted requests leave the core and lose their sink at once.
* After a `FatalEngineError` (or any exception outside a request's step) the driver fails every
  request and stops; `health()` raises and new submissions raise `EngineDeadError`.
* A queued update (`update`, e.g. new weights) runs between steps once the requests already in
  the engine have finished; requests submitted after it wait and run after it. So every request
  runs entirely before or entirely after an update, never across one. An update that raises
  `FatalEngineError` stops the engine as a failed step does; any other error changes nothing.
* The thread holds the driver, never the `Engine`, so an engine nobody references is collected,
  and `stop()` (which its finaliser calls) ends the thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from .core import EngineCore
from .errors import EngineDeadError, FatalEngineError, InvalidRequestError, RequestFailedError
from .progress import snapshot
from .request import Request, RequestOutput, RequestStatus
from .text_outputs import TextOutputs

log = logging.getLogger(__name__)

Sink = Callable[[RequestOutput | BaseException], None]
# A held request's KV adoption, run on the driver thread: core -> the request's outputs.
Adoption = Callable[[EngineCore], list[RequestOutput]]


class Driver:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.lock = threading.RLock()  # guards the core
        self._cv = threading.Condition()  # guards the fields below
        self._inbox: list[tuple[str, Any]] = []
        self._sinks: dict[str, Sink] = {}
        self._thread: threading.Thread | None = None
        self._fatal: BaseException | None = None
        self._busy = False  # the core had work after the last step
        self._stopping = False
        self._updates: list[tuple[Callable[[EngineCore], Any], Future]] = []  # waiting for the core to drain
        self._deferred: list[Request] = []  # submitted after a pending update: added once it ran
        self.num_wakeups = 0  # loop iterations: the loop iterates only when there is work
        self.texts = TextOutputs(core.eos_token_ids)
        self._outbox: queue.SimpleQueue[list[RequestOutput] | None] = queue.SimpleQueue()
        self._num_undelivered = 0  # steps' outputs queued for the output thread, under `_cv`
        self._held: list[RequestOutput] = []  # outputs waiting for the readback in flight (driver thread)
        self._output_thread: threading.Thread | None = None
        # Off until a device A/B shows it pays: only an asynchronous device runs a launched step
        # while the host waits for the one before (on a CPU the launch computes it, and held outputs
        # would wait a whole forward); a caller may turn it on (`hold_outputs = True`).
        self.hold_outputs = False
        self.num_held_steps = 0  # steps whose outputs waited for the next readback

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def submit(self, request: Request, sink: Sink, adopt: Adoption | None = None) -> None:
        """Queue a validated request; raises EngineDeadError, or InvalidRequestError for an id in flight.
        With `adopt`, `request` is held for a KV adoption (kv_transfer/adopt.py) and the driver
        calls `adopt(core)` between steps instead of adding the request; it returns the request's
        outputs (a failed adoption fails the request there)."""
        with self._cv:
            if self._fatal is not None:
                raise EngineDeadError(f"the engine stopped after a fatal error: {self._fatal}")
            if self._stopping:
                raise EngineDeadError("the engine has been stopped")
            if request.request_id in self._sinks:
                raise InvalidRequestError(
                    f"request id {request.request_id!r} is already in flight", "request_id"
                )
            self._sinks[request.request_id] = sink
            self.texts.register(request)
            self._inbox.append(
                ("add", request) if adopt is None else ("adopt", adopt)
            )
            self._start()
            self._cv.notify()

    def submit_all(self, requests: list[Request], sinks: list[Sink]) -> None:
        """Queue several validated requests at once: the driver's next step sees all of them, so a
        batch's composition does not depend on how fast the caller queued it. All or none: raises
        as `submit` does, queueing nothing, when any cannot be queued."""
        with self._cv:
            if self._fatal is not None:
                raise EngineDeadError(f"the engine stopped after a fatal error: {self._fatal}")
            if self._stopping:
                raise EngineDeadError("the engine has been stopped")
            ids = [r.request_id for r in requests]
            clash = next((i for n, i in enumerate(ids) if i in self._sinks or i in ids[:n]), None)
            if clash is not None:
                raise InvalidRequestError(f"request id {clash!r} is already in flight", "request_id")
            for request, sink in zip(requests, sinks, strict=True):
                self._sinks[request.request_id] = sink
                self.texts.register(request)
                self._inbox.append(("add", request))
            self._start()
            self._cv.notify()

    def abort(self, request_id: str) -> bool:
        """Queue an abort; False if the request is unknown or already finished."""
        with self._cv:
            if request_id not in self._sinks:
                return False
            self._inbox.append(("abort", request_id))
            self._cv.notify()
            return True

    def update(self, apply: Callable[[EngineCore], Any]) -> Future:
        """Run `apply(core)` once the requests in the engine now have finished (later submissions
        wait for it); -> a future of its result."""
        future: Future = Future()
        with self._cv:
            if self._fatal is not None:
                raise EngineDeadError(f"the engine stopped after a fatal error: {self._fatal}")
            self._inbox.append(("update", (apply, future)))
            self._start()
            self._cv.notify()
        return future

    def _start(self) -> None:
        """Start the driver and output threads (under `_cv`), once."""
        if self._thread is None:
            self._output_thread = threading.Thread(target=self._output_loop, name="engine-output",
                                                   daemon=True)
            self._output_thread.start()
            self._thread = threading.Thread(target=self._run, name="engine-driver", daemon=True)
            self._thread.start()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every queued submission and abort is applied and no request is left; False on
        timeout."""
        with self._cv:
            return self._cv.wait_for(
                lambda: self._fatal is not None or not (self._inbox or self._busy or self._num_undelivered),
                timeout_s,
            )

    def health(self) -> None:
        """Raise EngineDeadError when the engine cannot serve (a fatal error, or a dead thread)."""
        with self._cv:
            if self._fatal is not None:
                raise EngineDeadError(f"the engine stopped after a fatal error: {self._fatal}")
            if self._thread is not None and not self._thread.is_alive() and not self._stopping:
                raise EngineDeadError("the engine's driver thread has died")

    def stop(self) -> None:
        """End the thread after the step in flight; requests still queued or running are aborted."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._outbox.put(None)

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        busy = False
        while True:
            with self._cv:
                self._busy = busy
                if not (busy or self._inbox or self._num_undelivered or self._held):
                    self._cv.notify_all()  # wake `wait_idle`
                while not (self._inbox or self._busy or self._stopping):
                    self._cv.wait()
                if self._stopping:
                    return
                commands, self._inbox = self._inbox, []
                # Busy from the moment the commands leave the inbox, so `wait_idle` cannot see an
                # empty inbox and an idle driver while they are being applied.
                self._busy = True
                self.num_wakeups += 1
            try:
                with self.lock:
                    self.core.overlap.before_readback = self._release_held  # this driver steps the core
                    outputs = self._apply(commands)
                    if self.core.has_work():
                        outputs += self.core.step()
                    self._run_due_updates()
                    busy = self.core.has_work() or bool(self._updates)
                    hold = (self.hold_outputs and busy and self.core.overlap.inflight is not None
                            and not self._inbox)
            except BaseException as exc:  # a FatalEngineError, or a bug outside any request's step
                self._die(exc)
                return
            self._release_held()
            if hold and outputs:
                self._held = outputs  # handed over before the tokens in flight are read
                self.num_held_steps += 1
            else:
                self._dispatch(outputs)

    def _apply(self, commands: list[tuple[str, Any]]) -> list[RequestOutput]:
        outputs = []
        for kind, arg in commands:
            if kind == "update":
                self._updates.append(arg)
            elif kind == "add" and self._updates:
                self._deferred.append(arg)
            elif kind == "add":
                self.core.add(arg)
            elif kind == "adopt":
                outputs += arg(self.core)
            elif kind == "stop_at":
                stopped = self.core.stop_at(*arg)
                if stopped is not None:
                    outputs.append(stopped)
            else:
                aborted = self.core.abort(arg) or self._abort_deferred(arg)
                if aborted is not None:
                    outputs.append(aborted)
        return outputs

    def _abort_deferred(self, request_id: str) -> RequestOutput | None:
        """Abort a request still waiting for an update (it holds nothing yet)."""
        for request in self._deferred:
            if request.request_id == request_id:
                self._deferred.remove(request)
                request.status, request.finish_reason = RequestStatus.FINISHED, "abort"
                return snapshot(request)
        return None

    def _run_due_updates(self) -> None:
        """Updates whose turn has come (nothing in flight), then the requests that waited for them."""
        while self._updates and not self.core.has_work():
            apply, future = self._updates.pop(0)
            try:
                future.set_result(apply(self.core))
            except FatalEngineError as exc:  # e.g. a gang's ranks that may disagree: the engine stops
                future.set_exception(exc)
                raise
            except Exception as exc:  # a refused update changes nothing; the engine serves on
                future.set_exception(exc)
            if not self._updates:
                for request in self._deferred:
                    self.core.add(request)
                self._deferred = []

    def _release_held(self) -> None:
        """Hand the held outputs to the output thread (on the driver thread)."""
        held, self._held = self._held, []
        self._dispatch(held)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to the output thread."""
        if outputs:
            with self._cv:
                self._num_undelivered += 1
            self._outbox.put(outputs)

    def _output_loop(self) -> None:
        while (outputs := self._outbox.get()) is not None:
            try:
                self._deliver_all(outputs)
            except Exception:  # a bug here must not leave `wait_idle` waiting for ever
                log.exception("processing engine outputs failed")
            with self._cv:
                self._num_undelivered -= 1
                if not (self._busy or self._inbox or self._num_undelivered):
                    self._cv.notify_all()  # wake `wait_idle`

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """Text and stop strings for each output, then its sink (on the output thread)."""
        ready: list[RequestOutput] = []
        stops: list[tuple[str, int]] = []
        for raw in outputs:
            out, stop_at = self.texts.process(raw)
            if stop_at is not None:
                stops.append((raw.request_id, stop_at))
            if out is not None:
                ready.append(out)
        # The condition once per step, not per output: the driver thread contends for it.
        with self._cv:
            if stops:
                self._inbox += [("stop_at", stop) for stop in stops]
                self._cv.notify()
            found = self._sinks
            sinks = [found.pop(out.request_id, None) if out.finished else found.get(out.request_id)
                     for out in ready]
        for out, sink in zip(ready, sinks, strict=True):
            if sink is not None:
                _deliver(
                    sink, RequestFailedError(out.request_id, out.error) if out.error is not None else out
                )

    def _die(self, exc: BaseException) -> None:
        log.critical("the engine cannot continue; failing every request", exc_info=exc)
        with self._cv:
            self._fatal = exc if isinstance(exc, FatalEngineError) else FatalEngineError(repr(exc))
            sinks, self._sinks, self._inbox, self._held = self._sinks, {}, [], []
            self._cv.notify_all()
        self._outbox.put(None)
        with self.lock:
            for rid in list(self.core.requests):
                self.core.abort(rid)
        dead = EngineDeadError(f"the engine stopped after a fatal error: {self._fatal}")
        for sink in sinks.values():
            _deliver(sink, dead)


def _deliver(sink: Sink, item: RequestOutput | BaseException) -> None:
    try:
        sink(item)
    except Exception:  # a consumer's problem must not stop the engine for everyone
        log.exception("delivering an engine output failed")
