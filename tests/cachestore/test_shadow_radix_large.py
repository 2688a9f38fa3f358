"""ShadowRadix on large trees (thousands of pages): no recursion anywhere, and eviction work per
page that does not grow with the tree, counted in heap steps (`num_lru_steps`), not timed.

Pages are 4 tokens so a 5000-page chain stays small. check_integrity() runs after every
mutation, except inside `build`, which checks the finished tree once (a check is O(n), so
checking each of 5000 inserts would cost O(n^2)).
"""

from __future__ import annotations

import pytest
import torch

from antumbra.cachestore.block_hash import BlockEvent
from antumbra.cachestore.pools import CompressorSpec, KVPools, PoolLayout
from antumbra.cachestore.shadow_radix import ShadowRadix
from tests.cachestore.radix_reference import removed_hashes

PAGE = 4
NUM_PAGES = 5000
LAYOUT = PoolLayout(
    page_size=PAGE,
    window=4,
    num_virtual_pages=NUM_PAGES + 8,
    num_swa_pages=NUM_PAGES + 8,
    num_layers=2,
    head_dim=4,
    index_head_dim=4,
    compressors=(CompressorSpec(0, 4, 2, 4), CompressorSpec(1, 4, 1, 4)),
    indexers=(CompressorSpec(0, 4, 2, 4),),
)
# Heap steps one evicted page may cost: its own pop, a stale entry it left, its parent's push.
MAX_STEPS_PER_PAGE = 4


