"""The eviction order of the first ShadowRadix, which swept the whole tree on every call.

Kept as the reference the heap-based eviction lists must reproduce exactly: the same
nodes, in the same order, for any tree and any request size. It reads the tree's
internals and never changes it (it simulates the removals).
"""

from __future__ import annotations

from antumbra.cachestore.block_hash import BlockEvent, BlockRemoved
from antumbra.cachestore.shadow_radix import Node, ShadowRadix


def sweep_order(tree: ShadowRadix) -> list[Node]:
    """Every node in the order the sweep listed them (ties in a stable sort keep it)."""
    out: list[Node] = []
    stack = list(tree._roots.values())
    while stack:
        node = stack.pop()
        for child in node.children.values():
            out.append(child)
            stack.append(child)
    return out


def full_eviction_order(tree: ShadowRadix, num_pages: int) -> list[int]:
    """Virtual pages `evict_full(num_pages)` frees, in order: rounds of the unlocked leaves
    present when the round starts, each round sorted by full stamp."""
    nodes = sweep_order(tree)
    num_children = {n: len(n.children) for n in nodes}
    removed: set[Node] = set()
    order: list[int] = []
    while len(order) < num_pages:
        leaves = [n for n in nodes if n not in removed and num_children[n] == 0 and n.full_lock == 0]
        if not leaves:
            break
        leaves.sort(key=lambda n: n.full_stamp)
        for leaf in leaves[: num_pages - len(order)]:
            removed.add(leaf)
            order.append(leaf.vpage)
            if leaf.parent in num_children:
                num_children[leaf.parent] -= 1
    return order


def swa_eviction_order(tree: ShadowRadix, num_pages: int) -> list[int]:
    """Virtual pages whose SWA page `evict_swa(num_pages)` frees, in order."""
    live = [n for n in sweep_order(tree) if not n.swa_tombstone and n.swa_lock == 0]
    live.sort(key=lambda n: n.swa_stamp)
    return [n.vpage for n in live[:num_pages]]


def removed_hashes(events: list[BlockEvent]) -> list[int]:
    return [h for e in events if isinstance(e, BlockRemoved) for h in e.hashes]


class CheckedEvictions:
    """Runs a tree's evictions and asserts each freed exactly what the sweep would have, in order.

    Pass `record` as the tree's `on_event`: removals are read back from the events it announces.
    """

    def __init__(self) -> None:
        self.events: list[BlockEvent] = []

    def record(self, event: BlockEvent) -> None:
        self.events.append(event)

    def evict_full(self, tree: ShadowRadix, num_pages: int) -> list[int]:
        expected = full_eviction_order(tree, num_pages)
        vpage_of_hash = {n.block_hash: n.vpage for n in tree.nodes_by_depth()}
        start = len(self.events)
        assert tree.evict_full(num_pages) == len(expected)
        removed = [vpage_of_hash[h] for h in removed_hashes(self.events[start:])]
        assert removed == expected, "full eviction order differs from the sweep's"
        return removed

    def evict_swa(self, tree: ShadowRadix, num_pages: int) -> list[int]:
        expected = swa_eviction_order(tree, num_pages)
        live_before = {n.vpage for n in tree.nodes_by_depth() if not n.swa_tombstone}
        assert tree.evict_swa(num_pages) == len(expected)
        live_after = {n.vpage for n in tree.nodes_by_depth() if not n.swa_tombstone}
        assert live_before - live_after == set(expected), "SWA eviction chose other nodes than the sweep"
        return expected
