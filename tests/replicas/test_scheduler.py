"""The Scheduler built directly on a KVManager over tiny pools: the exact chunks of every step, the
pages each request holds, which request is preempted and how it resumes. No model: a step's
"execution" is a made-up runner output, one token for each chunk that samples, which the scheduler
applies (`update_from_output`).

Pools hand out free pages first-in first-out (fresh pages in id order, then freed pages in the order
they were freed), so the page ids spell out what was taken and given back.
"""

from __future__ import annotations

import pytest
import torch

from antumbra.cachestore.pools import CompressorSpec, KVPools, PoolLayout
from antumbra.cachestore.shadow_radix import ShadowRadix
from antumbra.config import SchedulerConfig
from antumbra.replicas.errors import InvalidRequestError
from antumbra.replicas.kv_manager import KVManager
from antumbra.replicas.request import KVHandoff, Request, RequestStatus
from antumbra.replicas.sampling_params import SamplingParams
from antumbra.replicas.scheduler import Scheduler
from antumbra.replicas.step_io import PENDING, OutputKind, RunnerOutput, SchedulerOutput

PAGE = 4


def scheduler(num_virtual_pages: int, num_swa_pages: int, budget: int, max_num_seqs: int = 4,
              max_chunk: int | None = None) -> Scheduler:
    """Window 4 and one rate-4 compressor without overlap: a sequence keeps at most 2 SWA pages."""
    layout = PoolLayout(
        page_size=PAGE, window=4, num_virtual_pages=num_virtual_pages, num_swa_pages=num_swa_pages,
        num_layers=1, head_dim=4, index_head_dim=4, compressors=(CompressorSpec(0, 4, 1, 4),), indexers=(),
    )
    assert layout.steady_swa_pages_per_seq == 2
    pools = KVPools(layout, torch.float32, "cpu")
    kv = KVManager(pools, ShadowRadix(pools), layout.num_layers, enable_replay=False)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          max_prefill_chunk_tokens=max_chunk)
    return Scheduler(cfg, kv)


def request(rid: str, prompt: list[int], priority: int = 0, arrival_s: float = 0.0,
            params: SamplingParams | None = None) -> Request:
    return Request(rid, prompt, params or SamplingParams(), 0, None, priority=priority,
                   arrival_time_s=arrival_s, namespace="ns", max_total_tokens=len(prompt) + 16)


def drawn(step: SchedulerOutput) -> RunnerOutput:
    """The runner's output for the step: request r's n-th output token is 90 + n."""
    sampling = step.sampling
    return RunnerOutput(OutputKind.DRAWN, tuple(sampling), tuple(90 + r.num_output_tokens for r in sampling),
                        (None,) * len(sampling))


def step(sched: Scheduler) -> list[tuple[str, int, int]]:
    """One step: -> (request id, start, tokens) of each chunk, in the order scheduled."""
    scheduled = sched.schedule()
    sched.update_from_output(scheduled, drawn(scheduled))
    sched.check_integrity()
    return [(c.request.request_id, c.start, c.num_new_tokens) for c in scheduled.chunks]


def test_chunks_fill_the_budget_running_requests_first():
    sched = scheduler(num_virtual_pages=12, num_swa_pages=12, budget=8)
    a, b = request("a", list(range(10)), arrival_s=1.0), request("b", [50, 51, 52], arrival_s=2.0)
    sched.add(b)
    sched.add(a)  # added later, arrived first: admitted first
    assert step(sched) == [("a", 0, 8)]  # the budget ends the step inside a's prompt
    assert a.kv.vpages == [0, 1] and b.status is RequestStatus.WAITING
    assert step(sched) == [("a", 8, 2), ("b", 0, 3)]  # a's last 2 prompt tokens, then b's prompt
    assert a.kv.vpages == [0, 1, 2] and b.kv.vpages == [3]
    assert a.output_token_ids == [90] and b.output_token_ids == [90]
    assert step(sched) == [("a", 10, 1), ("b", 3, 1)]  # two decodes
    assert a.kv.vpages == [0, 1, 2] and b.kv.vpages == [3]
    assert step(sched) == [("a", 11, 1), ("b", 4, 1)]  # b's fifth token opens its second page
    assert b.kv.vpages == [3, 4]


