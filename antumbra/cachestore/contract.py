"""The prefix cache's contract: what the KV manager may ask of it and what it may rely on.

A prefix cache keeps the pages of finished (or preempted) sequences so later requests
that start with the same tokens skip computing them. `ShadowRadix` implements it; the
KV manager (replicas/kv_manager.py) is written against this interface only.

Words used below. A *page* is `P` tokens (the pools' page size). Each cached page is a
*node*, one edge of a tree per namespace, and owns one virtual page (whose compressed
C_m / indexer rows live as long as the node) and, independently, at most one SWA page
(its SWA rows and the compression-state rows inside them). A node with no SWA page is a
*tombstone*. A *path* is a root-anchored prefix: `path[i]` caches logical page `i`,
`path[i]` is the parent of `path[i + 1]`, `path[0]` hangs under a namespace root.
Callers hold nodes as opaque handles (`CacheNode`) and never change them.

Invariants (every implementation's `check_integrity` asserts them):

  1. Namespaces. A node belongs to one namespace; match, insert, lock and eviction of
     one namespace never return, share or create nodes of another. Two tenants share a
     page only if they were given the same namespace string.
  2. Pages. Each node owns exactly one allocated virtual page and no other owner (node
     or running request) holds that page. The cache frees a virtual page only when it
     removes the node, and an SWA page only when it tombstones or removes the node.
  3. Locks. `full_lock` counts running requests whose block table holds the node's page;
     `swa_lock` those that will still read its SWA rows. Always
     `full_lock >= swa_lock >= 0`. Full locks are taken and dropped on whole paths, so
     `full_lock` never grows from parent to child: a node with a locked descendant is
     itself locked, and the unlocked nodes are exactly the ones whose subtree is free.
     SWA locks are taken only on nodes the same `lock` call full-locks.
  4. Tombstones. A node is a tombstone iff it has no SWA page; a tombstone is never
     SWA-locked. Its compressed rows stay and still serve matches that end later, on a
     live tail. Inserting a page whose SWA rows are live over a tombstone revives it.
  5. Match. `match` returns the longest cached page-aligned prefix (`path`) and how many
     of its pages a request may use directly (`num_swa_pages`): the deepest `k` such that
     every node whose SWA / state rows a continuation after `k * P` tokens reads is live.
     `P` is a multiple of every compression rate and at least the window, so a match never
     ends inside a compression window: every compressed row before `k * P` is complete.
  6. Eviction frees only what no running request holds. `evict_full` removes unlocked
     leaves (a parent becomes a candidate once its children are gone) and frees their
     virtual page and any SWA page attached; `evict_swa` tombstones live, SWA-unlocked
     nodes and frees only their SWA pages, never a virtual page. Neither touches a locked
     node's pages. Each frees exactly `min(num_pages, evictable)`, where `evictable` is
     `evictable_full_pages()` / `evictable_swa_pages()` before the call; evicting 0 is a
     no-op. A full eviction leaves `free SWA pages + evictable_swa_pages()` unchanged
     (a removed live node was SWA-evictable and its SWA page is freed with it), so a
     caller can decide whether a need is met before evicting anything.
  7. Order. Both evictions are least-recently-used first, by stamps that a touching
     match or an insert refreshes along its path, parents no younger than children.
     Ties (one stamp covers one path) go to the shallower node, so SWA eviction
     tombstones the part of a prefix far from its end first and keeps the tail a later
     match needs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple, Protocol


class CacheNode(Protocol):
    """A cached page as callers see it (read-only)."""

    @property
    def vpage(self) -> int: ...  # virtual page holding the tokens' compressed rows (and SWA page, if live)

    @property
    def depth(self) -> int: ...  # pages from the root: the node caches positions [(depth-1)*P, depth*P)

    @property
    def block_hash(self) -> int: ...  # chained hash of the page in its namespace (block_hash.py)

    @property
    def full_lock(self) -> int: ...

    @property
    def swa_lock(self) -> int: ...

    @property
    def swa_tombstone(self) -> bool: ...


class PrefixMatch(NamedTuple):
    """Result of a lookup: `path[:num_swa_pages]` can be used directly; the deeper
    `path[num_swa_pages:]` holds compressed rows whose SWA tail is gone (a replay can use them)."""

    path: tuple[CacheNode, ...]
    num_swa_pages: int

    @property
    def num_full_pages(self) -> int:
        return len(self.path)


class PrefixCache(ABC):
    # ------------------------------------------------------------------ lookup
    @abstractmethod
    def match(
        self, namespace: str, token_ids: Sequence[int], max_pages: int, touch: bool = True
    ) -> PrefixMatch:
        """Longest cached page-aligned prefix of `token_ids` in `namespace`, at most `max_pages` pages.

        `touch` refreshes the LRU stamps of what matched (full stamps along the path, SWA
        stamps on the live tail); a peek (`touch=False`) changes nothing."""

    @abstractmethod
    def swa_tail(self, path: Sequence[CacheNode], num_pages: int) -> Sequence[CacheNode]:
        """The nodes of `path[:num_pages]` whose SWA rows a request continuing after them reads."""

    # ------------------------------------------------------------------ locks
    @abstractmethod
    def lock(self, path: Sequence[CacheNode], swa_nodes: Sequence[CacheNode]) -> None:
        """One running request takes a full lock on every node of the path (root-anchored) and an
        SWA lock on each of `swa_nodes`, which must be live nodes of that path."""

    @abstractmethod
    def unlock(self, path: Sequence[CacheNode]) -> None:
        """Drop one full lock on every node of the path (root-anchored), after the SWA locks on it."""

    @abstractmethod
    def release_swa(self, node: CacheNode) -> None:
        """Drop one SWA lock; the node keeps its SWA page and becomes SWA-evictable at zero."""

    # ------------------------------------------------------------------ insert
    @abstractmethod
    def insert(
        self, namespace: str, token_ids: Sequence[int], vpages: Sequence[int], num_shared: int
    ) -> list[int]:
        """Cache the full pages of a sequence's computed tokens.

        `vpages[i]` holds logical page `i`; pages below `num_shared` are the nodes of the
        caller's locked path. The cache adopts each page it did not have (and its SWA page,
        if attached); returns the caller's pages it did not adopt (duplicates), for the
        caller to free. A duplicate's live SWA page revives a tombstone it duplicates.
        The caller's locks are unchanged."""

    # ------------------------------------------------------------------ eviction
    @abstractmethod
    def evictable_full_pages(self) -> int:
        """Virtual pages `evict_full` could free now (unlocked nodes); O(1)."""

    @abstractmethod
    def evictable_swa_pages(self) -> int:
        """SWA pages `evict_swa` could free now (live, SWA-unlocked nodes); O(1)."""

    @abstractmethod
    def evict_full(self, num_pages: int) -> int:
        """Remove up to `num_pages` unlocked nodes, LRU leaves first; returns virtual pages freed."""

    @abstractmethod
    def evict_swa(self, num_pages: int) -> int:
        """Tombstone up to `num_pages` live, SWA-unlocked nodes, LRU first; returns SWA pages freed."""

    @abstractmethod
    def clear(self) -> None:
        """Remove every unlocked node (locked paths stay for their running requests)."""

    # ------------------------------------------------------------------ introspection
    @abstractmethod
    def nodes_by_depth(self) -> Sequence[CacheNode]:
        """Every cached node, parents before children."""

    @abstractmethod
    def owned_vpages(self) -> list[int]:
        """Virtual pages the cache owns (one per node)."""

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Gauges and counters: `nodes`, `tombstones`, `swa_pages`, `full_evictions`, `swa_evictions`."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Assert the invariants above (and the implementation's own bookkeeping)."""

    def _nodes(self) -> Sequence[CacheNode]:
        """Older name of `nodes_by_depth`, kept for callers written before it."""
        return self.nodes_by_depth()
