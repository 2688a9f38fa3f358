"""ShadowRadix rules, one scenario each, with check_integrity() after every mutation."""

from __future__ import annotations

import torch

from antumbra.cachestore.block_hash import AllCleared, BlockRemoved, BlockStored, block_hashes
from antumbra.cachestore.pools import CompressorSpec, KVPools, PoolLayout
from antumbra.cachestore.shadow_radix import ShadowRadix
from antumbra.replicas.kv_manager import KVManager
from antumbra.replicas.request import Request
from antumbra.replicas.sampling_params import SamplingParams

PAGE = 16
LAYOUT = PoolLayout(
    page_size=PAGE,
    window=8,
    num_virtual_pages=32,
    num_swa_pages=12,
    num_layers=2,
    head_dim=4,
    index_head_dim=4,
    compressors=(CompressorSpec(0, 4, 2, 4), CompressorSpec(1, 16, 1, 4)),
    indexers=(CompressorSpec(0, 4, 2, 4),),
)


def make(events=None):
    pools = KVPools(LAYOUT, torch.float32, "cpu")
    tree = ShadowRadix(pools, events.append if events is not None else None)
    kv = KVManager(pools, tree, LAYOUT.num_layers, enable_replay=False)
    return pools, tree, kv


def run(kv: KVManager, tokens: list[int], namespace: str = "ns", rid: str = "r") -> Request:
    """Admit, compute every token, finish: the request's pages end up in the cache."""
    request = Request(rid, list(tokens), SamplingParams(), None, None, namespace=namespace)
    kv.admit(request)
    assert kv.grow(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    kv.release_slid_out(request)
    kv.check_integrity([request])
    kv.release(request)
    kv.check_integrity([])
    return request


def test_a_request_keeps_only_its_swa_tail_and_all_pages():
    pools, tree, kv = make()
    tokens = list(range(5 * PAGE + 3))
    run(kv, tokens)
    stats = tree.stats()
    assert stats["nodes"] == 5
    # only the pages the next token would read keep SWA rows
    assert stats["swa_pages"] == 1 and stats["tombstones"] == 4
    match = tree.match("ns", tokens + [1], 6)
    assert match.num_full_pages == 5 and match.num_swa_pages == 5


def test_match_ends_at_the_deepest_live_tail():
    pools, tree, kv = make()
    run(kv, list(range(3 * PAGE)) + [99])
    tree.evict_swa(10)
    tree.check_integrity()
    match = tree.match("ns", list(range(3 * PAGE)) + [5], 3)
    assert match.num_full_pages == 3 and match.num_swa_pages == 0
    request = run(kv, list(range(3 * PAGE)) + [5], rid="b")
    assert request.num_cached_tokens == 0  # replay off: a dead tail means recompute


def test_insert_over_a_tombstone_revives_it_with_the_new_rows():
    pools, tree, kv = make()
    tokens = list(range(2 * PAGE)) + [1]
    run(kv, tokens)
    tree.evict_swa(10)
    assert tree.stats()["swa_pages"] == 0
    run(kv, tokens, rid="again")  # recomputes (tail dead), then inserts duplicates
    tree.check_integrity()
    assert tree.stats()["nodes"] == 2
    assert tree.stats()["swa_pages"] == 1
    assert tree.match("ns", tokens, 2).num_swa_pages == 2
    assert pools.num_free_virtual_pages == LAYOUT.num_virtual_pages - 2


def test_namespaces_never_share_nodes():
    pools, tree, kv = make()
    tokens = list(range(2 * PAGE)) + [1]
    run(kv, tokens, namespace="tenant-a")
    assert tree.match("tenant-b", tokens, 2).num_full_pages == 0
    other = run(kv, tokens, namespace="tenant-b", rid="b")
    assert other.num_cached_tokens == 0
    assert tree.stats()["nodes"] == 4
    again = run(kv, tokens, namespace="tenant-a", rid="c")
    assert again.num_cached_tokens == 2 * PAGE


def test_full_eviction_is_lru_over_leaves_and_takes_emptied_parents():
    pools, tree, kv = make()
    run(kv, [1] * PAGE + [2] * PAGE + [0])
    run(kv, [1] * PAGE + [3] * PAGE + [0], rid="b")
    tree.match("ns", [1] * PAGE + [2] * PAGE + [0], 2)  # refresh the first branch
    assert tree.evict_full(1) == 1
    tree.check_integrity()
    assert tree.match("ns", [1] * PAGE + [3] * PAGE, 2).num_full_pages == 1
    assert tree.match("ns", [1] * PAGE + [2] * PAGE, 2).num_full_pages == 2
    assert tree.evict_full(3) == 2
    tree.check_integrity()
    assert tree.stats()["nodes"] == 0
    assert pools.num_free_virtual_pages == LAYOUT.num_virtual_pages


def test_locked_nodes_survive_eviction():
    pools, tree, kv = make()
    tokens = list(range(2 * PAGE)) + [1]
    run(kv, tokens)
    holder = Request("holder", tokens, SamplingParams(), None, None, namespace="ns")
    kv.admit(holder)
    assert holder.num_cached_tokens == 2 * PAGE
    assert tree.evict_full(5) == 0
    assert tree.evict_swa(5) == 0  # the tail it reads is SWA-locked
    kv.check_integrity([holder])
    kv.release(holder, cache=False)
    kv.check_integrity([])
    assert tree.evict_full(5) == 2


def test_events_carry_the_shared_block_hashes():
    events = []
    pools, tree, kv = make(events)
    tokens = list(range(3 * PAGE)) + [4]
    run(kv, tokens, namespace="m:t")
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.hashes]
    assert stored == block_hashes(tokens, PAGE, "m:t")
    tree.clear()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.hashes]
    assert sorted(removed) == sorted(stored)
    assert isinstance(events[-1], AllCleared)
