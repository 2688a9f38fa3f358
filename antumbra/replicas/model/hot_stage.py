"""HiSparse in the general step: the C4 rows a step's CSA attention reads, staged on the device.

With HiSparse a CSA layer's compressed rows live on the host tier (`cachestore/hisparse.py`). The
queries of a prefill chunk together select most of their sequence's rows, far more than a hot buffer
holds, so a general step does not page rows in query by query: per CSA layer it fills one device
*stage* and the attention reads the stage as it would read a device pool, through slots:

    [0, num_host)     the long chunks' entries closed before this step: one gather from the host tier
                      (through its device mapping on a GPU) for the whole step and layer
    [num_host, N)     the entries this step's windows close: copied from the compressor's output on
                      the device (their write to the host tier runs beside, on the writer's stream)
    N                 a zeroed scratch slot (where events of short chunks land; masked keys may read it)
    N+1 ...           the rows each short chunk's queries picked: a decode's through its hot buffer
                      (LRU across steps, `HotBuffers.gather`), a chunk of 2 to 31 tokens read from
                      the host tier directly

A long chunk (at least LONG_SPAN_TOKENS) stages every entry its last token reads, which covers what
any of its queries may pick. Which rows those are follows from host facts (each chunk's start, stop
and replay point), so building the stage reads nothing back from the device; only the short chunks'
page-ins do (their host-side LRU maps, as in a decode step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from antumbra.cachestore.host_tier import wide_rows
from antumbra.cachestore.pools import KVPools


@dataclass(frozen=True)
class StagePlan:
    """Which pool rows a step stages for its long chunks (the same for every CSA layer)."""

    rows: torch.Tensor  # [N] int64 pool rows: the entries read from the host tier first, then the fresh ones
    num_host: int  # host-side: rows[:num_host] are read from the host tier
    slot_of_row: torch.Tensor  # [R] int64 stage slot of each pool row; N (the scratch slot) if not staged


@dataclass(frozen=True)
class LongChunk:
    """Host facts of one long chunk: its last token's row, the entries that token reads, and how many
    of them were closed before the step (the rest close in it)."""

    last_row: int
    num_entries: int
    num_closed: int


def plan_stage(entry_rows: torch.Tensor, chunks: list[LongChunk], num_pool_rows: int) -> StagePlan:
    """entry_rows: [T, C] int64 pool row of entry w of each token's sequence (CompressedIndex)."""
    closed = [entry_rows[c.last_row, : c.num_closed] for c in chunks]
    fresh = [entry_rows[c.last_row, c.num_closed : c.num_entries] for c in chunks]
    rows = torch.cat(closed + fresh)
    n = sum(c.num_entries for c in chunks)
    slot_of_row = torch.full((num_pool_rows,), n, dtype=torch.long, device=entry_rows.device)
    # Rows two chunks share (a cached prefix) get either slot: both hold the row as the host tier has it.
    slot_of_row.index_copy_(0, rows, torch.arange(n, device=entry_rows.device))
    return StagePlan(rows, sum(c.num_closed for c in chunks), slot_of_row)


def stage_rows(
    layer: int, pools: KVPools, plan: StagePlan | None, spans: tuple[tuple[int, int], ...],
    hot_buffers: tuple[int, ...], short_rows: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor,
    fresh: torch.Tensor | None, event_rows: torch.Tensor, long_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stage of CSA layer `layer` -> (stage [S, width] rows of the pool's format, slots [T, k] of
    each query's picked rows in it).

    rows, valid: [T, k] the indexer's picks (pool rows); short_rows: [S'] int64 rows of T in chunks
    shorter than `long_tokens`, in span order; fresh: [E, width] the rows this step's windows closed
    (`WindowCompressor.compress`), event_rows: [E] their pool rows."""
    pool, hot = pools.compressors[layer], pools.hot
    assert hot is not None
    width, k = pool.row_format.width, rows.shape[1]
    num_long = 0 if plan is None else int(plan.rows.shape[0])
    picked = []
    for (row0, row1), buffer in zip(spans, hot_buffers, strict=True):
        if not 0 < row1 - row0 < long_tokens or k == 0:
            continue
        pool.order_reads()  # this step's new rows are in the host tier before a short chunk reads it
        if row1 - row0 == 1:
            slots = hot.gather(layer, buffer, torch.where(valid[row0:row1], rows[row0:row1], -1),
                               pool.device_rows)
            picked.append(hot.rows[layer][slots])
        else:  # several tokens may pick more rows together than a buffer holds
            picked.append(pool.device_rows[rows[row0:row1].to(pool.device_rows.device)].to(rows.device))
    num_picked = sum(p.shape[0] for p in picked) * k
    stage = torch.empty(num_long + 1 + num_picked, width, dtype=pool.rows.dtype, device=rows.device)
    stage[num_long].zero_()
    if plan is None:
        slots = torch.full_like(rows, num_long)
    else:
        if plan.num_host:
            torch.index_select(wide_rows(pool.device_rows), 0, plan.rows[: plan.num_host],
                               out=wide_rows(stage[: plan.num_host]))
        if fresh is not None:
            stage.index_copy_(0, plan.slot_of_row[event_rows], fresh)
        slots = plan.slot_of_row[rows]
    if picked:
        stage[num_long + 1 :] = torch.cat(picked).view(num_picked, width)
        slots[short_rows] = num_long + 1 + torch.arange(num_picked, device=rows.device).view(-1, k)
    return stage, slots
