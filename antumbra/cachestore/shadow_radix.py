"""ShadowRadix: one prefix tree over virtual token slots, projected into decoupled pools.

The tree is keyed by token ids, one page (`P` tokens) per edge, under one root per
cache namespace. Each node owns one virtual page; the page's *shadows* are its rows
in every pool: C_m rows (`slot // m`, live as long as the node), and SWA rows plus the
compression-state rows inside them (attached or not, independently).

Node state and rules:
  * `full_lock`  — running requests whose block tables reference the node's page;
                   a locked node is never removed.
  * `swa_lock`   — running requests that will still read the node's SWA rows;
                   invariant: full_lock >= swa_lock >= 0.
  * `swa_tombstone` — the SWA page was detached (or never kept); invariant: a
                   tombstoned node holds no SWA page and has swa_lock == 0. Its
                   compressed rows stay and keep serving matches that end later.
  * two LRU stamps: `full_stamp` orders full eviction, `swa_stamp` SWA eviction;
    a match refreshes both along its path (parents are touched before children,
    so a parent is never younger than its child).

  * Match: walk the longest page-aligned path (`full` depth K). The match used
    directly is the deepest k <= K whose SWA tail is live: every node covering
    positions [swa_horizon(k*P), k*P) is not tombstoned (the window the next token
    reads, and the previous compression window an overlapping compressor reads).
  * SWA eviction: detach the SWA page of the LRU unlocked live node, tombstone it.
  * Full eviction: remove the LRU unlocked leaf, free its page; a parent that
    becomes an unlocked leaf is a candidate in turn.
  * Insert: a finished (or preempted) request's computed pages join the tree;
    pages already present are freed as duplicates, except that a duplicate with
    a live SWA page revives a tombstoned node by moving that SWA page over.

Every node also carries the chained block hash of its page in its namespace;
creating a node emits `stored`, removing one `removed`, clearing `cleared`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .block_hash import AllCleared, BlockEvent, BlockRemoved, BlockStored, extend_block_hashes, namespace_seed
from .pools import KVPools


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


@dataclass(frozen=True)
class Match:
    """Result of a lookup: `path[:num_swa_pages]` can be used directly; the deeper
    `path[num_swa_pages:]` holds compressed rows whose SWA tail is gone."""

    path: tuple[Node, ...]
    num_swa_pages: int

    @property
    def num_full_pages(self) -> int:
        return len(self.path)


class ShadowRadix:
    def __init__(self, pools: KVPools, on_event: Callable[[BlockEvent], None] | None = None) -> None:
        self.pools = pools
        self.page_size = pools.layout.page_size
        self._roots: dict[str, Node] = {}
        self._clock = itertools.count(1)
        self._on_event = on_event
        self.num_nodes = 0
        self.num_full_evictions = 0
        self.num_swa_evictions = 0

    # ------------------------------------------------------------------ lookup
    def root(self, namespace: str) -> Node:
        root = self._roots.get(namespace)
        if root is None:
            root = Node(key=(), vpage=-1, parent=None, depth=0, block_hash=namespace_seed(namespace))
            root.swa_tombstone = False
            self._roots[namespace] = root
        return root

    def match(self, namespace: str, token_ids: Sequence[int], max_pages: int, touch: bool = True) -> Match:
        """Longest cached page-aligned prefix of `token_ids`, at most `max_pages` pages.

        `touch` refreshes the LRU stamps of what matched; a peek (touch=False) does not.
        """
        node = self._roots.get(namespace)
        path: list[Node] = []
        p = self.page_size
        while node is not None and len(path) < max_pages:
            start = len(path) * p
            child = node.children.get(tuple(token_ids[start : start + p]))
            if child is None:
                break
            path.append(child)
            node = child
        num_swa = 0
        for k in range(len(path), 0, -1):
            if self._swa_tail_live(path, k):
                num_swa = k
                break
        if touch:
            stamp = next(self._clock)
            for n in path:
                n.full_stamp = stamp
            for n in path[self._first_tail_page(num_swa) : num_swa]:
                n.swa_stamp = stamp
        return Match(tuple(path), num_swa)

    def _first_tail_page(self, num_pages: int) -> int:
        return self.pools.layout.swa_horizon(num_pages * self.page_size) // self.page_size

    def _swa_tail_live(self, path: Sequence[Node], num_pages: int) -> bool:
        return all(not n.swa_tombstone for n in path[self._first_tail_page(num_pages) : num_pages])

    def swa_tail(self, path: Sequence[Node], num_pages: int) -> list[Node]:
        """The nodes whose SWA rows a request continuing after `num_pages` pages still reads."""
        return list(path[self._first_tail_page(num_pages) : num_pages])

    # ------------------------------------------------------------------ locks
    def lock(self, path: Sequence[Node], swa_nodes: Sequence[Node]) -> None:
        for n in path:
            n.full_lock += 1
        for n in swa_nodes:
            assert not n.swa_tombstone, "swa_lock on a tombstoned node"
            n.swa_lock += 1

    def release_swa(self, node: Node) -> None:
        assert node.swa_lock > 0, "swa_lock released twice"
        node.swa_lock -= 1

    def unlock(self, path: Sequence[Node]) -> None:
        for n in path:
            assert n.full_lock > 0, "full_lock released twice"
            n.full_lock -= 1
            assert n.full_lock >= n.swa_lock, "full lock released before the SWA lock"

    # ------------------------------------------------------------------ insert
    def insert(self, namespace: str, token_ids: Sequence[int], vpages: Sequence[int], num_shared: int) -> list[int]:
        """Add the full pages of a request's computed tokens.

        `vpages[i]` is the block table entry of logical page i; pages below
        `num_shared` are already tree nodes (they came from a match). Returns the
        request's own pages that were not adopted (duplicates), for the caller to free.
        The caller releases its locks on the shared path separately.
        """
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
                    self.pools.move_swa(vpage, child.vpage)
                    child.swa_tombstone = False
                leftover.append(vpage)
            child.full_stamp = child.swa_stamp = stamp
            node = child
        return leftover

    def _new_node(self, parent: Node, key: tuple[int, ...], vpage: int) -> Node:
        block_hash = extend_block_hashes(parent.block_hash, key, self.page_size)[0]
        node = Node(key=key, vpage=vpage, parent=parent, depth=parent.depth + 1, block_hash=block_hash)
        node.swa_tombstone = not self.pools.has_swa(vpage)
        parent.children[key] = node
        self.num_nodes += 1
        self._emit(BlockStored((block_hash,), "device"))
        return node

    # ------------------------------------------------------------------ eviction
    def evictable_full_pages(self) -> int:
        """Pages full eviction could free now: nodes with no locked node in their subtree."""
        return sum(self._count_evictable(root)[0] for root in self._roots.values())

    def _count_evictable(self, node: Node) -> tuple[int, bool]:
        """-> (evictable nodes in the subtree below and at `node`, whether the subtree holds a lock)."""
        total, locked = 0, node.full_lock > 0
        for child in node.children.values():
            count, child_locked = self._count_evictable(child)
            total += count
            locked = locked or child_locked
        if node.parent is not None and not locked:
            total += 1
        return total, locked

    def evictable_swa_pages(self) -> int:
        return sum(1 for n in self._nodes() if not n.swa_tombstone and n.swa_lock == 0)

    def evict_full(self, num_pages: int) -> int:
        """Remove up to `num_pages` unlocked nodes, leaves first in LRU order; returns pages freed."""
        freed = 0
        while freed < num_pages:
            leaves = [n for n in self._nodes() if n.is_leaf and n.full_lock == 0]
            if not leaves:
                break
            leaves.sort(key=lambda n: n.full_stamp)
            for leaf in leaves:
                if freed >= num_pages:
                    break
                self._remove(leaf)
                freed += 1
        return freed

    def _remove(self, node: Node) -> None:
        assert node.parent is not None and node.is_leaf and node.full_lock == 0
        del node.parent.children[node.key]
        self.pools.free_virtual_pages([node.vpage])
        self.num_nodes -= 1
        self.num_full_evictions += 1
        self._emit(BlockRemoved((node.block_hash,), "device"))

    def evict_swa(self, num_pages: int) -> int:
        """Tombstone up to `num_pages` live, SWA-unlocked nodes in LRU order; returns pages freed."""
        live = [n for n in self._nodes() if not n.swa_tombstone and n.swa_lock == 0]
        live.sort(key=lambda n: n.swa_stamp)
        for node in live[:num_pages]:
            self.pools.detach_swa(node.vpage)
            node.swa_tombstone = True
            self.num_swa_evictions += 1
        return min(num_pages, len(live))

    def clear(self) -> None:
        """Drop every unlocked node (locked paths stay for their running requests)."""
        self.evict_full(self.num_nodes)
        self._emit(AllCleared())

    # ------------------------------------------------------------------ introspection
    def _nodes(self) -> list[Node]:
        out: list[Node] = []
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            for child in node.children.values():
                out.append(child)
                stack.append(child)
        return out

    def owned_vpages(self) -> list[int]:
        return [n.vpage for n in self._nodes()]

    def stats(self) -> dict[str, int]:
        nodes = self._nodes()
        return {
            "nodes": len(nodes),
            "tombstones": sum(1 for n in nodes if n.swa_tombstone),
            "swa_pages": sum(1 for n in nodes if not n.swa_tombstone),
            "full_evictions": self.num_full_evictions,
            "swa_evictions": self.num_swa_evictions,
        }

    def check_integrity(self) -> None:
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
                    assert child.full_lock >= child.swa_lock >= 0, "lock counts inconsistent"
                    has_swa = self.pools.has_swa(child.vpage)
                    assert has_swa != child.swa_tombstone, "tombstone flag disagrees with the SWA pool"
                    if child.swa_tombstone:
                        assert child.swa_lock == 0, "SWA-locked tombstone"
                    expected = extend_block_hashes(node.block_hash, key, p)[0]
                    assert child.block_hash == expected, "block hash out of chain"
                    stack.append(child)
        assert len(seen) == self.num_nodes, "node count out of sync"

    def _emit(self, event: BlockEvent) -> None:
        if self._on_event is not None:
            self._on_event(event)
