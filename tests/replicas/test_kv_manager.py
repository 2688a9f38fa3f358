"""KVManager on tiny pools: the exact virtual and SWA pages each request is handed, what grow
evicts for it, that a failing grow or replay admission changes nothing, and that a replay
never evicts the pages it copies. check_integrity() after every mutation; no model.

Pools hand out free pages first-in first-out (fresh pages in id order, then freed pages in
the order they were freed), so the page ids a request gets spell out what was evicted.
"""

from __future__ import annotations

import dataclasses

import torch

from antumbra.cachestore.pools import CompressorPool, CompressorSpec, KVPools, PoolLayout
from antumbra.cachestore.shadow_radix import ShadowRadix
from antumbra.replicas.kv_manager import KVManager, PageNeed
from antumbra.replicas.progress import cut_at_stop
from antumbra.replicas.request import Request
from antumbra.replicas.sampling_params import SamplingParams

PAGE = 4
# window 4, an overlapping rate-4 compressor and a rate-4 one, 2 layers: a sequence that has
# computed p tokens still reads the SWA rows of positions >= 4 * (p // 4) - 4, and a replay
# recomputes the last 2 pages of a match.
LAYOUT = PoolLayout(
    page_size=PAGE,
    window=4,
    num_virtual_pages=12,
    num_swa_pages=8,
    num_layers=2,
    head_dim=4,
    index_head_dim=4,
    compressors=(CompressorSpec(0, 4, 2, 4), CompressorSpec(1, 4, 1, 4)),
    indexers=(CompressorSpec(0, 4, 2, 4),),
)


class Manager:
    """A KVManager over fresh pools and a tree, and the requests running on it."""

    def __init__(self, num_virtual_pages: int, num_swa_pages: int, replay: bool = False) -> None:
        layout = dataclasses.replace(LAYOUT, num_virtual_pages=num_virtual_pages, num_swa_pages=num_swa_pages)
        assert layout.replay_tokens(layout.num_layers) == 2 * PAGE
        self.pools = KVPools(layout, torch.float32, "cpu")
        self.tree = ShadowRadix(self.pools)
        self.kv = KVManager(self.pools, self.tree, layout.num_layers, enable_replay=replay)
        self.running: list[Request] = []

    def check(self) -> None:
        self.kv.check_integrity(self.running)

    def admit(self, prompt: list[int], rid: str) -> Request:
        request = Request(rid, prompt, SamplingParams(), None, None, namespace="ns")
        self.kv.admit(request)
        self.running.append(request)
        self.check()
        return request

    def grow(self, request: Request, stop: int) -> bool:
        grown = self.kv.grow(request, stop)
        self.check()
        return grown

    def compute(self, request: Request, stop: int) -> None:
        request.num_computed_tokens = stop
        self.kv.release_slid_out(request)
        self.check()

    def release(self, request: Request, cache: bool = True) -> None:
        self.running.remove(request)
        self.kv.release(request, cache=cache)
        self.check()

    def run(self, prompt: list[int], rid: str) -> Request:
        """Admit, compute every token in one chunk, finish: the full pages join the cache."""
        request = self.admit(prompt, rid)
        assert self.grow(request, len(prompt))
        self.compute(request, len(prompt))
        self.release(request)
        return request

    def swa_pages_of(self, vpages: list[int]) -> list[int]:
        table = self.pools.swa_page_table_host()
        return [table.get(v, -1) for v in vpages]

    def snapshot(self, request: Request) -> tuple:
        """Everything a failed call must leave as it was."""
        tree_nodes = [(n.vpage, n.full_lock, n.swa_lock, n.swa_tombstone) for n in self.tree.nodes_by_depth()]
        return (
            list(request.kv.vpages),
            [n.vpage for n in request.kv.shared_path],
            sorted(request.kv.swa_locked),
            request.num_computed_tokens,
            self.pools.num_free_virtual_pages,
            self.pools.num_free_swa_pages,
            dict(self.pools.swa_page_table_host()),
            tree_nodes,
            self.tree.stats(),
        )


def compressed_rows(pool: CompressorPool, vpage: int) -> torch.Tensor:
    per_page = PAGE // pool.spec.rate
    return pool.rows[vpage * per_page : (vpage + 1) * per_page]


def seq(*tokens: int) -> list[int]:
    """Whole pages, page i made of token `tokens[i]`."""
    return [t for token in tokens for t in [token] * PAGE]


