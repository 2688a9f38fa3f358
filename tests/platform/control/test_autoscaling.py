"""Autoscaling policies on recorded replica stats, through Ray Serve 2.60's own AutoscalingContext."""

from __future__ import annotations

from typing import Any

import pytest
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from antumbra.platform.control.autoscaling import (
    AUTOSCALING_POLICIES,
    STATE_KEY,
    CombinedPolicy,
    KVPoolPolicy,
    NamedPolicy,
    QueueDepthPolicy,
    SLOPolicy,
    TTFTPolicy,
    make_policy,
    ray_autoscaling_policy,
)

DEP = DeploymentID(name="tiny", app_name="antumbra")
NOW = 10_000.0


def rid(i: int) -> ReplicaID:
    return ReplicaID(unique_id=f"rep{i}", deployment_id=DEP)


def context(
    *,
    current: int,
    target: int | None = None,
    ongoing: float = 0.0,
    stats: list[dict[str, float]] | None = None,
    ttft_series: list[list[tuple[float, float]]] | None = None,
    min_replicas: int = 1,
    max_replicas: int = 8,
    config: AutoscalingConfig | None = None,
    policy_state: dict[str, Any] | None = None,
) -> AutoscalingContext:
    """A real AutoscalingContext; `stats[i]` is what replica i's record_autoscaling_stats() gave."""
    replicas = [rid(i) for i in range(current)]
    aggregated: dict[str, dict[ReplicaID, float]] = {}
    raw: dict[str, dict[ReplicaID, list[TimeStampedValue]]] = {}
    for replica, replica_stats in zip(replicas, stats or [], strict=False):
        for name, value in replica_stats.items():
            aggregated.setdefault(name, {})[replica] = value
            raw.setdefault(name, {})[replica] = [TimeStampedValue(NOW - 1, value)]
    if ttft_series is not None:
        raw["ttft_p90_s"] = {
            replica: [TimeStampedValue(t, v) for t, v in series]
            for replica, series in zip(replicas, ttft_series, strict=False)
        }
    return AutoscalingContext(
        deployment_id=DEP,
        deployment_name=DEP.name,
        app_name=DEP.app_name,
        current_num_replicas=current,
        target_num_replicas=current if target is None else target,
        running_replicas=replicas,
        total_num_requests=lambda: ongoing,  # lazily evaluated, as the controller passes it
        total_queued_requests=0.0,
        aggregated_metrics=lambda: aggregated,
        raw_metrics=lambda: raw,
        capacity_adjusted_min_replicas=min_replicas,
        capacity_adjusted_max_replicas=max_replicas,
        policy_state=policy_state or {},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=NOW,
        config=config or AutoscalingConfig(min_replicas=min_replicas, max_replicas=max_replicas,
                                           target_ongoing_requests=4),
    )


def test_queue_depth_targets_ongoing_requests_per_replica() -> None:
    p = QueueDepthPolicy()  # target from the config: 4
    assert p(context(current=1, ongoing=3))[0] == 1
    assert p(context(current=1, ongoing=9))[0] == 3
    assert p(context(current=3, ongoing=8))[0] == 2
    assert p(context(current=3, ongoing=0))[0] == 1  # clamped to min_replicas
    assert p(context(current=3, ongoing=0, min_replicas=0))[0] == 0
    assert p(context(current=2, ongoing=1000))[0] == 8  # clamped to max_replicas
    explicit = QueueDepthPolicy(target_ongoing_requests=10)
    desired, state = explicit(context(current=1, ongoing=25))
    assert desired == 3
    assert state[STATE_KEY]["signals"] == {"ongoing_requests": 25.0, "target_per_replica": 10}
    # Exactly: no +1.
    assert QueueDepthPolicy(target_ongoing_requests=2)(context(current=1, ongoing=4.0))[0] == 2