def test_the_prefill_chunk_cap_and_the_sequence_limit():
    sched = scheduler(num_virtual_pages=12, num_swa_pages=12, budget=16, max_num_seqs=1, max_chunk=5)
    low, high = request("low", list(range(7)), arrival_s=1.0), request("high", [60, 61], priority=2,
                                                                          arrival_s=2.0)
    sched.add(low)
    sched.add(high)
    assert step(sched) == [("high", 0, 2)]  # priority before arrival; one sequence at a time
    assert step(sched) == [("high", 2, 1)]  # a decode is one token: the cap does not delay it
    sched.finish(high, "stop")
    assert high.kv.vpages == [] and sched.running == []
    assert step(sched) == [("low", 0, 5)]  # the cap splits low's 7-token prompt
    assert step(sched) == [("low", 5, 2)]
    assert low.output_token_ids == [90]


def test_a_request_that_cannot_grow_waits_until_one_ahead_of_it_preempts_it():
    # 5 virtual pages: a (3 pages) and b (2 pages) fill them.
    sched = scheduler(num_virtual_pages=5, num_swa_pages=12, budget=32)
    a, b = request("a", list(range(8)), arrival_s=1.0), request("b", list(range(20, 27)), arrival_s=2.0)
    sched.add(a)
    sched.add(b)
    assert step(sched) == [("a", 0, 8), ("b", 0, 7)]
    assert (a.kv.vpages, b.kv.vpages) == ([0, 1], [2, 3])
    assert step(sched) == [("a", 8, 1), ("b", 7, 1)]  # a's ninth token takes the last free page
    assert (a.kv.vpages, b.kv.vpages) == ([0, 1, 4], [2, 3])
    # b's ninth token needs a third page and none is free. a, ahead of b and already scheduled, is
    # not preempted for it: b sits the steps out, still running, holding its pages.
    for position in (9, 10, 11):
        assert step(sched) == [("a", position, 1)]
        assert b.status is RequestStatus.RUNNING and b.kv.vpages == [2, 3] and b.num_computed_tokens == 8
    # a's 13th token needs a fourth page: b, the newest, is preempted. Its first page is in the cache
    # already, with its SWA rows (its prompt's checkpoint, handed over once its window slid past it);
    # its second joins now, and a's grow evicts that leaf, page 3. b matches its first page, but no
    # page is left for what follows it: b waits (a step's decodes are scheduled before anything is
    # admitted, and a is not preempted for a request behind it).
    assert step(sched) == [("a", 12, 1)]
    assert a.kv.vpages == [0, 1, 4, 3]
    assert b.status is RequestStatus.WAITING and b.num_preemptions == 1 and b.kv.vpages == []
    assert step(sched) == [("a", 13, 1)]
    assert b.status is RequestStatus.WAITING and b.kv.vpages == []
    sched.finish(a, "stop")  # a's three full pages join the cache, its partial page 3 is freed
    assert sorted(sched.kv.tree.owned_vpages()) == [0, 1, 2, 4]
    # b shares its cached first page and computes the rest (its prompt's last 3 tokens and its 2
    # outputs) into the free page 3 and the cache's LRU leaf, page 4.
    assert step(sched) == [("b", 4, 5)]
    assert b.kv.vpages == [2, 3, 4] and sorted(sched.kv.tree.owned_vpages()) == [0, 1, 2]
    assert b.num_cached_tokens == 0  # counted at its first admission only
    assert b.output_token_ids == [90, 91, 92]  # the recompute ends in its next token
    assert step(sched) == [("b", 9, 1)]


