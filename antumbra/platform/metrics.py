"""Platform metrics through Ray's metrics API, labelled by tenant and model.

Ray exports these (prefixed `ray_`) on each node's metrics endpoint for Prometheus:

  name                          kind       tags                      what
  ----------------------------  ---------  ------------------------  ---------------------------------
  antumbra_requests             counter    tenant, model, status     finished requests, any status
  antumbra_request_errors       counter    tenant, model, status     requests with status >= 400
  antumbra_rate_limited         counter    tenant, model             429 answers
  antumbra_prompt_tokens        counter    tenant, model             prompt tokens
  antumbra_cached_tokens        counter    tenant, model             prompt tokens served from cache
  antumbra_completion_tokens    counter    tenant, model             generated tokens
  antumbra_ttft_seconds         histogram  tenant, model             time to first token
  antumbra_tpot_seconds         histogram  tenant, model             time per output token after it
  antumbra_queue_seconds        histogram  tenant, model             admission to first schedule
  antumbra_routing_decisions    counter    model, decision           affinity / hot_spot / load /
                                                                     no_directory / no_replicas
  antumbra_directory_failures   counter    model, kind               failed directory lookups:
                                                                     timeout / error
  antumbra_in_flight            gauge      tenant, model             requests being served
  antumbra_directory_available  gauge      model                     1 while the router's prefix
                                                                     directory answers, else 0
  antumbra_slo_requests         counter    tenant, model, slo, met   finished requests of tenants
                                                                     with SLO targets, per target
                                                                     (ttft / tpot / all), met or not
  antumbra_slo_attainment       gauge      tenant, model             fraction of a replica's recent
                                                                     requests that met every target
  antumbra_spec_drafted_tokens  counter    tenant, model             speculative decoding: draft
                                                                     tokens the model verified
  antumbra_spec_accepted_tokens counter    tenant, model             ... and accepted (accepted over
                                                                     drafted: the acceptance rate)

`PlatformMetrics` is the facade the ingress and the router call; `observe_request` adapts
it to the ingress's `request_observer` hook. It also keeps plain
in-process counts (`snapshot()`), and where Ray is not initialised it records only those:
every call is then a cheap no-op for Ray, so tests and scripts can call it freely. The
Ray metric objects are created once per process, on the first call made with Ray up.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

TTFT_BOUNDARIES_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TPOT_BOUNDARIES_S = [0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5]
QUEUE_BOUNDARIES_S = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0]

_TENANT_MODEL = ("tenant", "model")
_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "requests": ("Finished requests by status.", ("tenant", "model", "status")),
    "request_errors": ("Requests answered with an error status (>= 400).", ("tenant", "model", "status")),
    "rate_limited": ("Requests refused with 429 by a tenant limit.", _TENANT_MODEL),
    "prompt_tokens": ("Prompt tokens of finished requests.", _TENANT_MODEL),
    "cached_tokens": ("Prompt tokens served from the prefix cache.", _TENANT_MODEL),
    "completion_tokens": ("Generated tokens.", _TENANT_MODEL),
    "spec_drafted_tokens": ("Speculative decoding: draft tokens the model verified.", _TENANT_MODEL),
    "spec_accepted_tokens": ("Speculative decoding: draft tokens the model accepted.", _TENANT_MODEL),
    "routing_decisions": ("Routing decisions by reason.", ("model", "decision")),
    "directory_failures": (
        "Prefix-directory lookups that failed, by kind (timeout, error).",
        ("model", "kind"),
    ),
    "slo_requests": (
        "Finished requests of tenants with SLO targets, per target (ttft, tpot, all), met or not.",
        ("tenant", "model", "slo", "met"),
    ),
}
_HISTOGRAMS: dict[str, tuple[str, list[float]]] = {
    "ttft_seconds": ("Time to first token.", TTFT_BOUNDARIES_S),
    "tpot_seconds": ("Mean time per output token after the first.", TPOT_BOUNDARIES_S),
    "queue_seconds": ("Time from admission to first schedule.", QUEUE_BOUNDARIES_S),
}
_GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "in_flight": ("Requests being served.", _TENANT_MODEL),
    "directory_available": ("1 while the prefix directory answers lookups, else 0.", ("model",)),
    "slo_attainment": ("Fraction of a replica's recent requests of a tenant that met every SLO target.",
                       _TENANT_MODEL),
}

_lock = threading.Lock()
_ray_metrics: dict[str, Any] | None = None


def _ray_up() -> bool:
    try:
        import ray

        return bool(ray.is_initialized())
    except Exception:  # a broken or missing Ray means no Ray metrics, never an error
        return False


def _metrics(prefix: str) -> dict[str, Any] | None:
    """The Ray metric objects, created once per process; None where Ray is not initialised."""
    global _ray_metrics
    if _ray_metrics is not None:
        return _ray_metrics
    if not _ray_up():
        return None
    with _lock:
        if _ray_metrics is None:
            from ray.util.metrics import Counter, Gauge, Histogram

            made: dict[str, Any] = {}
            for name, (doc, tags) in _COUNTERS.items():
                made[name] = Counter(f"{prefix}_{name}", description=doc, tag_keys=tags)
            for name, (doc, bounds) in _HISTOGRAMS.items():
                made[name] = Histogram(
                    f"{prefix}_{name}", description=doc, boundaries=bounds, tag_keys=_TENANT_MODEL
                )
            for name, (doc, tags) in _GAUGES.items():
                made[name] = Gauge(f"{prefix}_{name}", description=doc, tag_keys=tags)
            _ray_metrics = made
    return _ray_metrics


class PlatformMetrics:
    """Record requests and routing decisions; see the module docstring for the metrics."""

    def __init__(self, prefix: str = "antumbra") -> None:
        self.prefix = prefix
        self._counts: collections.Counter[tuple[str, ...]] = collections.Counter()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ recording

    def record_request(
        self,
        tenant: str,
        model: str,
        status: int,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
        completion_tokens: int = 0,
        ttft_s: float | None = None,
        tpot_s: float | None = None,
        queue_s: float | None = None,
        drafted_tokens: int = 0,
        accepted_tokens: int = 0,
    ) -> None:
        """One finished request (any status); the timing arguments are None when not measured."""
        tags = {"tenant": str(tenant), "model": str(model)}
        status_tags = {**tags, "status": str(int(status))}
        self._count("requests", tenant, model, str(int(status)))
        self._count("prompt_tokens", tenant, model, n=prompt_tokens)
        self._count("cached_tokens", tenant, model, n=cached_tokens)
        self._count("completion_tokens", tenant, model, n=completion_tokens)
        self._count("spec_drafted_tokens", tenant, model, n=drafted_tokens)
        self._count("spec_accepted_tokens", tenant, model, n=accepted_tokens)
        if status >= 400:
            self._count("request_errors", tenant, model, str(int(status)))
        if status == 429:
            self._count("rate_limited", tenant, model)
        ray_metrics = _metrics(self.prefix)
        if ray_metrics is None:
            return
        try:
            ray_metrics["requests"].inc(1, tags=status_tags)
            if status >= 400:
                ray_metrics["request_errors"].inc(1, tags=status_tags)
            if status == 429:
                ray_metrics["rate_limited"].inc(1, tags=tags)
            for name, value in (
                ("prompt_tokens", prompt_tokens),
                ("cached_tokens", cached_tokens),
                ("completion_tokens", completion_tokens),
                ("spec_drafted_tokens", drafted_tokens),
                ("spec_accepted_tokens", accepted_tokens),
            ):
                if value > 0:
                    ray_metrics[name].inc(value, tags=tags)
            for name, seconds in (
                ("ttft_seconds", ttft_s),
                ("tpot_seconds", tpot_s),
                ("queue_seconds", queue_s),
            ):
                if seconds is not None and seconds >= 0:
                    ray_metrics[name].observe(seconds, tags=tags)
        except Exception as exc:  # metrics must never fail a request
            log.debug("recording request metrics failed: %r", exc)

    def record_route(self, decision: str, model: str = "") -> None:
        """One routing decision: "affinity", "hot_spot", "load", "no_directory" or "no_replicas"."""
        self._count("routing_decisions", model, decision)
        ray_metrics = _metrics(self.prefix)
        if ray_metrics is None:
            return
        try:
            ray_metrics["routing_decisions"].inc(1, tags={"model": str(model), "decision": str(decision)})
        except Exception as exc:
            log.debug("recording a routing decision failed: %r", exc)

    def record_directory_failures(self, model: str, timeouts: int = 0, errors: int = 0) -> None:
        """Directory lookups that timed out or failed (each one counts toward opening the breaker)."""
        for kind, n in (("timeout", timeouts), ("error", errors)):
            if n <= 0:
                continue
            self._count("directory_failures", model, kind, n=n)
            ray_metrics = _metrics(self.prefix)
            if ray_metrics is None:
                continue
            try:
                ray_metrics["directory_failures"].inc(n, tags={"model": str(model), "kind": kind})
            except Exception as exc:
                log.debug("recording directory failures failed: %r", exc)

    def record_slo(self, tenant: str, model: str, ttft_met: bool | None, tpot_met: bool | None) -> None:
        """One finished request of a tenant with SLO targets: each target it had, met or not, and
        "all" (met every target)."""
        outcomes = {"ttft": ttft_met, "tpot": tpot_met}
        outcomes["all"] = ttft_met is not False and tpot_met is not False
        for slo, met in outcomes.items():
            if met is None:
                continue
            flag = "yes" if met else "no"
            self._count("slo_requests", tenant, model, slo, flag)
            ray_metrics = _metrics(self.prefix)
            if ray_metrics is None:
                continue
            try:
                ray_metrics["slo_requests"].inc(
                    1, tags={"tenant": str(tenant), "model": str(model), "slo": slo, "met": flag})
            except Exception as exc:
                log.debug("recording an SLO outcome failed: %r", exc)

    def set_slo_attainment(self, tenant: str, model: str, value: float | None) -> None:
        if value is not None:
            self._set("slo_attainment", {"tenant": str(tenant), "model": str(model)}, value)

    def set_in_flight(self, tenant: str, model: str, value: int) -> None:
        self._set("in_flight", {"tenant": str(tenant), "model": str(model)}, value)

    def set_directory_available(self, model: str, available: bool) -> None:
        self._set("directory_available", {"model": str(model)}, 1.0 if available else 0.0)

    # ------------------------------------------------------------------ local counts

    def _count(self, name: str, *labels: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._counts[(name, *(str(label) for label in labels))] += n

    def _set(self, name: str, tags: dict[str, str], value: float) -> None:
        ray_metrics = _metrics(self.prefix)
        if ray_metrics is None:
            return
        try:
            ray_metrics[name].set(value, tags=tags)
        except Exception as exc:
            log.debug("setting gauge %s failed: %r", name, exc)

    def snapshot(self) -> dict[str, int]:
        """In-process counts, keyed "name|label|...": e.g. "routing_decisions|m|affinity"."""
        with self._lock:
            return {"|".join(key): value for key, value in self._counts.items()}

    def count(self, name: str, *labels: str) -> int:
        """One in-process count, e.g. `count("requests", tenant, model, "200")`."""
        with self._lock:
            return self._counts.get((name, *labels), 0)


_default: PlatformMetrics | None = None


def default_metrics() -> PlatformMetrics:
    """The process-wide facade (one per ingress or router process)."""
    global _default
    if _default is None:
        _default = PlatformMetrics()
    return _default


def observe_request(record: Any) -> None:
    """An ingress request observer (`request_observer: "antumbra.platform.metrics:observe_request"`).

    Reads a `RequestRecord`'s `tenant_id`, `model`, `status`, token counts, `ttft_s` and
    `duration_s`; TPOT is `(duration_s - ttft_s) / (completion_tokens - 1)` when more than
    one token was generated. Queue time is recorded when the record has `queue_s`.
    """
    ttft = getattr(record, "ttft_s", None)
    completion = int(getattr(record, "completion_tokens", 0) or 0)
    duration = getattr(record, "duration_s", None)
    tpot = None
    if ttft is not None and duration is not None and completion > 1:
        tpot = max(0.0, (duration - ttft) / (completion - 1))
    default_metrics().record_request(
        getattr(record, "tenant_id", None) or "anonymous",
        getattr(record, "model", None) or "unknown",
        int(getattr(record, "status", 0) or 0),
        prompt_tokens=int(getattr(record, "prompt_tokens", 0) or 0),
        cached_tokens=int(getattr(record, "cached_tokens", 0) or 0),
        completion_tokens=completion,
        ttft_s=ttft,
        tpot_s=tpot,
        queue_s=getattr(record, "queue_s", None),
        drafted_tokens=int(getattr(record, "drafted_tokens", 0) or 0),
        accepted_tokens=int(getattr(record, "accepted_tokens", 0) or 0),
    )