def test_kv_pool_watermarks_with_hysteresis() -> None:
    p = KVPoolPolicy(high_watermark=0.8, low_watermark=0.4)  # mid 0.6
    # A replica's use is its fullest pool.
    over = [{"kv_use_swa": 0.95, "kv_use_c4": 0.5}, {"kv_use_swa": 0.7, "kv_use_c4": 0.85}]
    desired, state = p(context(current=2, stats=over))
    assert desired == 3  # mean use 0.9: ceil(2 * 0.9 / 0.6)
    assert state[STATE_KEY]["signals"]["kv_use"] == pytest.approx(0.9)
    just_over = [{"kv_use_c4": 0.82}, {"kv_use_c4": 0.82}]
    assert p(context(current=2, stats=just_over))[0] == 3
    band = [{"kv_use_c4": 0.6}, {"kv_use_c4": 0.75}]
    assert p(context(current=2, stats=band))[0] == 2
    assert p(context(current=2, target=3, stats=band))[0] == 3  # in the band nothing changes
    under = [{"kv_use_c4": 0.1}, {"kv_use_c4": 0.2}, {"kv_use_c4": 0.3}, {"kv_use_c4": 0.2}]
    assert p(context(current=4, stats=under))[0] == 2  # ceil(4 * 0.2 / 0.6)
    assert p(context(current=1, stats=[{"kv_use_c4": 0.3}]))[0] == 1  # one replica in use stays
    idle = [{"kv_use_c4": 0.0}, {"kv_use_c4": 0.0}]
    assert p(context(current=2, stats=idle, min_replicas=0))[0] == 0
    # No KV stats at all: no opinion, keep the target.
    assert p(context(current=2, target=3, stats=[{"other": 1.0}]))[0] == 3
    with pytest.raises(ValueError):
        KVPoolPolicy(high_watermark=0.3, low_watermark=0.5)


def test_ttft_target() -> None:
    p = TTFTPolicy(target_s=1.0, low_fraction=0.5, window_s=60)
    slow = [[(NOW - 10, 1.5), (NOW - 5, 1.8)], [(NOW - 10, 0.9), (NOW - 2, 1.1)]]
    desired, state = p(context(current=2, ongoing=3, ttft_series=slow))
    assert desired == 4  # p90 1.8 s: ceil(2 * 1.8)
    assert state[STATE_KEY]["signals"] == {"ttft_s": 1.8, "samples": 4}
    a_bit_slow = [[(NOW - 1, 1.1)], [(NOW - 1, 1.05)]]
    assert p(context(current=2, ongoing=1, ttft_series=a_bit_slow))[0] == 3  # at least one more
    very_slow = [[(NOW - 1, 30.0)]]
    assert p(context(current=2, ongoing=1, ttft_series=very_slow))[0] == 4  # at most max_step_ratio (2x)
    # Slow samples but nothing ongoing: the burst is over, no opinion (the target stays).
    assert p(context(current=2, ongoing=0, ttft_series=very_slow))[0] == 2
    assert p(context(current=2, target=3, ongoing=0, ttft_series=very_slow))[0] == 3
    fast = [[(NOW - 1, 0.2)], [(NOW - 1, 0.3)], [(NOW - 1, 0.1)]]
    assert p(context(current=3, ttft_series=fast))[0] == 2
    assert p(context(current=1, ttft_series=[[(NOW - 1, 0.1)]], min_replicas=0))[0] == 1  # traffic: keep one
    ok = [[(NOW - 1, 0.7)], [(NOW - 1, 0.9)]]
    assert p(context(current=2, ttft_series=ok))[0] == 2
    # Samples older than the window are ignored; with none left, the aggregated values count.
    stale = [[(NOW - 600, 9.0)], [(NOW - 600, 9.0)]]
    assert p(context(current=2, target=2, ttft_series=stale))[0] == 2
    agg = p(context(current=2, ongoing=1, stats=[{"ttft_p90_s": 3.0}, {"ttft_p90_s": 0.5}]))
    assert agg[0] == 4


