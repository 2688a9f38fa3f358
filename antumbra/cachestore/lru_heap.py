"""A min-heap of items whose keys change: O(log n) push / re-key / pop, O(1) discard.

The cache's eviction lists are heaps of tree nodes keyed by (LRU stamp, depth). A node's
key changes on every match that touches it, and a node leaves a list when it is locked,
gains a child or is removed; finding and fixing its entry in place would cost O(n), so
entries are deleted lazily instead:

  * every push of an item gets a fresh sequence number, recorded as the item's *live*
    entry; older entries of the same item stay in the heap as *stale* ones;
  * `discard` forgets the live entry (O(1)); `pop` skips stale entries;
  * when stale entries outnumber live ones (plus a slack), the heap is rebuilt from the
    live entries alone, so its size stays O(live) and each stale entry is paid for once
    by the operation that created it (amortised O(1) extra per operation).

`num_steps` counts heap entries touched (pushed, popped -- stale ones too -- or rebuilt):
the work the heap did, for tests that check eviction cost does not grow with the cache.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

Item = TypeVar("Item", bound=Hashable)
HeapKey = tuple[int, int]

# Stale entries a heap tolerates beyond its live ones before it is rebuilt.
_STALE_SLACK = 32


class LazyMinHeap(Generic[Item]):
    def __init__(self) -> None:
        self._heap: list[tuple[HeapKey, int, Item]] = []
        self._live: dict[Item, tuple[HeapKey, int]] = {}  # item -> (key, sequence number) of its live entry
        self._sequence = itertools.count()
        self.num_steps = 0

    def __len__(self) -> int:
        """Live items (each counted once, however many stale entries it left)."""
        return len(self._live)

    def __contains__(self, item: Item) -> bool:
        return item in self._live

    def __iter__(self) -> Iterator[Item]:
        return iter(self._live)

    def key_of(self, item: Item) -> HeapKey:
        return self._live[item][0]

    def push(self, item: Item, key: HeapKey) -> None:
        """Add `item` under `key`, or move it there if it is already in (its old entry goes stale)."""
        live = self._live.get(item)
        if live is not None and live[0] == key:
            return
        sequence = next(self._sequence)
        self._live[item] = (key, sequence)
        heapq.heappush(self._heap, (key, sequence, item))
        self.num_steps += 1
        self._maybe_compact()

    def discard(self, item: Item) -> None:
        """Remove `item` if it is in; its entry goes stale."""
        self._live.pop(item, None)

    def pop(self) -> Item | None:
        """Remove and return the item with the smallest key (ties: the one pushed first); None if empty."""
        while self._heap:
            key, sequence, item = heapq.heappop(self._heap)
            self.num_steps += 1
            if self._live.get(item) == (key, sequence):
                del self._live[item]
                return item
        return None

    def _maybe_compact(self) -> None:
        if len(self._heap) <= 2 * len(self._live) + _STALE_SLACK:
            return
        self._heap = [(key, sequence, item) for item, (key, sequence) in self._live.items()]
        heapq.heapify(self._heap)
        self.num_steps += len(self._heap)

    def check_integrity(self) -> None:
        live_entries = {(key, seq) for key, seq, item in self._heap if self._live.get(item) == (key, seq)}
        assert len(live_entries) == len(self._live), "a live item has no entry in the heap"
