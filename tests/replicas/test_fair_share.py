"""Fair share in the engine's scheduler: the policies alone (fake clock), then the engine on the tiny
model stepped by hand, where a tenant sending 10x the tokens of another gets its weighted share of
what is served while both are backlogged, and FIFO, in the same setting, does not."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from antumbra import Engine, SamplingParams
from antumbra.config import SchedulerConfig
from antumbra.replicas.request import Request
from antumbra.replicas.scheduling_policy import FairSharePolicy, FifoPolicy, deadline_s
from antumbra.replicas.tenancy import Tenancy

HEAVY_PROMPT, LIGHT_PROMPT = 160, 16  # with the same max_tokens: 10x the tokens per request
MAX_TOKENS = 4
PREFILL_COST, DECODE_COST = 1.0, 2.0  # FairSharePolicy's defaults, and this file's unit of service
OUTSTANDING = 24  # requests each tenant keeps in the engine: more than max_num_seqs, so both queue
WARMUP_STEPS, STEPS = 10, 50


def request(rid: str, tenancy: Tenancy, arrival_s: float = 0.0, priority: int = 0) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=4), seed=0, detokenizer=None,
                   priority=priority, tenancy=tenancy, arrival_time_s=arrival_s)


def drain(queue) -> list[str]:
    out = []
    while (r := queue.pop()) is not None:
        out.append(r.request_id)
    return out


# ----------------------------------------------------------------------------------- the policies alone


def test_counters_charge_weighted_tokens_and_the_least_served_tenant_goes_first() -> None:
    policy = FairSharePolicy()
    a, b = Tenancy("a"), Tenancy("b", weight=4.0)
    ra, rb = request("a1", a, arrival_s=1.0), request("b1", b, arrival_s=2.0)
    policy.charge(ra, prompt_tokens=10, decode_tokens=1)  # 10 x 1 + 1 x 2
    policy.charge(rb, prompt_tokens=40, decode_tokens=0)  # 40 / 4
    assert policy.counter("a") == 12.0 and policy.counter("b") == 10.0
    assert drain(policy.queue([ra, rb])) == ["b1", "a1"]  # b arrived later but is less served


def test_a_queue_rereads_the_counters_after_each_charge() -> None:
    policy = FairSharePolicy()
    a, b = Tenancy("a"), Tenancy("b")
    reqs = [request("a1", a, 1.0), request("a2", a, 2.0), request("b1", b, 3.0), request("b2", b, 4.0)]
    queue = policy.queue(reqs)
    order = []
    while (r := queue.pop()) is not None:
        order.append(r.request_id)
        policy.charge(r, prompt_tokens=10, decode_tokens=0)
    assert order == ["a1", "b1", "a2", "b2"]  # alternating, not a's backlog first


def test_an_idle_tenant_banks_no_credit() -> None:
    policy = FairSharePolicy()
    busy, idle = Tenancy("busy"), Tenancy("idle")
    policy.charge(request("x", busy), prompt_tokens=500, decode_tokens=0)
    policy.arrived(request("y", idle), active_tenants={"busy"})
    assert policy.counter("idle") == 500.0  # lifted to the least-served active tenant
    policy.charge(request("y", idle), prompt_tokens=100, decode_tokens=0)
    policy.arrived(request("z", idle), active_tenants={"busy", "idle"})
    assert policy.counter("idle") == 600.0  # already active: not lifted again
    policy.arrived(request("w", busy), active_tenants=set())
    assert policy.counters == {}  # nobody was active: every counter restarts


def test_priority_and_priority_class_come_before_the_counters() -> None:
    policy = FairSharePolicy()
    batch, interactive = Tenancy("bulk", priority_class="batch"), Tenancy("chat")
    policy.charge(request("c0", interactive), prompt_tokens=1000, decode_tokens=0)
    reqs = [request("b1", batch, 1.0), request("c1", interactive, 2.0), request("p", batch, 3.0, priority=5)]
    assert drain(policy.queue(reqs)) == ["p", "c1", "b1"]
    assert policy.victim(reqs).request_id == "b1"  # batch before interactive, the high priority last
    assert FifoPolicy().victim(reqs).request_id == "c1"  # FIFO: lowest priority, newest


def test_slack_orders_requests_inside_a_tenant() -> None:
    now = [100.0]
    policy = FairSharePolicy(clock=lambda: now[0])
    loose = request("loose", Tenancy("t", ttft_slo_s=10.0), arrival_s=90.0)  # due at 100
    tight = request("tight", Tenancy("t", ttft_slo_s=1.0), arrival_s=98.0)  # due at 99
    none = request("none", Tenancy("t"), arrival_s=50.0)
    decoding = request("decoding", Tenancy("t", tpot_slo_s=0.5), arrival_s=10.0)
    decoding.output_token_ids = [7, 7, 7, 7]
    decoding.record.first_token_time_s = 97.0  # the 5th token is due at 99.0
    assert policy.slack_s(tight) == -1.0 and policy.slack_s(loose) == 0.0
    assert math.isinf(policy.slack_s(none)) and deadline_s(decoding) == 99.0
    assert drain(policy.queue([none, loose, tight, decoding])) == ["decoding", "tight", "loose", "none"]
    assert drain(FifoPolicy().queue([none, loose, tight, decoding])) == ["decoding", "none", "loose", "tight"]


def test_tenancy_refuses_bad_values() -> None:
    for bad in ({"weight": 0.0}, {"weight": math.inf}, {"priority_class": "urgent"}, {"ttft_slo_s": -1.0}):
        with pytest.raises(ValueError):
            Tenancy("t", **bad)


# ----------------------------------------------------------------------------------- the engine


def served_shares(checkpoint: Path, policy: str, light_weight: float) -> dict[str, float]:
    """Step an engine with two tenants that each keep `OUTSTANDING` requests in it (a finished one is
    replaced at once); -> each tenant's share of the service (prompt tokens computed x 1 + tokens
    generated x 2, read from the requests) over `STEPS` steps after `WARMUP_STEPS`."""
    sched = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16, max_model_len=512, policy=policy)
    core = Engine.from_pretrained(checkpoint, scheduler=sched).core
    tenants = {"heavy": (Tenancy("heavy"), HEAVY_PROMPT), "light": (Tenancy("light", weight=light_weight),
                                                                    LIGHT_PROMPT)}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)  # distinct prompts: no prefix is served from the cache
    live: list[Request] = []

    def submit(name: str) -> None:
        tenancy, length = tenants[name]
        prompt = [rng.randrange(1, 500) for _ in range(length)]
        live.append(core.make_request(prompt, params, tenancy=tenancy))
        core.add(live[-1])

    for _ in range(OUTSTANDING):
        for name in tenants:
            submit(name)
    seen: dict[str, float] = {}
    served = dict.fromkeys(tenants, 0.0)
    for step in range(WARMUP_STEPS + STEPS):
        core.step()
        for r in list(live):
            total = PREFILL_COST * r.num_computed_prompt_tokens + DECODE_COST * r.num_output_tokens
            if step >= WARMUP_STEPS:
                served[r.tenancy.tenant_id] += total - seen.get(r.request_id, 0.0)
            seen[r.request_id] = total
            if r.finished:
                live.remove(r)
                submit(r.tenancy.tenant_id)
        waiting = {r.tenancy.tenant_id for r in core.scheduler.waiting}
        assert waiting == set(tenants), f"step {step}: only {waiting} backlogged"
    core.check_integrity()
    return {name: value / sum(served.values()) for name, value in served.items()}


@pytest.mark.parametrize("light_weight", [1.0, 3.0])
def test_fair_share_gives_each_backlogged_tenant_its_weighted_share(
    tiny_checkpoint: Path, light_weight: float
) -> None:
    shares = served_shares(tiny_checkpoint, "fair_share", light_weight)
    heavy_share = 1.0 / (1.0 + light_weight)
    assert shares["heavy"] <= 1.1 * heavy_share, shares
    assert shares["heavy"] >= 0.9 * heavy_share, shares  # and the light one cannot take more either


def test_fifo_lets_the_heavy_tenant_take_the_engine(tiny_checkpoint: Path) -> None:
    shares = served_shares(tiny_checkpoint, "fifo", 1.0)
    assert shares["heavy"] > 0.8, shares  # it sends 10x the tokens and gets about that


def first_step_order(checkpoint: Path, policy: str, tenancies: list[Tenancy]) -> list[int]:
    """Queue one 32-token prompt per tenancy, in list order, on an engine whose step holds exactly
    one of them; -> the list indices in the order their prompts were computed."""
    sched = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=256, policy=policy)
    core = Engine.from_pretrained(checkpoint, scheduler=sched).core
    params = SamplingParams(max_tokens=1, temperature=0.0)
    reqs = [core.make_request([10 + i] * 32, params, tenancy=t) for i, t in enumerate(tenancies)]
    for r in reqs:
        core.add(r)
    order: list[int] = []
    while len(order) < len(reqs):
        core.step()
        order += [i for i, r in enumerate(reqs) if r.num_computed_tokens and i not in order]
    core.check_integrity()
    return order


def test_interactive_requests_go_before_batch_ones_in_the_engine(tiny_checkpoint: Path) -> None:
    bulk, chat = Tenancy("bulk", priority_class="batch"), Tenancy("chat")
    assert first_step_order(tiny_checkpoint, "fair_share", [bulk, bulk, chat]) == [2, 0, 1]
    assert first_step_order(tiny_checkpoint, "fifo", [bulk, bulk, chat]) == [0, 1, 2]


def test_the_least_slack_goes_first_inside_a_tenant_in_the_engine(tiny_checkpoint: Path) -> None:
    relaxed, no_slo, urgent = Tenancy("t", ttft_slo_s=60.0), Tenancy("t"), Tenancy("t", ttft_slo_s=0.001)
    assert first_step_order(tiny_checkpoint, "fair_share", [relaxed, no_slo, urgent]) == [2, 0, 1]