def test_slo_attainment_target() -> None:
    p = SLOPolicy(target_attainment=0.9, low_pressure=0.5, window_s=60)

    def slo(attainment: float, pressure: float) -> dict[str, float]:
        return {"slo_attainment": attainment, "slo_pressure": pressure}

    desired, state = p(context(current=2, ongoing=3, stats=[slo(0.95, 0.8), slo(0.6, 1.7)]))
    assert desired == 3  # the worst replica's worst tenant is under target: one more
    assert state[STATE_KEY]["signals"] == {"slo_attainment": 0.6, "slo_pressure": 1.7, "samples": 2}
    # Idle: the samples outlive their traffic, so a breach no longer holds replicas (down to min).
    idle, idle_state = p(context(current=2, ongoing=0, stats=[slo(0.6, 1.7)] * 2))
    assert idle == 1 and idle_state[STATE_KEY]["signals"] == {"idle": True, "samples": 2}
    assert p(context(current=3, ongoing=0, stats=[slo(0.6, 1.7)] * 3, min_replicas=2))[0] == 2
    assert p(context(current=2, target=3, ongoing=0, stats=[{"queue_len": 0.0}] * 2))[0] == 1
    assert p(context(current=2, ongoing=3, stats=[slo(1.0, 0.3), slo(1.0, 0.45)]))[0] == 1  # headroom
    assert p(context(current=2, ongoing=3, stats=[slo(1.0, 0.3), slo(0.95, 0.8)]))[0] == 2  # near target
    # Busy, but no tenant with SLO targets served: no opinion.
    assert p(context(current=2, target=3, ongoing=3, stats=[{"queue_len": 1.0}] * 2))[0] == 3
    with pytest.raises(ValueError):
        SLOPolicy(target_attainment=0.0)


def test_slo_breach_scales_one_to_two_and_back_through_ray_wrapper() -> None:
    """Per tick: (ongoing requests, each replica's SLO attainment and pressure); Ray's own delays."""
    config = AutoscalingConfig(min_replicas=1, max_replicas=4, target_ongoing_requests=100,
                               upscale_delay_s=0, downscale_delay_s=0)
    policy = _apply_autoscaling_config(NamedPolicy("combined", parts=("queue_depth", "slo")))
    trace = [
        (4, 1.0, 0.7),  # within target, not far below it: one replica
        (6, 0.7, 1.4),  # 30% of a tenant's requests late: breach
        (6, 0.95, 0.8),  # two replicas hold it
        (6, 1.0, 0.6),
        (2, 1.0, 0.3),  # far inside the targets: back to one
        (2, 1.0, 0.3),
    ]
    current, state, history = 1, {}, []
    for ongoing, attainment, pressure in trace:
        stats = [{"slo_attainment": attainment, "slo_pressure": pressure}] * current
        current, state = policy(context(current=current, ongoing=ongoing, stats=stats, config=config,
                                        policy_state=state, max_replicas=4))
        history.append(current)
    assert history == [1, 2, 2, 2, 1, 1]


def test_slo_alone_scales_back_down_once_the_load_stops_after_a_breach() -> None:
    """Per tick: (ongoing requests, the replicas' SLO attainment and pressure); the breach's samples
    are still reported after the load stopped, as a replica reports its window's outcomes."""
    config = AutoscalingConfig(min_replicas=1, max_replicas=2, upscale_delay_s=0, downscale_delay_s=0)
    policy = _apply_autoscaling_config(NamedPolicy("slo"))
    trace = [(2, 0.0, 40.0), (2, 0.0, 40.0), (2, 0.5, 20.0), (0, 0.5, 20.0), (0, 0.5, 20.0)]
    current, state, history = 1, {}, []
    for ongoing, attainment, pressure in trace:
        stats = [{"slo_attainment": attainment, "slo_pressure": pressure}] * current
        current, state = policy(context(current=current, ongoing=ongoing, stats=stats, config=config,
                                        policy_state=state, max_replicas=2))
        history.append(current)
    assert history == [2, 2, 2, 1, 1]


