"""The Scheduler built directly on a KVManager over tiny pools: the exact chunks of every step, the
pages each request holds, which request is preempted and how it resumes. No model: a step's
"execution" is `after_step` plus one made-up token for each chunk that samples.

Pools hand out free pages first-in first-out (fresh pages in id order, then freed pages in the order
they were freed), so the page ids spell out what was taken and given back.
"""

from __future__ import annotations

import torch

from antumbra.cachestore.pools import CompressorSpec, KVPools, PoolLayout
from antumbra.cachestore.shadow_radix import ShadowRadix
from antumbra.config import SchedulerConfig
from antumbra.replicas.kv_manager import KVManager
from antumbra.replicas.request import Request, RequestStatus
from antumbra.replicas.sampling_params import SamplingParams
from antumbra.replicas.scheduler import Scheduler

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


def request(rid: str, prompt: list[int], priority: int = 0, arrival_s: float = 0.0) -> Request:
    return Request(rid, prompt, SamplingParams(), 0, None, priority=priority, arrival_time_s=arrival_s,
                   namespace="ns")


def step(sched: Scheduler) -> list[tuple[str, int, int]]:
    """One step: -> (request id, start, tokens) of each chunk, in the order scheduled."""
    chunks = sched.schedule()
    sched.after_step(chunks)
    for chunk in chunks:
        if chunk.samples:
            chunk.request.output_token_ids.append(90 + chunk.request.num_output_tokens)
    sched.check_integrity()
    return [(c.request.request_id, c.start, c.num_new_tokens) for c in chunks]


def test_chunks_fill_the_budget_running_requests_first():
    sched = scheduler(num_virtual_pages=12, num_swa_pages=12, budget=8)
    a, b = request("a", list(range(10)), arrival_s=1.0), request("b", [50, 51, 52], arrival_s=2.0)
    sched.add(b)
    sched.add(a)  # added later, arrived first: admitted first
    assert step(sched) == [("a", 0, 8)]  # the budget ends the step inside a's prompt
    assert a.vpages == [0, 1] and b.status is RequestStatus.WAITING
    assert step(sched) == [("a", 8, 2), ("b", 0, 3)]  # a's last 2 prompt tokens, then b's prompt
    assert a.vpages == [0, 1, 2] and b.vpages == [3]
    assert a.output_token_ids == [90] and b.output_token_ids == [90]
    assert step(sched) == [("a", 10, 1), ("b", 3, 1)]  # two decodes
    assert a.vpages == [0, 1, 2] and b.vpages == [3]
    assert step(sched) == [("a", 11, 1), ("b", 4, 1)]  # b's fifth token opens its second page
    assert b.vpages == [3, 4]


def test_the_prefill_chunk_cap_and_the_sequence_limit():
    sched = scheduler(num_virtual_pages=12, num_swa_pages=12, budget=16, max_num_seqs=1, max_chunk=5)
    low, high = request("low", list(range(7)), arrival_s=1.0), request("high", [60, 61], priority=2,
                                                                          arrival_s=2.0)
    sched.add(low)
    sched.add(high)
    assert step(sched) == [("high", 0, 2)]  # priority before arrival; one sequence at a time
    assert step(sched) == [("high", 2, 1)]  # a decode is one token: the cap does not delay it
    sched.finish(high, "stop")
    assert high.vpages == [] and sched.running == []
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
    assert (a.vpages, b.vpages) == ([0, 1], [2, 3])
    assert step(sched) == [("a", 8, 1), ("b", 7, 1)]  # a's ninth token takes the last free page
    assert (a.vpages, b.vpages) == ([0, 1, 4], [2, 3])
    # b's ninth token needs a third page and none is free. a, ahead of b and already scheduled, is
    # not preempted for it: b sits the steps out, still running, holding its pages.
    for position in (9, 10, 11):
        assert step(sched) == [("a", position, 1)]
        assert b.status is RequestStatus.RUNNING and b.vpages == [2, 3] and b.num_computed_tokens == 8
    # a's 13th token needs a fourth page: b, the newest, is preempted. Its two computed pages join
    # the cache, and a's grow evicts the leaf of that chain, page 3. b waits out that step (a step's
    # decodes are scheduled before anything is admitted) and is admitted in the next: its first page
    # is a tombstone (its SWA rows slid out while it ran), so nothing matches; the tombstoned page is
    # evicted and handed back to b, which recomputes one page of its tokens.
    assert step(sched) == [("a", 12, 1)]
    assert a.vpages == [0, 1, 4, 3]
    assert b.status is RequestStatus.WAITING and b.num_preemptions == 1 and b.vpages == []
    assert step(sched) == [("a", 13, 1), ("b", 0, 4)]
    assert b.vpages == [2] and b.num_cached_tokens == 0
    assert b.output_token_ids == [90, 91]  # it keeps its tokens and recomputes them
    sched.finish(a, "stop")  # a's three full pages join the cache, its partial page 3 is freed
    assert sched.kv.tree.owned_vpages() == [0, 1, 4]
    # b's rest (its prompt's last 3 tokens and its 2 outputs) takes the free page 3 and evicts the
    # cache's LRU leaf, page 4.
    assert step(sched) == [("b", 4, 5)]
    assert b.vpages == [2, 3, 4] and sched.kv.tree.owned_vpages() == [0, 1]
    assert b.output_token_ids == [90, 91, 92]  # the recompute ends in its next token
    assert step(sched) == [("b", 9, 1)]