def test_a_step_names_the_requests_it_preempted_and_those_finished_since_the_last():
    sched = scheduler(num_virtual_pages=5, num_swa_pages=12, budget=32)
    a, b = request("a", list(range(8)), arrival_s=1.0), request("b", list(range(20, 27)), arrival_s=2.0)
    sched.add(a)
    sched.add(b)
    for _ in range(5):  # prompts, then a's decodes up to its 12th token (b cannot grow past 8)
        scheduled = sched.schedule()
        assert scheduled.preempted_ids == () and scheduled.finished_ids == ()
        sched.update_from_output(scheduled, drawn(scheduled))
    scheduled = sched.schedule()  # a's 13th token needs b's pages
    assert [(c.request.request_id, c.start) for c in scheduled.chunks] == [("a", 12)]
    assert scheduled.preempted_ids == ("b",) and scheduled.sampling == [a]
    sched.update_from_output(scheduled, drawn(scheduled))
    sched.finish(b, "abort")
    assert sched.schedule().finished_ids == ("b",)
    assert sched.schedule().finished_ids == ()  # reported once


def test_the_scheduler_alone_appends_tokens_checks_stops_and_finishes():
    sched = scheduler(num_virtual_pages=12, num_swa_pages=12, budget=32)
    sched.eos_token_ids = (7,)
    stop_id = request("stop_id", [1, 2, 3, 4, 5], params=SamplingParams(stop_token_ids=[91]), arrival_s=1.0)
    eos = request("eos", [10, 11, 12, 13], arrival_s=2.0)
    ignores_eos = request("ignores", [20, 21, 22, 23], params=SamplingParams(ignore_eos=True), arrival_s=3.0)
    short = request("short", [30, 31, 32], params=SamplingParams(max_tokens=2), arrival_s=4.0)
    for r in (stop_id, eos, ignores_eos, short):
        sched.add(r)
    first = sched.schedule()
    out = RunnerOutput(OutputKind.DRAWN, (stop_id, eos, ignores_eos, short), (90, 7, 7, 90), (None,) * 4)
    assert sched.update_from_output(first, out) == [stop_id, eos, ignores_eos, short]
    assert eos.finish_reason == "stop" and eos.kv.vpages == [] and eos.output_token_ids == [7]
    assert ignores_eos.finish_reason is None and ignores_eos.num_computed_tokens == 4
    # eos's prompt page (computed, full) joined the cache: page 2, after stop_id's pages 0 and 1.
    assert sched.kv.tree.owned_vpages() == [2]
    second = sched.schedule()
    assert [(c.request.request_id, c.start, c.num_new_tokens) for c in second.chunks] == [
        ("stop_id", 5, 1), ("ignores", 4, 1), ("short", 3, 1)]
    assert second.finished_ids == ("eos",)
    sched.update_from_output(second, drawn(second))  # each request's second token is 91
    assert stop_id.finish_reason == "stop" and stop_id.output_token_ids == [90, 91]
    assert short.finish_reason == "length" and short.output_token_ids == [90, 91]
    assert ignores_eos.finish_reason is None and sched.running == [ignores_eos]
    assert sched.num_generated_tokens == 7
    sched.check_integrity()


def test_overlapped_steps_hold_a_pending_token_until_the_next_launch_resolves_it():
    sched = scheduler(num_virtual_pages=12, num_swa_pages=12, budget=32)
    a = request("a", [1, 2, 3], params=SamplingParams(stop_token_ids=[50]), arrival_s=1.0)
    b, c = request("b", [4, 5, 6], arrival_s=2.0), request("c", [7, 8, 9], arrival_s=3.0)
    for r in (a, b, c):
        sched.add(r)
    prefill = sched.schedule()
    sched.update_from_output(prefill, drawn(prefill))  # a, b and c hold [90]
    first = sched.schedule()
    assert sched.update_from_output(first, RunnerOutput.launched([a, b, c], None)) == []
    assert [r.output_token_ids for r in (a, b, c)] == [[90, PENDING]] * 3
    assert a.num_computed_tokens == 4  # the launched step's KV counts as computed at once
    # The next step decodes at the pending position; a aborts while the first one is in flight.
    second = sched.schedule()
    assert [(ch.request.request_id, ch.start) for ch in second.chunks] == [("a", 4), ("b", 4), ("c", 4)]
    sched.finish(c, "abort")
    resolved = RunnerOutput.resolved([a, b, c], [50, 51, 52])
    advanced = sched.update_from_output(second, RunnerOutput.launched([a, b, c], resolved))
    assert advanced == [a, b]  # c was aborted while its token was in flight: its token is dropped
    assert a.finish_reason == "stop" and a.output_token_ids == [90, 50]  # no pending token after a stop
    assert b.output_token_ids == [90, 51, PENDING]
    assert sched.num_generated_tokens == 5
    last = sched.update_from_output(second, RunnerOutput.resolved([a, b], [60, 61]))
    assert last == [b] and b.output_token_ids == [90, 51, 61] and b.num_computed_tokens == 5