def test_combined_takes_the_largest_vote_and_skips_silent_parts() -> None:
    p = CombinedPolicy(queue_depth={"target_ongoing_requests": 4}, kv_pool={"high_watermark": 0.8,
                       "low_watermark": 0.4}, ttft={"target_s": 1.0})
    # Queue says 1, KV is over the high watermark: KV wins.
    desired, state = p(context(current=2, ongoing=3, stats=[{"kv_use_c4": 0.9}, {"kv_use_c4": 0.9}]))
    assert desired == 3
    signals = state[STATE_KEY]["signals"]
    assert signals["queue_depth"]["vote"] == 1 and signals["kv_pool"]["vote"] == 3
    assert signals["ttft"] == {"vote": None}
    # Queue says 5 (20 ongoing), TTFT fine, KV in band: queue wins.
    assert p(context(current=2, ongoing=20, stats=[{"kv_use_c4": 0.5}] * 2))[0] == 5
    # Idle: every signal low; no silent part blocks the scale-down.
    idle = p(context(current=3, ongoing=0, stats=[{"kv_use_c4": 0.0}] * 3, min_replicas=1))
    assert idle[0] == 1
    # KV in the hysteresis band holds the replicas even when the queue would shed one.
    assert p(context(current=2, ongoing=2, stats=[{"kv_use_c4": 0.6}] * 2))[0] == 2
    with pytest.raises(ValueError):
        CombinedPolicy(parts=("queue_depth",), kv_pool={})
    with pytest.raises(ValueError):
        CombinedPolicy(parts=("combined",))


def test_registry_selects_by_name() -> None:
    assert set(AUTOSCALING_POLICIES) == {"queue_depth", "kv_pool", "ttft", "slo", "combined"}
    assert isinstance(make_policy("kv_pool", high_watermark=0.9), KVPoolPolicy)
    assert isinstance(NamedPolicy("ttft", target_s=0.5).policy, TTFTPolicy)
    with pytest.raises(ValueError, match="unknown autoscaling policy"):
        make_policy("nope")


def test_recorded_trace_scales_up_then_back_down_through_ray_wrapper() -> None:
    """A recorded ramp (ongoing requests, KV use, TTFT per tick) through Ray Serve's own wrapper."""
    config = AutoscalingConfig(min_replicas=1, max_replicas=4, target_ongoing_requests=4,
                               upscale_delay_s=0, downscale_delay_s=0)
    policy = _apply_autoscaling_config(NamedPolicy("combined", ttft={"target_s": 1.0}))
    # (ongoing requests, per-replica KV use, per-replica recent p90 TTFT)
    trace = [
        (2, 0.30, 0.4),
        (6, 0.70, 0.8),
        (7, 0.90, 1.6),  # KV over the watermark and TTFT over target: scale up
        (8, 0.60, 0.9),
        (3, 0.30, 0.3),
        (1, 0.10, 0.2),  # quiet: back down
        (0, 0.00, 0.1),
    ]
    current, state, history = 1, {}, []
    for ongoing, kv, ttft in trace:
        ctx = context(current=current, ongoing=ongoing, stats=[{"kv_use_c4": kv}] * current,
                      ttft_series=[[(NOW - 1, ttft)]] * current, config=config, policy_state=state,
                      max_replicas=4)
        current, state = policy(ctx)
        history.append(current)
        assert "__decision_counters" in state and STATE_KEY in state  # Ray's and ours side by side
    assert history[2] >= 2 and max(history) <= 4
    assert history[-1] == 1
    # Down: the queue and KV would drop to 1-2 at once; a fast TTFT sheds one replica per tick.
    assert history == [1, 2, 4, 4, 3, 2, 1]


def test_ray_autoscaling_policy_resolves_in_the_controller_path() -> None:
    spec = ray_autoscaling_policy("combined", kv_pool={"high_watermark": 0.9, "low_watermark": 0.3})
    assert spec.policy_function == "antumbra.platform.control.autoscaling:NamedPolicy"
    assert spec.policy_kwargs["name"] == "combined"
    config = AutoscalingConfig(min_replicas=1, max_replicas=4, policy=spec)
    fn = _resolve_policy_callable(config.policy)  # what the controller does: unpickle, instantiate
    desired, state = fn(context(current=2, ongoing=1, stats=[{"kv_use_swa": 0.95}] * 2))
    assert desired == 4 and state[STATE_KEY]["policy"] == "combined"  # ceil(2 * 0.95 / 0.6)
    with pytest.raises(ValueError):
        ray_autoscaling_policy("combined", bogus={})
