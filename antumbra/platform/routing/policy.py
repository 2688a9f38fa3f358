"""Cache-affinity routing: which replicas a request should try, best first. Pure Python, no Ray.

The Ray Serve `RequestRouter` feeds `CacheAffinityPolicy.choose` with the prompt length, the
prefix directory's answer and each candidate's load, and hands the ranked tiers back to Ray
Serve, which probes queue lengths within a tier and falls through to the next tier when every
replica of a tier is full.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

RoutingReason = Literal["affinity", "hot_spot", "load", "no_directory", "no_replicas"]


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """A replica's load as its routing stats report it (plus what this router sent since).

    `queue_len`: requests on the replica (running and waiting); `running_tokens`: tokens of
    its running requests; `kv_use`: the highest use, 0..1, over its KV pools;
    `max_ongoing`: the most requests it accepts.
    """

    replica_id: str
    queue_len: int
    running_tokens: int = 0
    kv_use: float = 0.0
    max_ongoing: int = 1

    @classmethod
    def from_stats(cls, replica_id: str, stats: Mapping[str, Any] | None, max_ongoing: int) -> ReplicaLoad:
        """From a replica's routing stats: keys `queue_len`, `running_tokens`, `kv_use` (missing: 0)."""
        stats = stats or {}
        return cls(
            replica_id,
            int(stats.get("queue_len", 0)),
            int(stats.get("running_tokens", 0)),
            float(stats.get("kv_use", 0.0)),
            max_ongoing,
        )

    @property
    def load(self) -> float:
        """queue_len / max_ongoing + kv_use: 0 when idle, about 2 when its queue and KV are full."""
        return self.queue_len / max(1, self.max_ongoing) + self.kv_use


@dataclass(frozen=True)
class RoutingDecision:
    """The ranked tiers and why; `reason` and the match lengths feed the routing metrics."""

    tiers: list[list[str]]
    reason: RoutingReason
    best_match_blocks: int  # the longest leading match any candidate holds
    chosen_match_blocks: int  # the match of the first replica of the first tier


