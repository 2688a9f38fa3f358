"""The model deployment: one `Engine` per Ray Serve replica (a plain class; `launch/app.py` deploys it).

The ingress calls `generate` through a streaming handle with one `GenerateRequest`; the replica
streams plain dicts (deltas, or one error item; `antumbra.platform.messages` has their shape), so
nothing engine-specific crosses the process boundary. Cancelling the handle call (a client
disconnect) cancels the generator, and the engine aborts the request and frees its KV.

Replica hooks that Ray Serve discovers by name: `record_routing_stats` (what the request router
reads), `record_autoscaling_stats` (what the autoscaling policies read) and `check_health`.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from antumbra.platform.messages import (
    ENGINE_ERROR,
    REPLICA_UNAVAILABLE,
    GenerateRequest,
    ReplicaQuery,
    StreamItem,
    WeightsUpdate,
    encode_routed_experts,
    error_item,
    slo_attainment,
)
from antumbra.platform.metrics import default_metrics
from antumbra.platform.replica.choices import fan_out
from antumbra.platform.replica.engine_child import EngineProcessSpec, thread_names
from antumbra.platform.replica.engine_process import EngineProcess
from antumbra.platform.replica.heap import freeze_startup_heap
from antumbra.platform.replica.latency_samples import LatencySamples
from antumbra.platform.replica.slo import SloTracker
from antumbra.replicas.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from antumbra.replicas.sampling_params import SamplingParams

if TYPE_CHECKING:
    from antumbra.replicas.engine import Engine
    from antumbra.replicas.request import RequestOutput

log = logging.getLogger(__name__)

StartHook = Callable[["Engine", str], Any]

HEALTH_NAMESPACE = "__health__"  # tenant namespaces are "<model>:<hex>", so this never collides
_HEALTH_PRIORITY = 1 << 30


def current_replica_id() -> str:
    """Ray Serve's id of the replica running this code (`replica_id.unique_id`), or a random one
    outside Serve."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not inside a Serve replica (unit use, benchmarks)
        return f"local-{uuid.uuid4().hex[:8]}"


