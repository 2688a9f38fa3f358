"""LazyMinHeap: re-keying, discarding and popping with stale entries, and its bounded size."""

from __future__ import annotations

from antumbra.cachestore.lru_heap import LazyMinHeap


def drain(heap: LazyMinHeap[str]) -> list[str]:
    out = []
    while (item := heap.pop()) is not None:
        heap.check_integrity()
        out.append(item)
    return out


def test_pops_in_key_order_and_a_re_keyed_item_only_under_its_new_key():
    heap: LazyMinHeap[str] = LazyMinHeap()
    for item, key in (("c", (3, 0)), ("a", (1, 0)), ("b", (2, 0)), ("a2", (1, 1))):
        heap.push(item, key)
        heap.check_integrity()
    heap.push("a", (5, 0))  # re-key: the (1, 0) entry goes stale
    heap.discard("b")
    heap.discard("never-pushed")
    heap.check_integrity()
    assert len(heap) == 3 and "b" not in heap and heap.key_of("a") == (5, 0)
    assert drain(heap) == ["a2", "c", "a"]
    assert heap.pop() is None and len(heap) == 0


def test_equal_keys_pop_in_push_order_and_pushing_the_same_key_again_is_free():
    heap: LazyMinHeap[str] = LazyMinHeap()
    heap.push("x", (1, 1))
    heap.push("y", (1, 1))
    steps = heap.num_steps
    heap.push("x", (1, 1))
    assert heap.num_steps == steps and len(heap._heap) == 2
    assert drain(heap) == ["x", "y"]


def test_stale_entries_are_compacted_so_the_heap_stays_proportional_to_its_live_items():
    heap: LazyMinHeap[int] = LazyMinHeap()
    for item in range(10):
        heap.push(item, (item, 0))
    for stamp in range(1, 1000):
        heap.push(stamp % 10, (stamp, 0))  # one item re-keyed each time
        assert len(heap._heap) <= 2 * len(heap) + 32
    heap.check_integrity()
    before = heap.num_steps
    assert drain(heap) == list(range(10))  # item i was last re-keyed to stamp 990 + i
    assert heap.num_steps - before <= 2 * 10 + 32
