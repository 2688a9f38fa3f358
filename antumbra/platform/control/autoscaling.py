"""Autoscaling policies for Ray Serve's custom autoscaling API, driven by the replicas' stats.

Each policy is a small class whose instances are `fn(ctx) -> (desired_replicas, state)` over
Ray Serve's `AutoscalingContext` (`ray.serve.config`): they read `current_num_replicas`,
`target_num_replicas`, `total_num_requests`, `aggregated_metrics` / `raw_metrics` (what
each replica's `record_autoscaling_stats()` returned, keyed by metric name, then replica),
`capacity_adjusted_min_replicas` / `_max_replicas`, `current_time` and `config`. Ray Serve
then applies the scaling factors, the up/down delays and the bounds.

Metrics a model replica reports from `record_autoscaling_stats()`:

  `kv_use_<pool>`   use, 0..1, of each KV pool (`kv_use_swa`, `kv_use_c4`, ...)
  `ttft_p90_s`      p90 time to first token of its recent requests, in seconds; omitted
                    while it has served none
  `slo_attainment`  the lowest, over tenants with SLO targets, fraction of its recent
                    requests that met every target; omitted while it has served none
  `slo_pressure`    p90 over those requests of observed / target time (the larger of TTFT
                    and time per output token): above 1 a target was missed

Internally every policy first *votes*: a replica count, or None for "no opinion" (no
data). Standing alone, a policy with no opinion keeps `target_num_replicas`; the combined
policy takes the largest vote, so a signal that needs capacity wins and a silent one never
blocks a scale-down.

Policies are chosen per model by name from `AUTOSCALING_POLICIES`; `ray_autoscaling_policy`
builds the `ray.serve.config.AutoscalingPolicy` for a deployment's autoscaling config.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingPolicy

KV_USE_PREFIX = "kv_use_"
TTFT_P90_METRIC = "ttft_p90_s"
SLO_ATTAINMENT_METRIC = "slo_attainment"
SLO_PRESSURE_METRIC = "slo_pressure"
STATE_KEY = "antumbra"  # our part of the policy state (Ray Serve keeps its own keys beside it)
DEFAULT_TARGET_ONGOING_REQUESTS = 2.0  # Ray Serve's default, for a context without config
_EPS = 1e-9

Vote = tuple[int | None, dict[str, Any]]


class ContextLike(Protocol):
    """The attributes of `ray.serve.config.AutoscalingContext` that the policies read."""

    current_num_replicas: int
    target_num_replicas: int
    capacity_adjusted_min_replicas: int
    capacity_adjusted_max_replicas: int
    current_time: float | None
    config: Any

    @property
    def total_num_requests(self) -> float: ...

    @property
    def aggregated_metrics(self) -> dict[str, dict[Any, float]] | None: ...

    @property
    def raw_metrics(self) -> dict[str, dict[Any, Any]] | None: ...


def _clamp(ctx: ContextLike, n: int) -> int:
    return max(ctx.capacity_adjusted_min_replicas, min(ctx.capacity_adjusted_max_replicas, n))


def _ceil(x: float) -> int:
    return math.ceil(x - _EPS)


def recent_samples(ctx: ContextLike, metric: str, window_s: float) -> list[float]:
    """The replicas' values of `metric` from the last `window_s` seconds before `current_time`
    (`raw_metrics`); when there are none, their aggregated values."""
    raw = (ctx.raw_metrics or {}).get(metric) or {}
    since = None if ctx.current_time is None else ctx.current_time - window_s
    samples = [
        float(point.value)
        for series in raw.values()
        for point in series
        if since is None or point.timestamp >= since
    ]
    if samples:
        return samples
    return [float(v) for v in ((ctx.aggregated_metrics or {}).get(metric) or {}).values()]


class ScalingPolicy(abc.ABC):
    """Base: `__call__` turns the subclass's vote into Ray Serve's `(replicas, state)`."""

    name = "base"

    @abc.abstractmethod
    def vote(self, ctx: ContextLike) -> Vote:
        """The replica count this policy wants (None: no opinion) and the signals it used."""

    def __call__(self, ctx: ContextLike) -> tuple[int, dict[str, Any]]:
        replicas, signals = self.vote(ctx)
        desired = _clamp(ctx, ctx.target_num_replicas if replicas is None else replicas)
        return desired, {STATE_KEY: {"policy": self.name, "desired": desired, "signals": signals}}


class QueueDepthPolicy(ScalingPolicy):
    """Target ongoing requests per replica.

    Algorithm: with `N` = Ray Serve's `total_num_requests` (running + queued, aggregated over
    its look-back window) and `t` = `target_ongoing_requests` (else the deployment's
    autoscaling config, else 2), vote `ceil(N / t)`.
    """

    name = "queue_depth"

    def __init__(self, target_ongoing_requests: float | None = None) -> None:
        if target_ongoing_requests is not None and target_ongoing_requests <= 0:
            raise ValueError("target_ongoing_requests must be positive")
        self.target_ongoing_requests = target_ongoing_requests

    def _target(self, ctx: ContextLike) -> float:
        if self.target_ongoing_requests is not None:
            return self.target_ongoing_requests
        if ctx.config is not None:
            return float(ctx.config.get_target_ongoing_requests())
        return DEFAULT_TARGET_ONGOING_REQUESTS

    def vote(self, ctx: ContextLike) -> Vote:
        ongoing = float(ctx.total_num_requests or 0.0)
        target = self._target(ctx)
        return _ceil(ongoing / target), {"ongoing_requests": ongoing, "target_per_replica": target}


class KVPoolPolicy(ScalingPolicy):
    """Keep KV pool use between a low and a high watermark.

    Algorithm: each replica's use is the max over its `kv_use_*` metrics (its fullest pool);
    `u` is the mean of that over the replicas reporting it, `n` = `current_num_replicas` and
    `m = (low + high) / 2`. No replica reporting: no opinion. `u > high`: vote
    `max(target_num_replicas, n + 1, ceil(n·u/m))`; `u < low`: vote `ceil(n·u/m)` (at most
    `n`; the survivors then run near `m`, below `high`); otherwise (the hysteresis band)
    vote `target_num_replicas`, i.e. change nothing.
    """

    name = "kv_pool"

    def __init__(self, high_watermark: float = 0.85, low_watermark: float = 0.5) -> None:
        if not 0.0 <= low_watermark < high_watermark <= 1.0:
            raise ValueError("need 0 <= low_watermark < high_watermark <= 1")
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark

    def vote(self, ctx: ContextLike) -> Vote:
        per_replica: dict[Any, float] = {}
        for metric, values in (ctx.aggregated_metrics or {}).items():
            if metric.startswith(KV_USE_PREFIX):
                for replica, value in values.items():
                    per_replica[replica] = max(per_replica.get(replica, 0.0), float(value))
        n = ctx.current_num_replicas
        if not per_replica or n == 0:
            return None, {}
        use = sum(per_replica.values()) / len(per_replica)
        mid = (self.low_watermark + self.high_watermark) / 2
        signals = {"kv_use": use, "replicas_reporting": len(per_replica)}
        if use > self.high_watermark:
            return max(ctx.target_num_replicas, n + 1, _ceil(n * use / mid)), signals
        if use < self.low_watermark:
            return _ceil(n * use / mid), signals
        return ctx.target_num_replicas, signals


class TTFTPolicy(ScalingPolicy):
    """Hold the recent p90 time to first token under a target.

    Algorithm: `p` = the `quantile` (nearest rank) of the replicas' `ttft_p90_s` samples
    taken in the last `window_s` seconds before `current_time` (`raw_metrics`; when there are
    none, the replicas' aggregated values); no samples: no opinion. With
    `n` = `current_num_replicas`: `p > target_s`: vote
    `max(target_num_replicas, n + 1, ceil(n·min(p/target_s, max_step_ratio)))`, unless no request
    is ongoing (`total_num_requests` is 0: no opinion); `p < low_fraction·target_s`: vote
    `max(1, n - 1)`; otherwise vote `target_num_replicas`.

    Why the idle exception: a replica keeps reporting the p90 of its last minute with fresh
    timestamps after its traffic stops, so recent samples do not mean recent traffic, and a slow
    burst that has ended would otherwise keep adding replicas to an idle deployment.
    """

    name = "ttft"

    def __init__(
        self,
        target_s: float = 2.0,
        low_fraction: float = 0.5,
        window_s: float = 60.0,
        quantile: float = 0.9,
        max_step_ratio: float = 2.0,
    ) -> None:
        if target_s <= 0 or not 0 <= low_fraction < 1 or not 0 < quantile <= 1 or max_step_ratio < 1:
            raise ValueError(
                "need target_s > 0, 0 <= low_fraction < 1, 0 < quantile <= 1, max_step_ratio >= 1"
            )
        self.target_s = target_s
        self.low_fraction = low_fraction
        self.window_s = window_s
        self.quantile = quantile
        self.max_step_ratio = max_step_ratio

    def vote(self, ctx: ContextLike) -> Vote:
        samples = sorted(recent_samples(ctx, TTFT_P90_METRIC, self.window_s))
        n = ctx.current_num_replicas
        if not samples or n == 0:
            return None, {}
        p = samples[max(0, math.ceil(self.quantile * len(samples)) - 1)]
        signals = {"ttft_s": p, "samples": len(samples)}
        if p > self.target_s and not ctx.total_num_requests:
            return None, signals
        if p > self.target_s:
            step = min(p / self.target_s, self.max_step_ratio)
            return max(ctx.target_num_replicas, n + 1, _ceil(n * step)), signals
        if p < self.low_fraction * self.target_s:
            return max(1, n - 1), signals
        return ctx.target_num_replicas, signals


class SLOPolicy(ScalingPolicy):
    """Keep the tenants' SLO attainment at a target.

    Algorithm: `a` = the lowest of the replicas' `slo_attainment` samples of the last `window_s`
    seconds (`raw_metrics`, else the aggregated values): the worst-served tenant on the worst
    replica; `p` = the highest of their `slo_pressure` samples. No request ongoing
    (`total_num_requests` is 0): vote 0, whatever the samples say; Ray Serve's downscale delay and
    `min_replicas` bound the step. Otherwise no samples (no tenant with SLO targets was served): no
    opinion. With `n` = `current_num_replicas`: `a < target_attainment`: vote
    `max(target_num_replicas, n + 1)`; `p < low_pressure` (every recent request finished well inside
    its targets): vote `max(1, n - 1)`; otherwise vote `target_num_replicas`.

    Why idle is checked first: the samples outlive the traffic that made them (a replica reports its
    window's outcomes with fresh timestamps after its traffic stops, then nothing at all), so neither
    a breach nor its absence says anything about an idle deployment. Standing alone, a policy that
    kept its replicas there would never scale back down after a breach; in a combined policy the vote
    of 0 blocks no other part.
    """

    name = "slo"

    def __init__(
        self, target_attainment: float = 0.9, low_pressure: float = 0.5, window_s: float = 60.0
    ) -> None:
        if not 0 < target_attainment <= 1 or not 0 < low_pressure < 1 or window_s <= 0:
            raise ValueError("need 0 < target_attainment <= 1, 0 < low_pressure < 1 and window_s > 0")
        self.target_attainment = target_attainment
        self.low_pressure = low_pressure
        self.window_s = window_s

    def vote(self, ctx: ContextLike) -> Vote:
        attained = recent_samples(ctx, SLO_ATTAINMENT_METRIC, self.window_s)
        pressure = recent_samples(ctx, SLO_PRESSURE_METRIC, self.window_s)
        n = ctx.current_num_replicas
        if not ctx.total_num_requests:
            return 0, {"idle": True, "samples": len(attained)}
        if not attained or n == 0:
            return None, {}
        a, p = min(attained), max(pressure, default=0.0)
        signals = {"slo_attainment": a, "slo_pressure": p, "samples": len(attained)}
        if a < self.target_attainment:
            return max(ctx.target_num_replicas, n + 1), signals
        if p < self.low_pressure:
            return max(1, n - 1), signals
        return ctx.target_num_replicas, signals


class CombinedPolicy(ScalingPolicy):
    """The largest vote of its parts (queue depth, KV pool use, TTFT and SLO attainment by default).

    Algorithm: run each part's `vote`; policies without an opinion are skipped; vote the
    maximum of the rest (no opinions at all: `target_num_replicas`). Each part is configured
    by the keyword argument of its name (`queue_depth`, `kv_pool`, `ttft`: a dict of its
    arguments); `parts` lists which take part.
    """

    name = "combined"

    def __init__(
        self,
        parts: Iterable[str] = ("queue_depth", "kv_pool", "ttft", "slo"),
        **part_kwargs: dict[str, Any],
    ) -> None:
        parts = list(parts)
        unknown = set(part_kwargs) - set(parts)
        if unknown:
            raise ValueError(f"arguments for policies that take no part: {sorted(unknown)}")
        if "combined" in parts:
            raise ValueError("a combined policy cannot contain itself")
        self.parts = [make_policy(name, **part_kwargs.get(name, {})) for name in parts]

    def vote(self, ctx: ContextLike) -> Vote:
        votes: list[int] = []
        signals: dict[str, Any] = {}
        for part in self.parts:
            replicas, part_signals = part.vote(ctx)
            signals[part.name] = {"vote": replicas, **part_signals}
            if replicas is not None:
                votes.append(replicas)
        return (max(votes) if votes else None), signals


AUTOSCALING_POLICIES: dict[str, type[ScalingPolicy]] = {
    QueueDepthPolicy.name: QueueDepthPolicy,
    KVPoolPolicy.name: KVPoolPolicy,
    TTFTPolicy.name: TTFTPolicy,
    SLOPolicy.name: SLOPolicy,
    CombinedPolicy.name: CombinedPolicy,
}


def make_policy(name: str, **kwargs: Any) -> ScalingPolicy:
    """The policy registered under `name`, built with `kwargs`."""
    try:
        cls = AUTOSCALING_POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown autoscaling policy {name!r}; known: {sorted(AUTOSCALING_POLICIES)}"
        ) from None
    return cls(**kwargs)


class NamedPolicy:
    """Ray Serve's entry point: Ray instantiates it once with `policy_kwargs` and calls it per tick.

    `NamedPolicy(name="combined", kv_pool={...})` behaves as `make_policy("combined", kv_pool={...})`.
    """

    def __init__(self, name: str, **kwargs: Any) -> None:
        self.policy = make_policy(name, **kwargs)

    def __call__(self, ctx: ContextLike) -> tuple[int, dict[str, Any]]:
        return self.policy(ctx)


def ray_autoscaling_policy(name: str, **kwargs: Any) -> AutoscalingPolicy:
    """The `ray.serve.config.AutoscalingPolicy` running policy `name` (kwargs must be JSON-serialisable)."""
    from ray.serve.config import AutoscalingPolicy

    make_policy(name, **kwargs)  # fail here, not in the controller, on a bad name or argument
    return AutoscalingPolicy(
        policy_function=f"{__name__}:{NamedPolicy.__name__}", policy_kwargs={"name": name, **kwargs}
    )