def _rss_bytes() -> int | None:
    """Resident memory of this process (Linux `/proc`), None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class ModelServer:
    """Owns one engine and streams its outputs; see the module docstring for the item format.

    `on_start(engine, replica_id)` runs once the engine is loaded (the directory publisher attaches
    there); if it returns an object with a `close()` method, that is called when the replica stops.
    """

    def __init__(
        self,
        model_name: str,
        model_path: str,
        device: str = "cpu",
        dtype: str = "float32",
        *,
        engine_kwargs: dict[str, Any] | None = None,
        on_start: StartHook | None = None,
        stall_timeout_s: float = 60.0,
        health_probe_timeout_s: float = 20.0,
        slo_window_s: float = 60.0,
        gil_switch_interval_s: float | None = None,
        freeze_heap: bool = False,
        engine_process: bool = False,
    ) -> None:
        """`gil_switch_interval_s`: this process's GIL switch interval (`ModelSpec.gil_switch_interval_us`);
        None leaves it as it is. `freeze_heap`: once ready, keep the process's start-up objects out of
        the garbage collector's walks (`heap.py`; `ModelSpec.freeze_heap`, on for deployed replicas).
        `engine_process`: run the engine (and `on_start`) in a process of its own (`engine_process.py`),
        which both settings above apply to as well."""
        if gil_switch_interval_s is not None:
            sys.setswitchinterval(gil_switch_interval_s)
        self.model_name = model_name
        self.device = device
        self.dtype = dtype
        self.replica_id = current_replica_id()
        self.engine: Any
        if engine_process:
            self.engine = EngineProcess(EngineProcessSpec(
                model_path=model_path, device=device, dtype=dtype, engine_kwargs=dict(engine_kwargs or {}),
                replica_id=self.replica_id, on_start=on_start, gil_switch_interval_s=gil_switch_interval_s,
                freeze_heap=freeze_heap, log_level=logging.getLogger().getEffectiveLevel()))
        else:
            from antumbra.replicas.engine import Engine

            self.engine = Engine.from_pretrained(model_path, device=device, dtype=dtype,
                                                 **(engine_kwargs or {}))
        if self.engine.warmup is not None:
            # Serve counts the replica ready once this constructor returns: after the warm-up.
            log.info(
                "replica of %s warmed up in %.1f s (%d steps, %d kernel variants loaded)",
                model_name,
                self.engine.warmup.seconds,
                self.engine.warmup.num_steps,
                self.engine.warmup.kernel_loads,
            )
        self._stall_timeout_s = stall_timeout_s
        self._probe_timeout_s = health_probe_timeout_s
        self._in_flight = 0
        self._latency = LatencySamples()
        self._last_steps = -1.0
        self._last_progress_s = time.monotonic()
        self._probe_ids = itertools.count()
        self.slo = SloTracker(slo_window_s)
        self._metrics = default_metrics()
        self._weights_lock = asyncio.Lock()
        # An engine process runs `on_start` itself; closing it stops the process and the hook's object.
        self._started = (self.engine if engine_process
                         else on_start(self.engine, self.replica_id) if on_start is not None else None)
        if freeze_heap:  # last: everything start-up made is in the heap by now
            log.info("replica of %s froze %d start-up objects out of the collector's walks", model_name,
                     freeze_startup_heap())

    # ------------------------------------------------------------------ serving

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StreamItem]:
        """Stream deltas of one request until it finishes; cancellation aborts it in the engine."""
        arrived = time.monotonic()
        first_at: float | None = None
        last_at: float | None = None  # the first choice's last yield that carried tokens
        self._in_flight += 1
        try:
            async for index, out in self._choice_outputs(request):
                new = out.new_token_ids
                if new:
                    now = time.monotonic()
                    if first_at is None:
                        first_at = now
                        self._latency.first_token(now, now - arrived)
                    if index == 0:
                        if last_at is not None:
                            self._latency.next_chunk(now - last_at)
                        last_at = now
                if out.finished and index == 0 and first_at is not None and out.error is None:
                    self._record_slo(request, first_at - arrived, first_at, len(out.token_ids))
                logprobs = None
                if out.logprobs is not None:
                    # The logprobs of the new tokens, best first, as pairs (ints do not survive JSON keys).
                    fresh = out.logprobs[len(out.logprobs) - len(new) :]
                    logprobs = [sorted(d.items(), key=lambda kv: -kv[1]) for d in fresh]
                yield {
                    "text": out.new_text,
                    "token_ids": list(new),
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason,
                    "cached_tokens": out.cached_tokens,
                    "prompt_tokens": out.num_prompt_tokens,
                    "completion_tokens": len(out.token_ids),
                    "weights_version": out.weights_version,
                    "routed_experts": (None if out.routed_experts is None
                                       else encode_routed_experts(out.routed_experts)),
                    "index": index,
                    "drafted_tokens": out.num_drafted_tokens,
                    "accepted_tokens": out.num_accepted_tokens,
                }
        except InvalidRequestError as exc:
            yield error_item(400, str(exc), exc.param)
        except EngineDeadError as exc:  # the engine stopped; the health check makes Serve replace us
            log.error("request %s reached a stopped engine: %s", request.request_id, exc)
            yield error_item(
                503, f"the model replica cannot serve: {exc}", None, "server_error", REPLICA_UNAVAILABLE
            )
        except RequestFailedError as exc:  # a step failed for this request (the engine logged why)
            log.error("request %s failed in the engine: %s", request.request_id, exc)
            yield error_item(
                500,
                f"the model replica failed request {request.request_id}: {exc}",
                None,
                "server_error",
                ENGINE_ERROR,
            )
        finally:
            self._in_flight -= 1

    async def _choice_outputs(self, request: GenerateRequest) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, snapshot): the request's own, or with n > 1 those of its choices."""
        if request.n == 1:
            async for out in self._outputs(request):
                yield 0, out
            return
        async for item in fan_out(request, self._outputs):
            yield item

    def _record_slo(self, request: GenerateRequest, ttft_s: float, first_at: float, num_tokens: int) -> None:
        tpot_s = (time.monotonic() - first_at) / (num_tokens - 1) if num_tokens > 1 else None
        result = self.slo.record(request.tenancy, ttft_s, tpot_s)
        if result is not None:
            tenant = result.tenant_id
            self._metrics.record_slo(tenant, self.model_name, result.ttft_met, result.tpot_met)
            window = self.slo.snapshot()[tenant]["window"]
            self._metrics.set_slo_attainment(tenant, self.model_name, slo_attainment(window)["attainment"])

    def _outputs(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """The engine's snapshots of `request` (a decode replica of a disaggregated model first
        has its prompt computed elsewhere: replica/disaggregated.py)."""
        return self.engine.stream(
            request.token_ids, request.params, request.request_id, priority=request.priority,
            namespace=request.namespace, tenancy=request.tenancy,
        )

    # ------------------------------------------------------------------ Serve hooks

    async def record_routing_stats(self) -> dict[str, Any]:
        """Load as the request router reads it (`routing.policy.ReplicaLoad.from_stats`)."""
        stats = await asyncio.to_thread(self.engine.stats)
        return {
            "replica_id": self.replica_id,
            "queue_len": max(self._in_flight, int(stats["num_running"] + stats["num_waiting"])),
            "running_tokens": int(stats["running_tokens"]),
            "kv_use": max(stats["pool_use_virtual"], stats["pool_use_swa"]),
            "hit_rate": stats["hit_rate"],
        }

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metrics: use per KV pool, queue length, recent p90 TTFT and the recent SLO
        attainment of the worst-served tenant with its p90 pressure (`slo.py`), each if any."""
        stats = await asyncio.to_thread(self.engine.stats)
        out = {
            "kv_use_virtual": stats["pool_use_virtual"],
            "kv_use_swa": stats["pool_use_swa"],
            "queue_len": float(max(self._in_flight, stats["num_running"] + stats["num_waiting"])),
        }
        if (ttft_p90_s := self._latency.ttft_p90(time.monotonic())) is not None:
            out["ttft_p90_s"] = ttft_p90_s
        worst, pressure = self.slo.worst_attainment(), self.slo.pressure()
        if worst is not None and pressure is not None:
            out["slo_attainment"], out["slo_pressure"] = worst, pressure
        return out

    async def check_health(self) -> None:
        """Raise if the engine cannot serve.

        Algorithm: the engine must not have stopped after a fatal error, and its driver thread,
        once started, must be alive (`Engine.health`). If the engine stepped since the last check
        it is healthy. If it has work but has not stepped for
        `stall_timeout_s`, it is stuck. If it is idle, a one-token probe request must finish
        within `health_probe_timeout_s` (it proves the model still runs and admits requests).
        """
        engine = self.engine
        await asyncio.to_thread(engine.health)
        stats = await asyncio.to_thread(engine.stats)
        now = time.monotonic()
        if stats["num_steps"] != self._last_steps:
            self._last_steps = stats["num_steps"]
            self._last_progress_s = now
            return
        if stats["num_running"] + stats["num_waiting"] > 0:
            if now - self._last_progress_s > self._stall_timeout_s:
                raise RuntimeError(
                    f"the engine has work but made no step for {now - self._last_progress_s:.0f} s"
                )
            return
        await self._probe()
        self._last_steps = (await asyncio.to_thread(engine.stats))["num_steps"]
        self._last_progress_s = time.monotonic()

    async def _probe(self) -> None:
        bos = self.engine.model_config.bos_token_id or 0
        params = SamplingParams(max_tokens=1, temperature=0.0)
        rid = f"health-{self.replica_id}-{next(self._probe_ids)}"
        try:
            async with asyncio.timeout(self._probe_timeout_s):
                probe = self.engine.stream(
                    [bos], params, rid, priority=_HEALTH_PRIORITY, namespace=HEALTH_NAMESPACE
                )
                outputs = [out async for out in probe]
            if not outputs or not outputs[-1].finished:
                raise RuntimeError("the one-token health probe ended without finishing")
        except TimeoutError:
            raise RuntimeError(
                f"a one-token probe did not finish within {self._probe_timeout_s:.0f} s"
            ) from None

    # ------------------------------------------------------------------ introspection

    def get_model_info(self) -> dict[str, Any]:
        """What the ingress needs to validate and hash prompts for this model, and how the replica
        started (its warm-up's time and steps, None when it ran none)."""
        cfg = self.engine.model_config
        warm = self.engine.warmup
        return {
            "warmup_s": warm.seconds if warm is not None else None,
            "warmup_steps": warm.num_steps if warm is not None else None,
            "model": self.model_name,
            "replica_id": self.replica_id,
            "max_model_len": int(self.engine.max_model_len),
            "page_size": int(cfg.page_size),
            "vocab_size": int(cfg.vocab_size),
            "eos_token_ids": [int(t) for t in self.engine.eos_token_ids],
            "device": self.device,
            "dtype": self.dtype,
            "weights_version": self.engine.training.weights_version,
        }

    async def update_weights(self, update: WeightsUpdate) -> dict[str, Any]:
        """Load `update.path` into the engine as `update.version` (requests in flight finish on the
        old weights; see `Training.update_weights`); a replica already at that version answers at once.
        -> {"replica_id", "version"}, or {"replica_id", "error"} for an update that does not fit."""
        from antumbra.replicas.weights import WeightUpdateError

        async with self._weights_lock:
            if self.engine.training.weights_version != update.version:
                try:
                    await asyncio.to_thread(self.engine.training.update_weights, update.path, update.version)
                except (WeightUpdateError, FileNotFoundError, ValueError) as exc:
                    log.error("weights %s from %s refused: %s", update.version, update.path, exc)
                    return {"replica_id": self.replica_id, "error": str(exc)}
                log.info("weights %s loaded from %s", update.version, update.path)
        return {"replica_id": self.replica_id, "version": self.engine.training.weights_version}

    def take_ttft_samples(self) -> list[float]:
        """Every TTFT (arrival here to the first token, seconds) recorded since the last call; the
        platform's TTFT minus this is what the ingress, the router and the transport add."""
        return self._latency.take_ttft()

    def take_gap_samples(self) -> list[float]:
        """Every gap (seconds) between two chunks of one stream's first choice that carried new
        tokens, recorded since the last call; a client's inter-token gaps minus these are what the
        ingress, Serve's proxy and the network add."""
        return self._latency.take_gaps()

    async def check_engine_integrity(self) -> None:
        """Raise if the engine's pools, cache or scheduler break an invariant (tests and operators)."""
        await asyncio.to_thread(self.engine.check_integrity)

    async def engine_stats(self) -> dict[str, float]:
        """The engine's gauges and counters plus requests in flight on this replica, its process's
        GIL switch interval and the objects its process froze out of the collector's walks."""
        stats = await asyncio.to_thread(self.engine.stats)
        return {**stats, "in_flight": float(self._in_flight),
                "gil_switch_interval_us": sys.getswitchinterval() * 1e6,
                "gc_frozen_objects": float(gc.get_freeze_count())}

    async def engine_thread_names(self) -> dict[int, str]:
        """Native id -> name of each Python thread of the process the engine steps in."""
        if isinstance(self.engine, EngineProcess):
            return await asyncio.to_thread(self.engine.thread_names)
        return thread_names()

    async def replica_state(self, query: ReplicaQuery) -> dict[str, Any]:
        """This replica's id, process (and its engine's, `engine_pid`), memory, engine stats and request
        ids (`GET /admin/models/{name}/replicas`); with `query.check_integrity` also "integrity": None,
        or the invariant the engine breaks."""
        state: dict[str, Any] = {"replica_id": self.replica_id, "pid": os.getpid(),
                                 "engine_pid": getattr(self.engine, "pid", os.getpid()),
                                 "rss_bytes": _rss_bytes(),
                                 "stats": await self.engine_stats(), "slo": self.slo.snapshot(),
                                 "request_ids": await asyncio.to_thread(self.engine.request_ids)}
        if query.check_integrity:
            try:
                await self.check_engine_integrity()
                state["integrity"] = None
            except AssertionError as exc:
                state["integrity"] = str(exc) or "an engine invariant does not hold"
        return state

    def __del__(self) -> None:
        # Serve calls this when it stops the replica; so does garbage collection outside Serve.
        started, self._started = getattr(self, "_started", None), None
        close = getattr(started, "close", None)
        if callable(close):
            close()