def test_a_request_exporting_its_kv_is_read_before_its_pages_go():
    sched = scheduler(num_virtual_pages=12, num_swa_pages=12, budget=32)
    seen: list[list[int]] = []
    sched.export_kv = lambda r: seen.append(list(r.kv.vpages)) or f"rows of {r.request_id}"
    a = request("a", list(range(6)), params=SamplingParams(max_tokens=1))
    a.handoff = KVHandoff(0)
    sched.add(a)
    scheduled = sched.schedule()
    sched.update_from_output(scheduled, drawn(scheduled))
    assert seen == [[0, 1]] and a.handoff.payload == "rows of a" and a.kv.vpages == []
    sched.export_kv = None
    b = request("b", list(range(40, 46)), params=SamplingParams(max_tokens=1))
    b.handoff = KVHandoff(0)
    sched.add(b)
    scheduled = sched.schedule()
    with pytest.raises(InvalidRequestError, match="exports no KV"):
        sched.update_from_output(scheduled, drawn(scheduled))


def test_a_handed_over_token_is_appended_but_not_counted_as_generated_here():
    sched = scheduler(num_virtual_pages=12, num_swa_pages=12, budget=32)
    a = request("a", [1, 2, 3, 4, 5], params=SamplingParams(max_tokens=1))
    assert sched.update_from_output(SchedulerOutput(()), RunnerOutput.handed_over(a, 77, {77: -0.5})) == [a]
    assert a.output_token_ids == [77] and a.record.logprobs == [{77: -0.5}] and a.finish_reason == "length"
    assert sched.num_generated_tokens == 0


def test_prefill_beside_decodes_is_bounded_by_the_inter_token_budget():
    """A step lasts 1 ms + 1 ms a prefill token on a fake clock; the budget 5.5 ms leaves 4 tokens."""
    from dataclasses import replace

    plain = scheduler(num_virtual_pages=16, num_swa_pages=12, budget=16)
    assert plain.prefill_budget is None
    sched = Scheduler(replace(plain.cfg, itl_budget_ms=5.5, itl_floor_tokens=2), plain.kv)
    assert sched.prefill_budget is not None
    now = [0.0]
    sched.prefill_budget.clock = lambda: now[0]

    def timed_step() -> list[tuple[str, int, int]]:
        chunks = step(sched)
        now[0] += 1e-3 * (1 + sum(n for rid, _, n in chunks if rid != "a"))
        sched.step_finished()
        return chunks

    a = request("a", [1, 2, 3])
    sched.add(a)
    assert timed_step() == [("a", 0, 3)]  # no decodes: not bounded, not measured
    sched.add(request("b", list(range(40))))
    assert timed_step() == [("a", 3, 1), ("b", 0, 15)]  # nothing measured yet: what the budget leaves
    # 16 ms for 15 tokens, charged all to the tokens: 5.5 ms buys 5.
    assert timed_step() == [("a", 4, 1), ("b", 15, 5)]
    # Two sizes fit the line exactly: (5.5 - 1) / 1 = 4.5 tokens.
    assert timed_step() == [("a", 5, 1), ("b", 20, 4)]
    sched.prefill_budget.budget_s = 3.5e-3  # (3.5 - 1) / 1 = 2.5: the floor of 2 still fits
    assert timed_step() == [("a", 6, 1), ("b", 24, 2)]
    # Less than the decode alone takes: no chunk keeps the step within it, so the prompt is not held
    # back (smaller chunks would only add steps): it takes what the token budget leaves.
    sched.prefill_budget.budget_s = 0.5e-3
    assert timed_step() == [("a", 7, 1), ("b", 26, 14)]
