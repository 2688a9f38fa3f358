"""ShadowRadix: one prefix tree over virtual token slots, projected into decoupled pools.

The tree is keyed by token ids, one page (`P` tokens) per edge, under one root per
cache namespace. Each node owns one virtual page; the page's *shadows* are its rows
in every pool: C_m rows (`slot // m`, live as long as the node), and SWA rows plus the
compression-state rows inside them (attached or not, independently).

It implements `PrefixCache` (contract.py states the rules callers rely on: locks,
tombstones, matches, what eviction frees). How it keeps them:

  * Match: walk the longest page-aligned path (`full` depth K). The match used
    directly is the deepest k <= K whose SWA tail is live: every node covering
    positions [swa_horizon(k*P), k*P) is not tombstoned (the window the next token
    reads, and the previous compression window an overlapping compressor reads).
  * Insert: a finished (or preempted) request's computed pages join the tree;
    pages already present are freed as duplicates, except that a duplicate with
    a live SWA page revives a tombstoned node by moving that SWA page over.
  * Stamps: one clock; a touching match stamps its whole path (`full_stamp`) and its
    live tail (`swa_stamp`), an insert the path it walks (both). One stamp value thus
    covers one chain, and eviction lists order by (stamp, depth): a total order in which
    a parent never comes after its child.

Eviction in O(log n) per page. Two lazy heaps (lru_heap.py) hold the candidates, and
every change to a node's lock, children, tombstone or stamp refreshes its entries:

  * full list == the unlocked leaves, by (full_stamp, depth);
  * SWA list  == the live, SWA-unlocked nodes, by (swa_stamp, depth);
  * `_num_unlocked_nodes` == the non-root nodes with full_lock == 0, which (locks being
    taken on whole paths, so a locked node's ancestors are locked) are exactly the
    nodes full eviction can reach: `evictable_full_pages()` in O(1).

Full eviction goes in rounds: the candidates present when a round starts leave in LRU
order; a parent that becomes an unlocked leaf waits for the next round, which starts
once the current one is used up. (The first implementation swept the tree once per
round; this keeps its order exactly.)

Every walk is iterative: a cached chain can be far deeper than Python's recursion limit.

Every node also carries the chained block hash of its page in its namespace;
creating a node emits `stored`, removing one `removed`, clearing `cleared`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .block_hash import AllCleared, BlockEvent, BlockRemoved, BlockStored, extend_block_hashes, namespace_seed
from .contract import CacheNode, PrefixCache, PrefixMatch
from .lru_heap import HeapKey, LazyMinHeap
from .pools import KVPools

Match = PrefixMatch  # the name callers used before the contract


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]
    vpage: int
    parent: Node | None
    depth: int  # pages from the root; the node covers positions [(depth-1)*P, depth*P)
    block_hash: int
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    full_lock: int = 0
    swa_lock: int = 0
    swa_tombstone: bool = True
    full_stamp: int = 0
    swa_stamp: int = 0

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def full_key(self) -> HeapKey:
        return (self.full_stamp, self.depth)

    @property
    def swa_key(self) -> HeapKey:
        return (self.swa_stamp, self.depth)


class ShadowRadix(PrefixCache):
    def __init__(self, pools: KVPools, on_event: Callable[[BlockEvent], None] | None = None) -> None:
        self.pools = pools
        self.page_size = pools.layout.page_size
        self._roots: dict[str, Node] = {}
        self._clock = itertools.count(1)
        self._on_event = on_event
        self.num_nodes = 0
        self.num_full_evictions = 0
        self.num_swa_evictions = 0
        self._full_lru: LazyMinHeap[Node] = LazyMinHeap()
        self._swa_lru: LazyMinHeap[Node] = LazyMinHeap()
        self._num_unlocked_nodes = 0
        self._num_live_swa_nodes = 0

    # ------------------------------------------------------------------ lookup
    def root(self, namespace: str) -> Node:
        root = self._roots.get(namespace)
        if root is None:
            root = Node(key=(), vpage=-1, parent=None, depth=0, block_hash=namespace_seed(namespace))
            root.swa_tombstone = False
            self._roots[namespace] = root
        return root

    def match(
        self, namespace: str, token_ids: Sequence[int], max_pages: int, touch: bool = True
    ) -> PrefixMatch:
        path = self._walk(self._roots.get(namespace), token_ids, max_pages)
        num_swa_pages = self._deepest_live_tail(path)
        if touch:
            self._touch(path, num_swa_pages)
        return PrefixMatch(tuple(path), num_swa_pages)

    def _walk(self, node: Node | None, token_ids: Sequence[int], max_pages: int) -> list[Node]:
        path: list[Node] = []
        p = self.page_size
        while node is not None and len(path) < max_pages:
            start = len(path) * p
            child = node.children.get(tuple(token_ids[start : start + p]))
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def _deepest_live_tail(self, path: Sequence[Node]) -> int:
        """The largest k whose tail `path[first_tail_page(k):k]` has no tombstone (0 if none)."""
        live_run = 0  # live nodes ending at the current one
        live_runs: list[int] = []
        for node in path:
            live_run = 0 if node.swa_tombstone else live_run + 1
            live_runs.append(live_run)
        for k in range(len(path), 0, -1):
            if live_runs[k - 1] >= k - self._first_tail_page(k):
                return k
        return 0

    def _touch(self, path: Sequence[Node], num_swa_pages: int) -> None:
        stamp = next(self._clock)
        for node in path:
            node.full_stamp = stamp
            self._refresh_full(node)
        for node in path[self._first_tail_page(num_swa_pages) : num_swa_pages]:
            node.swa_stamp = stamp
            self._refresh_swa(node)

    def _first_tail_page(self, num_pages: int) -> int:
        return self.pools.layout.swa_horizon(num_pages * self.page_size) // self.page_size

    def swa_tail(self, path: Sequence[CacheNode], num_pages: int) -> list[Node]:
        return [self._own(n) for n in path[self._first_tail_page(num_pages) : num_pages]]

    # ------------------------------------------------------------------ locks
    def lock(self, path: Sequence[CacheNode], swa_nodes: Sequence[CacheNode]) -> None:
        nodes = self._checked_path(path)
        on_path = set(nodes)
        swa = [self._own(n) for n in swa_nodes]
        for node in swa:
            assert node in on_path, "swa_lock on a node the same call does not full-lock"
            assert not node.swa_tombstone, "swa_lock on a tombstoned node"
        for node in nodes:
            if node.full_lock == 0:
                self._num_unlocked_nodes -= 1
            node.full_lock += 1
            self._full_lru.discard(node)
        for node in swa:
            node.swa_lock += 1
            self._swa_lru.discard(node)

    def release_swa(self, node: CacheNode) -> None:
        own = self._own(node)
        assert own.swa_lock > 0, "swa_lock released twice"
        own.swa_lock -= 1
        self._refresh_swa(own)

    def unlock(self, path: Sequence[CacheNode]) -> None:
        nodes = self._checked_path(path)
        for node in nodes:
            assert node.full_lock > 0, "full_lock released twice"
            assert node.full_lock > node.swa_lock, "full lock released before the SWA lock"
        for node in nodes:
            node.full_lock -= 1
            if node.full_lock == 0:
                self._num_unlocked_nodes += 1
                self._refresh_full(node)

    def _own(self, handle: CacheNode) -> Node:
        assert isinstance(handle, Node), f"not a ShadowRadix node: {handle!r}"
        return handle

    def _checked_path(self, path: Sequence[CacheNode]) -> list[Node]:
        """`path` as this tree's nodes, asserting it is a root-anchored chain of live nodes
        (whole-path locking is what keeps `full_lock` from growing towards the leaves)."""
        nodes = [self._own(n) for n in path]
        for i, node in enumerate(nodes):
            parent = node.parent
            assert parent is not None and node.depth == i + 1, "path does not start at a root"
            assert i == 0 or parent is nodes[i - 1], "path is not a chain"
            assert parent.children.get(node.key) is node, "path holds a removed node"
        return nodes

    # ------------------------------------------------------------------ insert
    def insert(
        self, namespace: str, token_ids: Sequence[int], vpages: Sequence[int], num_shared: int
    ) -> list[int]:
        p = self.page_size
        node = self.root(namespace)
        for i in range(num_shared):
            node = node.children[tuple(token_ids[i * p : (i + 1) * p])]
        leftover: list[int] = []
        stamp = next(self._clock)
        for i in range(num_shared, len(token_ids) // p):
            key = tuple(token_ids[i * p : (i + 1) * p])
            vpage = vpages[i]
            child = node.children.get(key)
            if child is None:
                child = self._new_node(node, key, vpage)
            else:
                if child.swa_tombstone and self.pools.has_swa(vpage):
                    self._revive(child, vpage)
                leftover.append(vpage)
            child.full_stamp = child.swa_stamp = stamp
            self._refresh_full(child)
            self._refresh_swa(child)
            node = child
        return leftover

    def _new_node(self, parent: Node, key: tuple[int, ...], vpage: int) -> Node:
        block_hash = extend_block_hashes(parent.block_hash, key, self.page_size)[0]
        node = Node(key=key, vpage=vpage, parent=parent, depth=parent.depth + 1, block_hash=block_hash)
        node.swa_tombstone = not self.pools.has_swa(vpage)
        parent.children[key] = node
        self._full_lru.discard(parent)  # no longer a leaf
        self.num_nodes += 1
        self._num_unlocked_nodes += 1
        if not node.swa_tombstone:
            self._num_live_swa_nodes += 1
        self._emit(BlockStored((block_hash,), "device"))
        return node

    def _revive(self, node: Node, duplicate_vpage: int) -> None:
        self.pools.move_swa(duplicate_vpage, node.vpage)
        node.swa_tombstone = False
        self._num_live_swa_nodes += 1

    # ------------------------------------------------------------------ eviction lists
    def _refresh_full(self, node: Node) -> None:
        """Make the node's full-list entry match its state (candidate: an unlocked leaf)."""
        if node.full_lock == 0 and node.is_leaf:
            self._full_lru.push(node, node.full_key)
        else:
            self._full_lru.discard(node)

    def _refresh_swa(self, node: Node) -> None:
        """Make the node's SWA-list entry match its state (candidate: live and SWA-unlocked)."""
        if not node.swa_tombstone and node.swa_lock == 0:
            self._swa_lru.push(node, node.swa_key)
        else:
            self._swa_lru.discard(node)

    @property
    def num_lru_steps(self) -> int:
        """Heap entries the eviction lists have touched so far (the work eviction does)."""
        return self._full_lru.num_steps + self._swa_lru.num_steps

    # ------------------------------------------------------------------ eviction
    def evictable_full_pages(self) -> int:
        return self._num_unlocked_nodes

    def evictable_swa_pages(self) -> int:
        return len(self._swa_lru)

    def evict_full(self, num_pages: int) -> int:
        freed = 0
        next_round: list[Node] = []
        while freed < num_pages:
            leaf = self._full_lru.pop()
            if leaf is None:
                if not next_round:
                    break
                for node in next_round:
                    self._refresh_full(node)
                next_round = []
                continue
            parent = self._remove(leaf)
            freed += 1
            if parent.parent is not None and parent.full_lock == 0 and parent.is_leaf:
                next_round.append(parent)
        for node in next_round:
            self._refresh_full(node)
        return freed

    def _remove(self, node: Node) -> Node:
        """Drop an unlocked leaf and free its pages; returns its parent."""
        parent = node.parent
        assert parent is not None and node.is_leaf and node.full_lock == 0
        del parent.children[node.key]
        self._full_lru.discard(node)
        self._swa_lru.discard(node)
        self.pools.free_virtual_pages([node.vpage])  # frees an attached SWA page too
        self.num_nodes -= 1
        self._num_unlocked_nodes -= 1
        if not node.swa_tombstone:
            self._num_live_swa_nodes -= 1
        self.num_full_evictions += 1
        self._emit(BlockRemoved((node.block_hash,), "device"))
        return parent

    def evict_swa(self, num_pages: int) -> int:
        freed = 0
        while freed < num_pages:
            node = self._swa_lru.pop()
            if node is None:
                break
            self.pools.detach_swa(node.vpage)
            node.swa_tombstone = True
            self._num_live_swa_nodes -= 1
            self.num_swa_evictions += 1
            freed += 1
        return freed

    def clear(self) -> None:
        self.evict_full(self.num_nodes)
        self._emit(AllCleared())

    # ------------------------------------------------------------------ introspection
    def nodes_by_depth(self) -> list[Node]:
        out: list[Node] = []
        frontier = list(self._roots.values())
        while frontier:
            frontier = [child for node in frontier for child in node.children.values()]
            out += frontier
        return out

    def owned_vpages(self) -> list[int]:
        return [n.vpage for n in self.nodes_by_depth()]

    def stats(self) -> dict[str, int]:
        return {
            "nodes": self.num_nodes,
            "tombstones": self.num_nodes - self._num_live_swa_nodes,
            "swa_pages": self._num_live_swa_nodes,
            "full_evictions": self.num_full_evictions,
            "swa_evictions": self.num_swa_evictions,
        }

    def check_integrity(self) -> None:
        nodes = self.nodes_by_depth()
        self._check_edges_and_pages()
        for node in nodes:
            parent = node.parent
            assert parent is not None
            assert node.full_lock >= node.swa_lock >= 0, "lock counts inconsistent"
            is_root_child = parent.parent is None
            assert is_root_child or parent.full_lock >= node.full_lock, "full lock not on a whole path"
            assert self.pools.has_swa(node.vpage) != node.swa_tombstone, "tombstone flag disagrees with pool"
            assert not (node.swa_tombstone and node.swa_lock), "SWA-locked tombstone"
        self._check_eviction_lists(nodes)

    def _check_edges_and_pages(self) -> None:
        p = self.page_size
        seen: set[int] = set()
        for namespace, root in self._roots.items():
            assert root.full_lock == 0 and root.swa_lock == 0, f"root of {namespace!r} locked"
            stack = [root]
            while stack:
                node = stack.pop()
                for key, child in node.children.items():
                    assert child.parent is node and child.key == key and len(key) == p, "broken edge"
                    assert child.depth == node.depth + 1, "depth out of sync"
                    assert child.vpage not in seen, f"virtual page {child.vpage} owned by two nodes"
                    seen.add(child.vpage)
                    expected = extend_block_hashes(node.block_hash, key, p)[0]
                    assert child.block_hash == expected, "block hash out of chain"
                    stack.append(child)
        assert len(seen) == self.num_nodes, "node count out of sync"

    def _check_eviction_lists(self, nodes: Sequence[Node]) -> None:
        full = {n for n in nodes if n.full_lock == 0 and n.is_leaf}
        swa = {n for n in nodes if not n.swa_tombstone and n.swa_lock == 0}
        assert set(self._full_lru) == full, "full eviction list is not the unlocked leaves"
        assert set(self._swa_lru) == swa, "SWA eviction list is not the live SWA-unlocked nodes"
        assert all(self._full_lru.key_of(n) == n.full_key for n in full), "stale full LRU key"
        assert all(self._swa_lru.key_of(n) == n.swa_key for n in swa), "stale SWA LRU key"
        num_unlocked = sum(1 for n in nodes if n.full_lock == 0)
        num_live_swa = sum(1 for n in nodes if not n.swa_tombstone)
        assert self._num_unlocked_nodes == num_unlocked, "unlocked count out of sync"
        assert self._num_live_swa_nodes == num_live_swa, "SWA count out of sync"
        self._full_lru.check_integrity()
        self._swa_lru.check_integrity()

    def _emit(self, event: BlockEvent) -> None:
        if self._on_event is not None:
            self._on_event(event)