class CacheAffinityPolicy:
    """Rank replicas by uncached prefill tokens plus weighted load, with a hot-spot gate.

    Algorithm, for a prompt of `T` tokens, pages of `P` tokens and candidate replicas `R`:

    1. No candidates: no tiers. Directory unavailable (`matched_blocks is None`): power of
       two choices, i.e. one tier of two replicas drawn uniformly by `rng` (Ray Serve keeps
       the one with the shorter probed queue); one candidate: that one.
    2. For each replica r: `m(r)` = its leading matched blocks (0 if absent, at most
       `T // P`), `uncached(r) = T - m(r)·P`, `load(r) = queue_len/max_ongoing + kv_use`
       and `cost(r) = uncached(r) + load_weight · load(r)` (in tokens).
    3. Hot-spot gate: r is *hot* if `load(r) - min_s load(s) > hot_spot_gate`, or, when
       `hot_spot_sigma` is set, if `load(r) > mean(load) + hot_spot_sigma · stdev(load)`
       (population stdev, only when it is > 0). Hot replicas lose affinity: every non-hot
       replica ranks before every hot one, so a hot prefix spills to the least-loaded
       replicas (cheapest among them first, which again prefers partial matches) instead
       of piling onto the replica that holds it. `reason` is "hot_spot" if a replica with
       the longest match was hot, "affinity" if the longest match is > 0, else "load".
    4. Candidates: the replicas the directory matched plus the `least_loaded` (k) least loaded
       of the others (`heapq.nsmallest`, scanning from an offset drawn by `rng` so that equal
       loads do not always favour the same replicas). An unmatched replica costs `T + load_weight
       · load(r)` and is hot exactly when its load is over the limit, both increasing in load, so
       no unmatched replica outside the k least loaded can rank before one inside: with
       k >= `tier_size` the first tier is the one scoring every replica gives (exact ties aside).
       `least_loaded=None` scores every replica. A decision is O(n) to read the loads plus
       O(n log k + c log c) for c = matched + k candidates, instead of sorting all n.
    5. Order: (hot, cost) ascending, exact ties broken by `rng`. The first tier holds the
       first candidate and every next one (hot alike) whose cost is within `tie_tokens` of it, at
       most `tier_size` (Ray Serve picks among them by probed queue length, which is fresher
       than the stats); the remaining candidates follow in order, `tier_size` per tier. Replicas
       that are not candidates are left out: when every ranked replica is full Ray Serve asks
       again, with fresher loads.
    """

    def __init__(
        self,
        *,
        page_size: int,
        rng: random.Random,
        load_weight: float = 2048.0,
        hot_spot_gate: float = 0.5,
        hot_spot_sigma: float | None = None,
        tie_tokens: float | None = None,
        tier_size: int = 2,
        least_loaded: int | None = 8,
    ) -> None:
        if page_size < 1:
            raise ValueError("page_size must be positive")
        if tier_size < 1:
            raise ValueError("tier_size must be at least 1")
        if least_loaded is not None and least_loaded < tier_size:
            raise ValueError("least_loaded must be at least tier_size (or None: every replica)")
        if load_weight < 0 or hot_spot_gate < 0:
            raise ValueError("load_weight and hot_spot_gate must be non-negative")
        self.page_size = page_size
        self.load_weight = load_weight
        self.hot_spot_gate = hot_spot_gate
        self.hot_spot_sigma = hot_spot_sigma
        self.tie_tokens = float(page_size if tie_tokens is None else tie_tokens)
        self.tier_size = tier_size
        self.least_loaded = least_loaded
        self._rng = rng

    def choose(
        self, prompt_num_tokens: int, matched_blocks: dict[str, int] | None, replicas: Sequence[ReplicaLoad]
    ) -> list[list[str]]:
        """Ranked tiers of replica ids (Ray Serve's `choose_replicas` contract)."""
        return self.rank(prompt_num_tokens, matched_blocks, replicas).tiers

    def rank(
        self, prompt_num_tokens: int, matched_blocks: dict[str, int] | None, replicas: Sequence[ReplicaLoad]
    ) -> RoutingDecision:
        """`choose` with the reason and match lengths, for metrics."""
        replicas = _unique(replicas)
        if not replicas:
            return RoutingDecision([], "no_replicas", 0, 0)
        if matched_blocks is None:
            if len(replicas) == 1:
                return RoutingDecision([[replicas[0].replica_id]], "no_directory", 0, 0)
            pair = self._rng.sample(replicas, 2)
            return RoutingDecision([[r.replica_id for r in pair]], "no_directory", 0, 0)

        max_blocks = max(0, prompt_num_tokens) // self.page_size
        loads = {r.replica_id: r.load for r in replicas}
        matched = {rid: min(max(0, m), max_blocks) for rid, m in matched_blocks.items() if rid in loads}
        limit = self._hot_limit(loads)
        weight, page, rand = self.load_weight, self.page_size, self._rng.random
        keyed = []
        for rid in self._candidates(loads, matched):
            load = loads[rid]
            cost = max(0, prompt_num_tokens - matched.get(rid, 0) * page) + weight * load
            keyed.append((load > limit, cost, rand(), rid))
        best = max(matched.values(), default=0)
        if best == 0:
            reason: RoutingReason = "load"
        elif any(loads[rid] > limit for rid, m in matched.items() if m == best):
            reason = "hot_spot"
        else:
            reason = "affinity"

        keyed.sort()
        order = [rid for *_, rid in keyed]
        head_hot, head_cost = keyed[0][0], keyed[0][1]
        first = [order[0]]
        for is_hot, cost, _, rid in keyed[1 : self.tier_size]:
            if is_hot != head_hot or cost - head_cost > self.tie_tokens:
                break
            first.append(rid)
        rest = order[len(first) :]
        tiers = [first] + [rest[i : i + self.tier_size] for i in range(0, len(rest), self.tier_size)]
        return RoutingDecision(tiers, reason, best, matched.get(order[0], 0))

    def _candidates(self, loads: dict[str, float], matched: dict[str, int]) -> list[str]:
        """The replicas scored (step 4 of the class docstring): the matched and the k least loaded."""
        if self.least_loaded is None or len(loads) <= len(matched) + self.least_loaded:
            return list(loads)
        ids = list(loads)
        start = self._rng.randrange(len(ids))
        others = (rid for rid in itertools.chain(ids[start:], ids[:start]) if rid not in matched)
        return [*matched, *heapq.nsmallest(self.least_loaded, others, key=loads.__getitem__)]

    def _hot_limit(self, loads: dict[str, float]) -> float:
        """The load above which a replica is hot (step 3 of the class docstring)."""
        low = min(loads.values())
        limit = low + self.hot_spot_gate
        if self.hot_spot_sigma is not None and len(loads) > 1:
            mean = sum(loads.values()) / len(loads)
            sigma = math.sqrt(sum((v - mean) ** 2 for v in loads.values()) / len(loads))
            if sigma > 0:
                limit = min(limit, mean + self.hot_spot_sigma * sigma)
        return limit


def _unique(replicas: Sequence[ReplicaLoad]) -> list[ReplicaLoad]:
    """The replicas with each id once (its first entry), in the given order."""
    seen: set[str] = set()
    out: list[ReplicaLoad] = []
    for r in replicas:
        if r.replica_id not in seen:
            seen.add(r.replica_id)
            out.append(r)
    return out