class Cache:
    def __init__(self) -> None:
        self.pools = KVPools(LAYOUT, torch.float32, "cpu")
        self.events: list[BlockEvent] = []
        self.tree = ShadowRadix(self.pools, self.events.append)

    def check(self) -> None:
        self.pools.check_integrity()
        self.tree.check_integrity()
        assert self.pools.num_free_virtual_pages + self.tree.num_nodes == LAYOUT.num_virtual_pages

    def finish(self, tokens: list[int], live: range | list[int], check: bool = True) -> list[int]:
        """Insert a sequence of whole pages as a finished request does; SWA on the logical pages in `live`."""
        vpages = self.pools.alloc_virtual_pages(len(tokens) // PAGE)
        for logical in live:
            self.pools.attach_swa(vpages[logical])
        self.pools.free_virtual_pages(self.tree.insert("ns", tokens, vpages, 0))
        if check:
            self.check()
        return vpages

    def evict_full(self, num_pages: int) -> list[int]:
        """-> the virtual pages freed, in order (read back from the removal events)."""
        vpage_of_hash = {n.block_hash: n.vpage for n in self.tree.nodes_by_depth()}
        start = len(self.events)
        freed = self.tree.evict_full(num_pages)
        self.check()
        removed = [vpage_of_hash[h] for h in removed_hashes(self.events[start:])]
        assert len(removed) == freed
        return removed

    def evict_swa(self, num_pages: int) -> list[int]:
        """-> the virtual pages whose SWA page was freed, in page order."""
        live = {n.vpage for n in self.tree.nodes_by_depth() if not n.swa_tombstone}
        freed = self.tree.evict_swa(num_pages)
        self.check()
        gone = sorted(live - {n.vpage for n in self.tree.nodes_by_depth() if not n.swa_tombstone})
        assert len(gone) == freed
        return gone


def chain_tokens(num_pages: int, first: int = 0) -> list[int]:
    """Pages of distinct tokens: page i holds tokens [4(first+i), 4(first+i)+4)."""
    return list(range(first * PAGE, (first + num_pages) * PAGE))


def test_a_5000_page_chain_matches_locks_and_evicts_without_recursion():
    cache = Cache()
    tree = cache.tree
    tokens = chain_tokens(NUM_PAGES)
    cache.finish(tokens, live=[NUM_PAGES - 2, NUM_PAGES - 1])
    assert tree.evictable_full_pages() == NUM_PAGES and tree.evictable_swa_pages() == 2
    assert [n.depth for n in tree.nodes_by_depth()] == list(range(1, NUM_PAGES + 1))

    match = tree.match("ns", tokens + [0], NUM_PAGES)
    cache.check()
    assert (match.num_full_pages, match.num_swa_pages) == (NUM_PAGES, NUM_PAGES)
    tail = tree.swa_tail(match.path, NUM_PAGES)
    assert [n.vpage for n in tail] == [NUM_PAGES - 1]
    tree.lock(match.path, tail)
    cache.check()
    assert tree.evictable_full_pages() == 0 and tree.evictable_swa_pages() == 1
    assert cache.evict_full(10) == []
    assert cache.evict_swa(5) == [NUM_PAGES - 2]
    tree.release_swa(tail[0])
    cache.check()
    tree.unlock(match.path)
    cache.check()
    assert tree.evictable_full_pages() == NUM_PAGES and tree.evictable_swa_pages() == 1

    # partial: the deepest 1000 pages go, one round each (a chain has one leaf at a time)
    assert cache.evict_full(1000) == list(range(NUM_PAGES - 1, NUM_PAGES - 1001, -1))
    shorter = tree.match("ns", tokens, NUM_PAGES)
    cache.check()
    assert (shorter.num_full_pages, shorter.num_swa_pages) == (4000, 0)  # the live tail went with them

    # a request holding the first 2500 pages: eviction stops right below them
    held = tree.match("ns", tokens, 2500)
    tree.lock(held.path, [])
    cache.check()
    assert tree.evictable_full_pages() == 1500
    assert cache.evict_full(NUM_PAGES) == list(range(3999, 2499, -1))
    tree.unlock(held.path)
    cache.check()
    tree.clear()
    cache.check()
    assert tree.stats()["nodes"] == 0 and cache.pools.num_free_virtual_pages == LAYOUT.num_virtual_pages


def build(shape: str, num_pages: int) -> Cache:
    """`chain`: one sequence; `fan`: single-page sequences; `comb`: two-page sequences sharing
    nothing; every page with a live SWA page."""
    cache = Cache()
    pages_per_sequence = {"chain": num_pages, "fan": 1, "comb": 2}[shape]
    for first in range(0, num_pages, pages_per_sequence):
        cache.finish(chain_tokens(pages_per_sequence, first), live=range(pages_per_sequence), check=False)
    cache.check()
    return cache


@pytest.mark.parametrize("shape", ["chain", "fan", "comb"])
def test_eviction_work_per_page_does_not_grow_with_the_tree(shape):
    """Evicting the same 200 pages (in calls of 50) costs the same few heap steps per page in a
    tree of 200 pages as in one of 5000: each page is one pop away (a sweep would visit them all)."""
    for num_pages in (200, 1000, NUM_PAGES):
        cache = build(shape, num_pages)
        for evict in (cache.evict_swa, cache.evict_full):
            before = cache.tree.num_lru_steps
            freed = sum(len(evict(50)) for _ in range(4))
            assert freed == 200
            steps = cache.tree.num_lru_steps - before
            assert steps <= MAX_STEPS_PER_PAGE * freed, f"{shape} of {num_pages} pages: {steps} steps"


def test_touching_matches_leave_a_bounded_number_of_stale_heap_entries():
    """Each match re-keys the leaf it touches; the stale entries are compacted away, so eviction
    later does not wade through one entry per past match."""
    cache = build("fan", 1000)
    tree = cache.tree
    for round_ in range(20):
        for first in range(0, 1000, 7):
            tree.match("ns", chain_tokens(1, first), 1)
        cache.check()
        assert len(tree._full_lru._heap) <= 2 * len(tree._full_lru) + 32, f"round {round_}"
    before = tree.num_lru_steps
    assert len(cache.evict_full(1000)) == 1000
    assert tree.num_lru_steps - before <= 3 * 1000 + 32