def test_block_tables_and_swa_pages_handed_out_exactly():
    m = Manager(num_virtual_pages=12, num_swa_pages=8)
    first = m.admit(seq(1, 2, 3) + [7], "first")
    assert m.kv.pages_needed(first, 13) == PageNeed(num_vpages=4, num_swa_pages=4)
    assert m.grow(first, 13)
    assert first.kv.vpages == [0, 1, 2, 3] and m.swa_pages_of(first.kv.vpages) == [0, 1, 2, 3]
    m.compute(first, 13)  # pages 0 and 1 slid out of every window: their SWA pages go back
    assert m.swa_pages_of(first.kv.vpages) == [-1, -1, 2, 3]
    m.release(first)  # pages 0-2 join the cache (2 keeps its SWA page); page 3 is freed
    assert m.tree.owned_vpages() == [0, 1, 2]
    assert m.tree.stats() == {
        "nodes": 3, "tombstones": 2, "swa_pages": 1, "full_evictions": 0, "swa_evictions": 0
    }

    second = m.admit(seq(1, 2, 3) + [8, 8], "second")
    assert second.kv.vpages == [0, 1, 2] and second.num_computed_tokens == 12
    assert [n.vpage for n in second.kv.swa_locked.values()] == [2]
    assert m.grow(second, 14)
    assert second.kv.vpages == [0, 1, 2, 4] and m.swa_pages_of(second.kv.vpages) == [-1, -1, 2, 4]
    other = m.admit(seq(9, 9) + [7], "other")
    assert m.grow(other, 9)
    assert other.kv.vpages == [5, 6, 7] and m.swa_pages_of(other.kv.vpages) == [5, 6, 7]
    m.release(second, cache=False)
    m.release(other, cache=False)
    assert m.pools.alloc_virtual_pages(9) == [8, 9, 10, 11, 3, 4, 5, 6, 7]


def test_grow_evicts_just_the_missing_pages_lru_first_and_hands_them_out():
    m = Manager(num_virtual_pages=6, num_swa_pages=8)
    m.run(seq(1, 2) + [7], "a")  # cached: 0, 1 (1 keeps SWA page 1)
    m.run(seq(3, 4) + [7], "b")  # cached: 3, 4 (4 keeps SWA page 4); free: 2, 5
    assert sorted(m.tree.owned_vpages()) == [0, 1, 3, 4]
    request = m.admit(seq(5, 6, 7, 8) + [7], "r")
    assert m.kv.pages_needed(request, 17) == PageNeed(5, 5)
    assert m.grow(request, 17)
    # 3 evicted: the leaves by age (1, 4), then 1's bare parent 0; page 3 stays cached
    assert request.kv.vpages == [2, 5, 1, 4, 0]
    assert m.tree.owned_vpages() == [3]
    assert m.swa_pages_of(request.kv.vpages) == [6, 7, 0, 2, 3]  # no SWA page had to be evicted


def test_a_grow_that_cannot_fit_changes_nothing():
    m = Manager(num_virtual_pages=12, num_swa_pages=6)
    m.run(seq(1, 2) + [7], "cached")  # cached 0, 1; page 1 keeps an SWA page
    holder = m.admit(seq(5, 5, 5) + [7], "holder")
    assert m.grow(holder, 13)  # 4 pages with 4 SWA pages, kept: it does not compute
    request = m.admit(seq(6, 6) + [7, 7], "r")
    # 3 pages are free, but only 1 SWA page plus the cached one: nothing may move
    assert m.kv.pages_needed(request, 10) == PageNeed(3, 3)
    before = m.snapshot(request)
    assert not m.grow(request, 10)
    assert m.snapshot(request) == before
    # a chunk that fits takes the free SWA page and the cached one (tombstoning page 1)
    assert m.grow(request, 5)
    assert request.kv.vpages == [7, 8] and m.swa_pages_of(request.kv.vpages) == [2, 1]
    assert m.tree.stats()["swa_pages"] == 0 and m.tree.owned_vpages() == [0, 1]


