"""ShadowRadix scenarios on tiny pools, asserting the exact virtual / SWA page ids handed out
and the exact eviction order (not just counts); check_integrity() after every mutation.

Pools hand out free pages first-in first-out: fresh pages in id order, then freed pages in
the order they were freed, so the ids a later allocation gets spell out the eviction order.
"""

from __future__ import annotations

import torch

from antumbra.cachestore.block_hash import BlockEvent
from antumbra.cachestore.contract import PrefixCache, PrefixMatch
from antumbra.cachestore.pools import CompressorSpec, KVPools, PoolLayout
from antumbra.cachestore.shadow_radix import Match, ShadowRadix
from tests.cachestore.radix_reference import removed_hashes

PAGE = 4
# window 4, an overlapping rate-4 compressor and a rate-4 one: a continuation after k pages
# reads the SWA rows of page k-1 only.
LAYOUT = PoolLayout(
    page_size=PAGE,
    window=4,
    num_virtual_pages=16,
    num_swa_pages=8,
    num_layers=2,
    head_dim=4,
    index_head_dim=4,
    compressors=(CompressorSpec(0, 4, 2, 4), CompressorSpec(1, 4, 1, 4)),
    indexers=(CompressorSpec(0, 4, 2, 4),),
)


def page(token: int) -> list[int]:
    return [token] * PAGE


def seq(*tokens: int) -> list[int]:
    """A computed sequence of whole pages, page i made of token `tokens[i]`."""
    return [t for token in tokens for t in page(token)]


