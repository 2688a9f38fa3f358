"""The cache-affinity routing policy, without Ray."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from antumbra.platform.routing.policy import CacheAffinityPolicy, ReplicaLoad

PAGE = 16


def policy(seed: int = 0, **kwargs: object) -> CacheAffinityPolicy:
    return CacheAffinityPolicy(page_size=PAGE, rng=random.Random(seed), **kwargs)  # type: ignore[arg-type]


def replicas(*queues: int, max_ongoing: int = 16, kv: float = 0.0) -> list[ReplicaLoad]:
    return [ReplicaLoad(f"r{i}", q, running_tokens=100 * q, kv_use=kv, max_ongoing=max_ongoing)
            for i, q in enumerate(queues)]


def test_affinity_to_the_longest_match() -> None:
    p = policy()
    reps = replicas(1, 1, 1, 1)
    decision = p.rank(1000, {"r1": 10, "r2": 40, "r3": 20}, reps)
    assert decision.tiers[0] == ["r2"]
    assert decision.reason == "affinity"
    assert decision.best_match_blocks == 40 and decision.chosen_match_blocks == 40
    # The rest follow by cost, two per tier.
    assert decision.tiers[1:] == [["r3", "r1"], ["r0"]]


def test_match_beyond_the_prompt_is_clamped() -> None:
    # Two replicas matching the whole 64-token prompt tie on prefill; load breaks the tie.
    decision = policy().rank(64, {"r0": 100, "r1": 4}, replicas(3, 0))
    assert decision.chosen_match_blocks == 4
    assert decision.tiers[0][0] == "r1"


def test_load_tips_it_when_the_match_is_small() -> None:
    p = policy(load_weight=2048)
    reps = [ReplicaLoad("a", 4, kv_use=0.2, max_ongoing=16), ReplicaLoad("b", 0, kv_use=0.0, max_ongoing=16)]
    # Load 0.45 (under the hot-spot gate) costs 2048 * 0.45 = 922 tokens on "a".
    # One block (16 tokens) saved on "a" is worth less than that.
    assert p.choose(2000, {"a": 1}, reps)[0] == ["b"]
    # 100 blocks (1600 tokens) saved outweigh the same load.
    assert p.choose(2000, {"a": 100}, reps)[0] == ["a"]


def test_near_ties_share_the_first_tier_and_exact_ties_are_broken_by_the_rng() -> None:
    reps = replicas(0, 0, 0, 0)
    firsts = Counter()
    for seed in range(200):
        tiers = policy(seed).choose(300, {}, reps)
        assert len(tiers[0]) == 2  # equal costs: two in the first tier, Ray picks by queue probe
        firsts.update(tiers[0])
    assert set(firsts) == {"r0", "r1", "r2", "r3"}
    assert min(firsts.values()) > 50
    # Same seed, same answer.
    assert policy(7).choose(300, {}, reps) == policy(7).choose(300, {}, reps)
    # Costs further apart than tie_tokens do not share a tier.
    assert policy().choose(300, {"r0": 2}, reps)[0] == ["r0"]


def test_hot_spot_gate_spreads_a_hot_prefix() -> None:
    # Every request shares a long cached prefix held only by r0. Each routed request adds
    # to its replica's queue; once a replica also holds the prefix, the directory says so.
    p = policy(hot_spot_gate=0.25)
    queues = Counter({"r0": 0, "r1": 0, "r2": 0})
    holders = {"r0"}
    reasons = Counter()
    for _ in range(60):
        reps = [ReplicaLoad(r, queues[r], max_ongoing=16) for r in sorted(queues)]
        decision = p.rank(8000, {r: 500 for r in holders}, reps)
        chosen = decision.tiers[0][0]
        reasons[decision.reason] += 1
        queues[chosen] += 1
        holders.add(chosen)
    # Without the gate all 60 would go to r0 (8000 cached tokens outweigh any load term).
    assert max(queues.values()) - min(queues.values()) <= 5
    assert reasons["hot_spot"] > 0
    ungated = policy(hot_spot_gate=10.0)
    reps = [ReplicaLoad("r0", 15, max_ongoing=16), ReplicaLoad("r1", 0, max_ongoing=16)]
    assert ungated.choose(8000, {"r0": 500}, reps)[0] == ["r0"]
    gated = policy(hot_spot_gate=0.5)
    assert gated.rank(8000, {"r0": 500}, reps).tiers == [["r1"], ["r0"]]


def test_hot_spot_prefers_a_cool_replica_with_a_partial_match() -> None:
    reps = [ReplicaLoad("hot", 14, max_ongoing=16), ReplicaLoad("warm", 2, max_ongoing=16),
            ReplicaLoad("idle", 0, max_ongoing=16)]
    decision = policy().rank(4000, {"hot": 250, "warm": 200}, reps)
    assert decision.reason == "hot_spot"
    assert decision.tiers[0] == ["warm"] and decision.tiers[-1][-1] == "hot"


def test_sigma_gate() -> None:
    reps = [ReplicaLoad(f"r{i}", q, max_ongoing=16) for i, q in enumerate([4, 0, 0, 0, 0, 0, 0, 0])]
    # Load difference 0.25 is under the absolute gate, but far above mean + 1 sigma.
    assert policy(hot_spot_gate=0.5).choose(4000, {"r0": 250}, reps)[0] == ["r0"]
    assert policy(hot_spot_gate=0.5, hot_spot_sigma=1.0).choose(4000, {"r0": 250}, reps)[0] != ["r0"]


def test_kv_use_counts_as_load() -> None:
    reps = [
        ReplicaLoad("full", 0, kv_use=0.98, max_ongoing=16),
        ReplicaLoad("empty", 0, kv_use=0.1, max_ongoing=16),
    ]
    assert policy().rank(500, {}, reps).tiers[0] == ["empty"]
    assert policy().rank(500, {}, reps).reason == "load"


def test_directory_down_means_power_of_two_choices() -> None:
    reps = replicas(0, 5, 9, 1, 2)
    seen = Counter()
    for seed in range(300):
        decision = policy(seed).rank(1000, None, reps)
        assert decision.reason == "no_directory"
        assert len(decision.tiers) == 1 and len(decision.tiers[0]) == 2
        assert len(set(decision.tiers[0])) == 2
        seen.update(decision.tiers[0])
    assert set(seen) == {r.replica_id for r in reps}
    assert policy().choose(10, None, replicas(3)) == [["r0"]]


def test_replica_load_from_routing_stats() -> None:
    r = ReplicaLoad.from_stats("x", {"queue_len": 4, "running_tokens": 900, "kv_use": 0.5, "other": 1}, 8)
    assert r == ReplicaLoad("x", 4, 900, 0.5, 8) and r.load == pytest.approx(1.0)
    assert ReplicaLoad.from_stats("y", None, 8) == ReplicaLoad("y", 0, 0, 0.0, 8)


def test_no_replicas() -> None:
    assert policy().choose(100, {}, []) == []
    assert policy().choose(100, None, []) == []


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        CacheAffinityPolicy(page_size=0, rng=random.Random(0))
    with pytest.raises(ValueError):
        CacheAffinityPolicy(page_size=16, rng=random.Random(0), tier_size=0)


_replica = st.builds(
    ReplicaLoad,
    replica_id=st.sampled_from([f"r{i}" for i in range(8)]),
    queue_len=st.integers(0, 300),
    running_tokens=st.integers(0, 10**6),
    kv_use=st.floats(0, 1),
    max_ongoing=st.integers(0, 256),
)


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.integers(0, 100_000),
    reps=st.lists(_replica, min_size=1, max_size=8),
    matched=st.none()
    | st.dictionaries(st.sampled_from([f"r{i}" for i in range(10)]), st.integers(-5, 10_000)),
    seed=st.integers(0, 2**32),
    gate=st.floats(0, 3),
    sigma=st.none() | st.floats(0, 3),
)
def test_first_tier_is_never_empty_and_holds_only_given_replicas(
    prompt: int, reps: list[ReplicaLoad], matched: dict[str, int] | None, seed: int, gate: float,
    sigma: float | None,
) -> None:
    p = CacheAffinityPolicy(page_size=PAGE, rng=random.Random(seed), hot_spot_gate=gate, hot_spot_sigma=sigma)
    tiers = p.choose(prompt, matched, reps)
    given_ids = {r.replica_id for r in reps}
    assert tiers and tiers[0]
    assert set(tiers[0]) <= given_ids
    flat = [rid for tier in tiers for rid in tier]
    assert len(flat) == len(set(flat)) and set(flat) <= given_ids
    assert all(tiers) and all(len(t) <= p.tier_size for t in tiers)
    if matched is not None:  # the matched replicas and the k least loaded others: here all of them
        assert set(flat) == given_ids


def _random_case(rng: random.Random) -> tuple[int, dict[str, int], list[ReplicaLoad]]:
    """A deployment of 20-400 replicas with distinct loads, a few of them holding a prefix."""
    n = rng.randint(20, 400)
    reps = [ReplicaLoad(f"r{i}", rng.randint(0, 64), kv_use=rng.random(), max_ongoing=64) for i in range(n)]
    prompt = rng.randint(0, 8000)
    matched = {f"r{i}": rng.randint(0, 600) for i in rng.sample(range(n), rng.randint(0, 6))}
    return prompt, matched, reps


@pytest.mark.parametrize("sigma", [None, 1.0])
def test_scoring_the_matched_and_the_least_loaded_chooses_as_scoring_all(sigma: float | None) -> None:
    cases = random.Random(7)
    for case in range(300):
        prompt, matched, reps = _random_case(cases)
        seed, gate = cases.randrange(2**32), cases.choice([0.05, 0.5, 3.0])
        few, every = (
            CacheAffinityPolicy(page_size=PAGE, rng=random.Random(seed), hot_spot_gate=gate,
                                hot_spot_sigma=sigma, least_loaded=k)
            for k in (8, None)
        )
        got, want = few.rank(prompt, matched, reps), every.rank(prompt, matched, reps)
        assert got.tiers[0] == want.tiers[0], case
        assert (got.reason, got.best_match_blocks, got.chosen_match_blocks) == (
            want.reason, want.best_match_blocks, want.chosen_match_blocks)
        ranked = [rid for tier in got.tiers for rid in tier]
        assert set(matched) <= set(ranked) and len(ranked) == min(len(reps), len(matched) + 8)
        # Every ranked replica in the order full scoring gives them.
        full_order = [rid for tier in want.tiers for rid in tier]
        assert sorted(ranked, key=full_order.index) == ranked


def test_equal_loads_do_not_always_favour_the_same_replicas() -> None:
    reps = replicas(*([0] * 100))
    firsts = Counter(policy(seed).choose(300, {}, reps)[0][0] for seed in range(300))
    assert len(firsts) > 60  # spread over the deployment, not the first k of its list
    with pytest.raises(ValueError, match="least_loaded"):
        policy(least_loaded=1)