def test_replay_evicts_other_pages_never_the_ones_it_copies():
    m = Manager(num_virtual_pages=10, num_swa_pages=8, replay=True)
    m.run(seq(1, 2, 3, 4, 5) + [7], "x")  # cached 0-4, page 4 live
    m.run(seq(6, 7) + [7], "y")  # cached 6, 7
    holder = m.admit(seq(8, 8) + [7] * 4, "holder")
    assert m.grow(holder, 12) and holder.kv.vpages == [9, 5, 8]  # no page left free
    assert m.tree.evict_swa(1) == 1  # x's tail (older than y's) is tombstoned: its match needs a replay
    m.check()
    for vpage in (3, 4):  # tell the cached pages' compressed rows apart
        for pool in m.pools.compressors.values():
            compressed_rows(pool, vpage).fill_(float(vpage + 1))
    pools = list(m.pools.compressors.values())
    cached_rows = {v: [compressed_rows(pool, v).clone() for pool in pools] for v in (3, 4)}

    request = m.admit(seq(1, 2, 3, 4, 5) + [7, 7, 7], "q")
    # shares pages 0-2, recomputes pages 3-4 into own pages made by evicting y (7, then its parent 6)
    assert request.kv.vpages == [0, 1, 2, 7, 6] and request.num_computed_tokens == 3 * PAGE
    assert m.tree.owned_vpages() == [0, 1, 2, 3, 4]
    for own, cached in ((7, 3), (6, 4)):
        for pool, rows in zip(pools, cached_rows[cached], strict=True):
            assert torch.equal(compressed_rows(pool, own), rows)
            assert torch.equal(compressed_rows(pool, cached), rows)
    assert m.kv.counters.num_replays == 1


def test_a_replay_that_cannot_get_its_pages_admits_directly_holding_nothing_more():
    m = Manager(num_virtual_pages=9, num_swa_pages=8, replay=True)
    m.run(seq(1, 2, 3, 4, 5) + [7], "x")  # cached 0-4, page 4 live
    m.run(seq(6) + [7], "y")  # cached 6: the only page outside x's match
    holder = m.admit(seq(8, 8) + [7] * 4, "holder")
    assert m.grow(holder, 12) and holder.kv.vpages == [8, 5, 7]
    assert m.tree.evict_swa(1) == 1
    m.check()
    request = m.admit(seq(1, 2, 3, 4, 5) + [7, 7, 7], "q")
    # x's live part is empty, and 2 replay pages would need evicting x itself: no replay, no pages
    assert request.kv.vpages == [] and request.num_computed_tokens == 0 and request.num_cached_tokens == 0
    assert sorted(m.tree.owned_vpages()) == [0, 1, 2, 3, 4, 6]
    assert m.tree.evictable_full_pages() == 6
    assert m.kv.counters.num_replays == 0
    assert m.grow(request, 4) and request.kv.vpages == [6]  # computing from scratch evicts y, the LRU


def test_a_request_cut_at_a_stop_caches_only_the_pages_of_the_tokens_it_keeps():
    m = Manager(num_virtual_pages=12, num_swa_pages=8)
    request = m.admit(seq(1) + [5], "r")  # a 5-token prompt
    for token in (60, 61, 62, 63, 64):  # decode 5 tokens: 10 known, the first 9 computed
        assert m.grow(request, request.num_tokens)
        m.compute(request, request.num_tokens)
        request.output_token_ids.append(token)
    assert request.kv.vpages == [0, 1, 2] and request.num_computed_tokens == 9
    # A stop string ended it at its 2nd output token, found after the engine had drawn 3 more:
    # 7 tokens are kept, 6 of them computed, so one full page joins the cache and 1 and 2 go back.
    cut_at_stop(request, 2)
    assert request.output_token_ids == [60, 61] and request.num_computed_tokens == 6
    m.release(request)
    assert m.tree.owned_vpages() == [0]
    assert m.pools.num_free_virtual_pages == 11


def decode(m: Manager, request: Request, num_computed: int) -> None:
    """Draw tokens one at a time (each computed the step after) until `num_computed` are computed."""
    while request.num_computed_tokens < num_computed:
        if request.num_computed_tokens == request.num_tokens:
            request.output_token_ids.append(60 + request.num_output_tokens)
        assert m.grow(request, request.num_tokens)
        m.compute(request, request.num_tokens)