class Cache:
    """A tree on fresh pools, with the removals it announced (as virtual pages, in order)."""

    def __init__(self) -> None:
        self.pools = KVPools(LAYOUT, torch.float32, "cpu")
        self.events: list[BlockEvent] = []
        self.tree = ShadowRadix(self.pools, self.events.append)
        self.vpage_of_hash: dict[int, int] = {}

    def check(self) -> None:
        self.pools.check_integrity()
        self.tree.check_integrity()
        owned = set(self.tree.owned_vpages())
        assert self.pools.num_free_virtual_pages + len(owned) == LAYOUT.num_virtual_pages

    def finish(self, tokens: list[int], live: tuple[int, ...] = (), namespace: str = "ns") -> list[int]:
        """Insert a sequence as a finished request does: an own page per full page, SWA pages
        attached to the logical pages in `live`, duplicates freed. -> the pages it allocated."""
        vpages = self.pools.alloc_virtual_pages(len(tokens) // PAGE)
        for logical in live:
            self.pools.attach_swa(vpages[logical])
        self.pools.free_virtual_pages(self.tree.insert(namespace, tokens, vpages, 0))
        for node in self.tree.nodes_by_depth():
            self.vpage_of_hash[node.block_hash] = node.vpage
        self.check()
        return vpages

    def evict_full(self, num_pages: int) -> list[int]:
        """-> the virtual pages the eviction freed, in order."""
        start = len(self.events)
        freed = self.tree.evict_full(num_pages)
        self.check()
        removed = [self.vpage_of_hash[h] for h in removed_hashes(self.events[start:])]
        assert freed == len(removed)
        return removed

    def evict_swa_one(self) -> int | None:
        """Evict one SWA page; -> the virtual page it was attached to (None if nothing was evictable)."""
        live = {n.vpage for n in self.tree.nodes_by_depth() if not n.swa_tombstone}
        evictable = self.tree.evictable_swa_pages()
        assert self.tree.evict_swa(1) == min(1, evictable)
        assert self.tree.evictable_swa_pages() == max(0, evictable - 1)
        self.check()
        gone = live - {n.vpage for n in self.tree.nodes_by_depth() if not n.swa_tombstone}
        return gone.pop() if gone else None

    def match(self, tokens: list[int], namespace: str = "ns", touch: bool = True) -> PrefixMatch:
        result = self.tree.match(namespace, tokens, len(tokens) // PAGE, touch=touch)
        self.check()
        return result


def vpages_of(match: PrefixMatch) -> list[int]:
    return [n.vpage for n in match.path]


def test_shadow_radix_implements_the_contract_and_keeps_the_old_names():
    cache = Cache()
    assert isinstance(cache.tree, PrefixCache)
    assert Match is PrefixMatch
    cache.finish(seq(1, 2), live=(1,))
    assert [n.vpage for n in cache.tree._nodes()] == [n.vpage for n in cache.tree.nodes_by_depth()] == [0, 1]
    match = cache.match(seq(1, 2))
    assert isinstance(match, tuple) and match == (match.path, 2) and match.num_full_pages == 2


def test_full_eviction_frees_lru_leaves_then_their_parents_and_the_ids_come_back_in_that_order():
    cache = Cache()
    assert cache.finish(seq(1, 2, 3)) == [0, 1, 2]
    assert cache.finish(seq(1, 4)) == [3, 4]  # page 1 is a duplicate: 3 goes back to the free list
    assert cache.finish(seq(5)) == [5]  # fresh pages come first: 5, not 3
    assert vpages_of(cache.match(seq(1, 2, 3))) == [0, 1, 2]  # refresh the first sequence
    # leaves by age: 4 (page 4, inserted second), 5, then 2 (refreshed); 1 and 0 once bare
    assert cache.tree.evictable_full_pages() == 5
    assert cache.evict_full(1) == [4]
    assert cache.evict_full(3) == [5, 2, 1]
    assert cache.tree.evictable_full_pages() == 1
    assert cache.evict_full(9) == [0]
    assert cache.evict_full(9) == [] and cache.evict_full(0) == []
    assert cache.pools.alloc_virtual_pages(16) == [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 3, 4, 5, 2, 1, 0]


def test_full_eviction_goes_in_rounds_like_the_sweep_it_replaced():
    """A parent that becomes a bare leaf waits for the leaves that were there when the round began,
    even younger ones: so one call of 2 frees something else than two calls of 1."""
    batched, single = Cache(), Cache()
    for cache in (batched, single):
        assert cache.finish(seq(1, 2)) == [0, 1]  # older chain
        assert cache.finish(seq(3)) == [2]  # younger leaf
    assert batched.evict_full(2) == [1, 2]
    assert single.evict_full(1) + single.evict_full(1) == [1, 0]


def test_locked_nodes_are_skipped_and_rejoin_with_their_own_stamp():
    cache = Cache()
    cache.finish(seq(1, 2))
    cache.finish(seq(3))
    held = cache.match(seq(1, 2))  # refreshed: now younger than page 3
    cache.tree.lock(held.path, [])
    cache.check()
    assert cache.tree.evictable_full_pages() == 1
    assert cache.evict_full(5) == [2]
    cache.finish(seq(4))  # younger than the held path's stamp
    cache.tree.unlock(held.path)
    cache.check()
    assert cache.tree.evictable_full_pages() == 3
    assert cache.evict_full(1) == [1]
    assert cache.evict_full(1) == [0]  # the sweep's second call: the bare parent is older than page 4
    assert cache.evict_full(1) == [3]  # page 4's page: fresh ones are handed out before freed ones


def test_swa_eviction_is_lru_shallow_first_and_hands_the_swa_pages_out_again_in_that_order():
    cache = Cache()
    assert cache.finish(seq(1, 2, 3), live=(0, 1, 2)) == [0, 1, 2]
    assert cache.finish(seq(4), live=(0,)) == [3]
    assert cache.pools.swa_page_table_host() == {0: 0, 1: 1, 2: 2, 3: 3}
    assert cache.tree.evictable_swa_pages() == 4
    # one insert stamps its whole chain alike: the page farthest from the end goes first
    assert cache.evict_swa_one() == 0
    assert cache.evict_swa_one() == 1
    match = cache.match(seq(1, 2, 3))  # the tail (page 2, live) is refreshed; pages 0, 1 are tombstones
    assert (vpages_of(match), match.num_swa_pages) == ([0, 1, 2], 3)
    assert cache.evict_swa_one() == 3
    assert cache.evict_swa_one() == 2
    assert cache.evict_swa_one() is None
    assert cache.tree.stats() == {
        "nodes": 4, "tombstones": 4, "swa_pages": 0, "full_evictions": 0, "swa_evictions": 4
    }
    fresh = cache.pools.alloc_virtual_pages(8)
    assert [cache.pools.attach_swa(v) for v in fresh] == [4, 5, 6, 7, 0, 1, 3, 2]


def test_swa_locks_protect_the_tail_and_releasing_them_makes_it_evictable():
    cache = Cache()
    cache.finish(seq(1, 2, 3), live=(1, 2))
    match = cache.match(seq(1, 2, 3))
    tail = cache.tree.swa_tail(match.path, 3)
    assert [n.vpage for n in tail] == [2]
    cache.tree.lock(match.path, tail)
    cache.check()
    assert cache.tree.evictable_swa_pages() == 1 and cache.tree.evictable_full_pages() == 0
    assert cache.evict_swa_one() == 1
    assert cache.evict_swa_one() is None
    cache.tree.release_swa(tail[0])  # slid out of the running request's window
    cache.check()
    assert cache.tree.evictable_swa_pages() == 1 and cache.tree.evictable_full_pages() == 0
    assert cache.evict_swa_one() == 2
    cache.tree.unlock(match.path)
    cache.check()
    assert cache.evict_full(3) == [2, 1, 0]


def test_match_ends_at_the_deepest_live_tail_and_a_peek_changes_no_stamp():
    cache = Cache()
    cache.finish(seq(1, 2, 3, 4), live=(1,))
    assert cache.finish(seq(5), live=(0,)) == [4]
    peek = cache.match(seq(1, 2, 3, 4, 6), touch=False)
    assert (vpages_of(peek), peek.num_swa_pages) == ([0, 1, 2, 3], 2)  # pages 2 and 3 are tombstones
    assert cache.evict_swa_one() == 1  # the peek did not refresh page 1: it is older than page 5
    again = cache.match(seq(1, 2, 3, 4))
    assert (vpages_of(again), again.num_swa_pages) == ([0, 1, 2, 3], 0)
    assert cache.match(seq(1, 7)).num_full_pages == 1
    assert cache.match(seq(9)).num_full_pages == 0


def test_insert_over_a_tombstone_moves_the_duplicates_swa_page_to_the_cached_node():
    cache = Cache()
    assert cache.finish(seq(1, 2), live=(1,)) == [0, 1]
    assert cache.pools.swa_page_table_host() == {1: 0}
    assert cache.evict_swa_one() == 1
    # the same pages computed again, with a live tail in SWA page 1: vpages 2 and 3 are duplicates
    assert cache.finish(seq(1, 2), live=(1,)) == [2, 3]
    assert cache.pools.swa_page_table_host() == {1: 1}
    assert cache.match(seq(1, 2)).num_swa_pages == 2
    assert cache.pools.alloc_virtual_pages(3) == [4, 5, 6]
    assert cache.pools.attach_swa(4) == 2


def test_namespaces_get_their_own_pages_and_share_one_lru_clock():
    cache = Cache()
    assert cache.finish(seq(1, 2), namespace="tenant-a") == [0, 1]
    assert cache.finish(seq(1, 2), namespace="tenant-b") == [2, 3]
    assert vpages_of(cache.match(seq(1, 2), namespace="tenant-a")) == [0, 1]
    assert cache.match(seq(1, 2), namespace="tenant-c").num_full_pages == 0
    assert cache.evict_full(1) == [3]  # tenant-b's leaf is the older one
    assert cache.evict_full(3) == [2, 1, 0]  # its bare parent is older than tenant-a's leaf
