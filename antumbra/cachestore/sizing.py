"""Pool capacity from a device memory budget, counting exactly what `KVPools` allocates."""

from __future__ import annotations

from dataclasses import replace

import torch

from antumbra.config import CacheConfig, ModelConfig

from .hisparse import HotBuffers
from .pools import KVPools, PoolLayout
from .row_format import RowFormat


def hot_buffers_for(
    model: ModelConfig, cache: CacheConfig, max_seqs: int, kv_format: RowFormat, device
) -> HotBuffers | None:
    if not cache.hisparse_rows_per_request:
        return None
    if cache.hisparse_rows_per_request < model.index_topk:
        raise ValueError(
            f"hisparse_rows_per_request ({cache.hisparse_rows_per_request}) must hold one decode step's "
            f"top-{model.index_topk} selection"
        )
    csa_layers = tuple(s.layer for s in PoolLayout.build(model, cache, 1).indexers)
    return HotBuffers(csa_layers, kv_format, cache.hisparse_rows_per_request, max_seqs, device)


def pool_device_bytes(
    model: ModelConfig,
    cache: CacheConfig,
    num_swa_pages: int,
    max_seqs: int,
    dtype: torch.dtype,
    num_pages: int,
    formats: tuple[RowFormat, RowFormat] | None = None,
) -> int:
    """Device bytes `KVPools` would hold with `num_pages` virtual pages (measured on the meta device);
    `formats`: (KV rows, indexer keys), None for the model dtype."""
    meta = torch.device("meta")
    sized = replace(cache, num_virtual_tokens=num_pages * model.page_size, device_budget_bytes=None)
    layout = PoolLayout.build(model, sized, num_swa_pages)
    kv_format, index_format = formats or (
        RowFormat.plain(model.head_dim, dtype),
        RowFormat.plain(model.index_head_dim, dtype),
    )
    hot = hot_buffers_for(model, cache, max_seqs, kv_format, meta)
    return KVPools(layout, dtype, meta, hot, kv_format, index_format).device_bytes()


def virtual_tokens_for_budget(
    model: ModelConfig,
    cache: CacheConfig,
    num_swa_pages: int,
    max_seqs: int,
    dtype: torch.dtype,
    formats: tuple[RowFormat, RowFormat] | None = None,
) -> int:
    """The most virtual tokens whose device-resident pools fit `cache.device_budget_bytes`.

    Fixed costs (SWA rows, compression state, hot buffers) come first; each page
    then adds its device-resident compressed rows (all of them, or, with HiSparse,
    all but the CSA rows that live on the host tier), in the rows' stored format.
    """
    assert cache.device_budget_bytes is not None
    fixed = pool_device_bytes(model, cache, num_swa_pages, max_seqs, dtype, 0, formats)
    per_page = pool_device_bytes(model, cache, num_swa_pages, max_seqs, dtype, 1, formats) - fixed
    pages = (cache.device_budget_bytes - fixed) // max(per_page, 1)
    if pages < 1:
        raise ValueError(
            f"device budget of {cache.device_budget_bytes} bytes is below the fixed {fixed} bytes "
            "of SWA and state rows"
        )
    return int(pages) * model.page_size