def test_a_decoding_request_hands_its_prompt_checkpoint_to_the_cache():
    m = Manager(num_virtual_pages=12, num_swa_pages=8)
    prompt = seq(1, 2, 3) + [7]  # reuse boundary 12: a match of 3 pages reads page 2's SWA rows
    request = m.admit(prompt, "r")
    assert m.kv.checkpoint_pages(request) == range(2, 3)
    decode(m, request, 15)  # page 2 is still in the window: nothing moves
    assert request.kv.shared_path == [] and m.tree.owned_vpages() == []
    assert m.swa_pages_of(request.kv.vpages) == [-1, -1, 2, 3]
    decode(m, request, 16)  # page 2 slides out: pages 0-2 join the cache, page 2 with its SWA page
    assert [n.vpage for n in request.kv.shared_path] == [0, 1, 2] and request.kv.vpages == [0, 1, 2, 3]
    assert request.kv.swa_locked == {}
    assert m.swa_pages_of(request.kv.vpages) == [-1, -1, 2, 3]
    assert m.tree.stats()["tombstones"] == 2 and m.tree.stats()["swa_pages"] == 1
    # the checkpoint is the cache's: SWA-evictable while the request runs, its pages are not
    assert m.tree.evictable_swa_pages() == 1 and m.tree.evictable_full_pages() == 0

    same = m.admit(seq(1, 2, 3) + [8], "same")  # the same prompt, while the first still decodes
    assert same.kv.vpages == [0, 1, 2] and same.num_cached_tokens == 12
    assert [n.vpage for n in same.kv.swa_locked.values()] == [2]
    decode(m, request, 23)
    m.release(request)  # its full pages 3 and 4 join below the shared ones, 5 (partial) goes back
    assert sorted(m.tree.owned_vpages()) == [0, 1, 2, 3, 4] and 5 not in m.pools.swa_page_table_host()
    m.release(same, cache=False)
    assert m.run(prompt, "again").num_cached_tokens == 12


def test_a_page_aligned_prompt_keeps_its_checkpoint_from_the_end_of_its_prefill():
    m = Manager(num_virtual_pages=12, num_swa_pages=8)
    prompt = seq(1, 2, 3, 4)  # 16 tokens: boundary 12, and page 2 is behind the horizon of 16
    first = m.run(prompt, "first")
    assert first.num_cached_tokens == 0
    assert m.tree.stats() == {"nodes": 4, "tombstones": 2, "swa_pages": 2, "full_evictions": 0,
                              "swa_evictions": 0}
    assert m.swa_pages_of([0, 1, 2, 3]) == [-1, -1, 2, 3]
    assert m.run(prompt, "again").num_cached_tokens == 12


def test_a_checkpoint_gives_way_to_a_running_request_short_of_swa_pages():
    m = Manager(num_virtual_pages=12, num_swa_pages=5)
    request = m.admit(seq(1, 2, 3) + [7], "r")
    decode(m, request, 16)  # SWA pages: 0 and 1 freed, 2 the cache's checkpoint, 3 its own
    assert m.pools.num_free_swa_pages == 3 and m.tree.evictable_swa_pages() == 1
    other = m.admit(seq(9, 9, 9) + [7], "other")
    assert m.kv.can_free(4, 4)
    assert m.grow(other, 13)  # 4 SWA pages: the 3 free ones (4, then 0 and 1 as freed) and the checkpoint's
    assert other.kv.vpages == [4, 5, 6, 7] and m.swa_pages_of(other.kv.vpages) == [4, 0, 1, 2]
    assert m.tree.stats()["tombstones"] == 3 and m.tree.stats()["swa_evictions"] == 1
    assert m.swa_pages_of(request.kv.vpages) == [-1, -1, -1, 3]
    # the request still reads what it read: pages 0-2 stay shared, no SWA lock was broken
    assert [n.vpage for n in request.kv.shared_path] == [0, 1, 2] and request.kv.swa_locked == {}
    m.release(other, cache=False)
    decode(m, request, 20)
    m.release(request)
    assert m.tree.match("ns", seq(1, 2, 3) + [7], 3).num_swa_pages == 0  # the checkpoint is gone


def test_a_prompt_cached_meanwhile_stays_own_and_revives_a_tombstoned_checkpoint():
    m = Manager(num_virtual_pages=12, num_swa_pages=8)
    prompt = seq(1, 2, 3) + [7]
    first, second = m.admit(prompt, "first"), m.admit(prompt, "second")
    assert m.grow(first, 13) and m.grow(second, 13)
    m.compute(first, 13)
    m.compute(second, 13)
    assert first.kv.vpages == [0, 1, 2, 3] and second.kv.vpages == [4, 5, 6, 7]
    decode(m, first, 16)  # first's pages 0-2 join the cache
    assert m.tree.evict_swa(1) == 1  # its checkpoint goes under pressure
    m.check()
    assert m.swa_pages_of(second.kv.vpages) == [-1, -1, 6, 7]
    decode(m, second, 16)
    # second computed its pages itself and keeps them, but its SWA page 6 revives page 2's node
    assert second.kv.shared_path == [] and second.kv.vpages == [4, 5, 6, 7]
    assert m.swa_pages_of([2, 6]) == [6, -1]
    assert sorted(m.tree.owned_vpages()) == [0, 1, 2]
    m.release(first)
    m.release(second)  # its pages duplicate the cached ones: freed
    assert sorted(m.tree.owned_vpages()) == [0, 1, 2, 3]
    assert m.run(prompt, "again").num_cached_tokens == 12
