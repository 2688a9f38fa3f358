"""The gauges and counters an engine exports (what the platform's metrics and autoscalers read)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .core import EngineCore


def core_stats(core: EngineCore) -> dict[str, float]:
    """Pool use per pool, cache and scheduler counters; read with the core quiet (under its lock)."""
    usage = core.pools.usage()
    counters = core.kv.counters
    tree = core.kv.tree.stats() if core.kv.tree is not None else {}
    prompt = max(counters.num_prompt_tokens, 1)
    hot = core.pools.hot
    return {
        "num_running": float(len(core.scheduler.running)),
        "num_waiting": float(len(core.scheduler.waiting)),
        "num_held": float(len(core.scheduler.held)),  # reserved for a KV adoption (PD decode side)
        "running_tokens": float(sum(r.num_tokens for r in core.scheduler.running)),
        "pool_use_virtual": usage["virtual"],
        "pool_use_swa": usage["swa"],
        "num_steps": float(core.num_steps),
        "num_generated_tokens": float(core.num_generated_tokens),
        "num_failed_requests": float(core.num_failed_requests),
        "prompt_tokens": float(counters.num_prompt_tokens),
        "cached_tokens": float(counters.num_cached_tokens),
        "hit_rate": counters.num_cached_tokens / prompt,
        "computed_prompt_tokens": float(counters.num_computed_prompt_tokens),
        "replays": float(counters.num_replays),
        "replayed_tokens": float(counters.num_replayed_tokens),
        "preemptions": float(counters.num_preemptions),
        "cache_nodes": float(tree.get("nodes", 0)),
        "tombstones": float(tree.get("tombstones", 0)),
        "full_evictions": float(tree.get("full_evictions", 0)),
        "swa_evictions": float(tree.get("swa_evictions", 0)),
        "host_tier_hits": float(hot.counters.hits if hot else 0),
        "host_tier_misses": float(hot.counters.misses if hot else 0),
        # Rows copied host -> hot buffer by both paths (the fixed-shape step copies every selected row).
        "host_tier_rows_copied": float(hot.rows_copied() if hot else 0),
        "hot_buffer_device_bytes": float(hot.device_bytes() if hot else 0),
        "pool_device_bytes": float(core.pools.device_bytes()),
        **held_by_requests(core),
        **{f"kv_{name}": float(value) for name, value in vars(core.transfers).items()},
    }


def held_by_requests(core: EngineCore) -> dict[str, float]:
    """What requests hold beyond the prefix cache: all 0 once every request has left the engine.

    `request_vpages` are virtual pages owned by requests (allocated, not tree nodes),
    `request_swa_pages` SWA pages attached to those, `locked_cache_pages` tree nodes some
    request shares (full lock), `hot_buffers` HiSparse device buffers taken. Pool use itself
    stays above its empty value while the cache keeps pages; these say whether requests leaked.
    """
    pools, tree = core.pools, core.kv.tree
    layout = pools.layout
    used_vpages = layout.num_virtual_pages - pools.num_free_virtual_pages
    used_swa = layout.num_swa_pages - pools.num_free_swa_pages
    tree_stats = tree.stats() if tree is not None else {}
    tree_nodes, tree_swa = tree_stats.get("nodes", 0), tree_stats.get("swa_pages", 0)
    evictable = tree.evictable_full_pages() if tree is not None else 0
    hot = pools.hot
    return {
        "request_vpages": float(used_vpages - tree_nodes),
        "request_swa_pages": float(used_swa - tree_swa),
        "locked_cache_pages": float(tree_nodes - evictable),
        "hot_buffers": float(hot.max_requests - hot.num_free if hot is not None else 0),
    }
