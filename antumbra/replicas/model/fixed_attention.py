"""Attention's fixed-shape implementation: the part of a layer that reads a device-built `DecodeIndex`.

`Attention.forward` projects, rotates and stores the new key for every step; for a fixed-shape
decode step it then comes here: close this token's windows through the fused compressor, pick the
CSA layers' top-k rows with the indexer kernels, page them in from the HiSparse host tier, and attend
in one hybrid-attention launch. Every size is fixed and nothing waits for the host, so a CUDA graph
holds the step.

With HiSparse (`pools.hot`), the CSA layers' main rows live on the host tier: each CSA layer's
top-k rows are paged into the row's hot buffer on the device (`kernels/hot_gather`, on the side
stream with the indexer when there is one) and the attention reads the buffer through the
returned slots; the compressor writes closed windows through to the host tier.
"""

from __future__ import annotations

import torch

from antumbra.cachestore.pools import CompressorPool, KVPools
from antumbra.config import CSA, SLIDING
from antumbra.kernels.hot_gather import gather_rows
from antumbra.kernels.hybrid_attention.triton import hybrid_attention_decode
from antumbra.kernels.rope.triton import rope as rotate

from .compressor import Compressor, Indexer, WindowCompressor
from .decode_index import DecodeIndex, RateIndex
from .kv_rows import fp4_keys, fp8_rows


def attend(
    kind: str, layer: int, rope_dim: int, comp: Compressor | None, sinks: torch.Tensor, q: torch.Tensor,
    x: torch.Tensor,
    q_in: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], index: DecodeIndex, pools: KVPools,
    forked: torch.Tensor | None = None, side: torch.cuda.Stream | None = None,
) -> torch.Tensor:
    """q: [B, H, d] rotated queries, x: [B, D] the normed block input, q_in: q_b's input; the new
    key is stored. -> [B, H, d] the attention output (still rotated). forked: the indexer's rows,
    started on `side` by `fork_indexer`."""
    swa = pools.swa_kv[layer]
    extra_pool = extra_rows = None
    if kind != SLIDING:
        assert comp is not None
        ridx = index.rates[comp.rate]
        pool = pools.compressors[layer]
        compress(comp, x, index.new_swa_rows, ridx, pool)
        extra_pool = pool.rows
        if kind == CSA:
            if forked is not None and side is not None:
                torch.cuda.current_stream(forked.device).wait_stream(side)
                rows = forked
            else:
                rows = select(comp.indexer, x, q_in, cos_sin, index, pools.indexers[layer])
            extra_rows = _page_in(layer, rows, pools, index.hot_base)
            if pools.hot is not None:
                extra_pool = pools.hot.rows[layer]  # extra_rows are slots of the hot buffers
        else:
            extra_rows = ridx.entry_rows
    coded = fp8_rows(pools.kv_format, rope_dim)  # None: plain rows
    return hybrid_attention_decode(q, swa, index.window_rows, extra_pool, extra_rows, sinks.float(),
                                   fp8_rows=coded)


def fork_indexer(
    comp: Compressor, layer: int, x: torch.Tensor, q_in: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor], index: DecodeIndex, pools: KVPools, side: torch.cuda.Stream,
) -> torch.Tensor:
    """Start the indexer on `side` once its inputs exist; it touches only the indexer pool and
    its own outputs, so it may run beside the main stream until `attend` joins it. HiSparse's
    page-in stays on the main stream, after the join: it reads the main pool, into which the main
    stream's compressor is writing this step's closed window."""
    # x and q_in stay referenced by the caller until the join, and what the side stream
    # allocates returns to its own pool, so no block is reused across the streams before the join.
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        return select(comp.indexer, x, q_in, cos_sin, index, pools.indexers[layer])


def compress(comp: WindowCompressor, x: torch.Tensor, new_rows: torch.Tensor, ridx: RateIndex,
             pool: CompressorPool) -> None:
    """Store this token's projections, then close its window if it ends one (scratch otherwise).

    A pool of codes (release numerics) gets each row's entry staged in a [B, d] buffer in the model
    dtype and encoded into the pool by the same launch (`compress_windows(codes=...)`, the
    `kv_codes` encoders): the same values the general step encodes with `kv_rows.encode_kv` /
    `encode_index`."""
    comp.write_state(x, new_rows, pool)
    args = (ridx.src_rows, ridx.prev_rows, ridx.has_prev, ridx.event_cos, ridx.event_sin)
    fmt = pool.row_format
    if fmt.is_plain:
        comp.store_windows(pool, *args, ridx.event_rows)
        return
    b = x.shape[0]
    entries = torch.empty(b, comp.head_dim, dtype=x.dtype, device=x.device)
    # The indexer's keys are rotated and FP4; the main entries FP8 rows.
    layout = fp4_keys(fmt) if isinstance(comp, Indexer) else fp8_rows(fmt, 2 * ridx.event_cos.shape[-1])
    assert layout is not None
    comp.store_windows(pool, *args, _rows_of(b, x.device), out=entries,
                       codes=(pool.rows, ridx.event_rows, layout))


_ROWS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _rows_of(b: int, device: torch.device) -> torch.Tensor:
    """arange(b) int64 on `device`, made once (first made by a warm-up step, before any capture)."""
    key = (device, b)
    if key not in _ROWS:
        _ROWS[key] = torch.arange(b, device=device)
    return _ROWS[key]


def select(indexer: Indexer, x: torch.Tensor, q_in: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
           index: DecodeIndex, ipool: CompressorPool) -> torch.Tensor:
    """The indexer's top-k C4 rows of each row -> [B, k] int32 pool rows (-1 padded)."""
    ridx = index.rates[indexer.rate]
    compress(indexer, x, index.new_swa_rows, ridx, ipool)
    b = x.shape[0]
    q = indexer.q_b_proj(q_in).view(b, indexer.num_heads, indexer.head_dim)
    q = indexer.numerics.indexer_queries(rotate(q, *cos_sin))  # release: rotated and FP4-rounded
    weights = indexer.scorer.head_weights(x)
    return indexer.top_rows(q, weights, ipool, ridx.entry_rows, ridx.num_entries)


def _page_in(layer: int, rows: torch.Tensor, pools: KVPools, hot_base: torch.Tensor | None) -> torch.Tensor:
    """rows: [B, k] int32 selected pool rows -> the rows the attention reads: themselves, or with
    HiSparse the hot-buffer rows they are copied to (host tier -> each row's buffer, its first k
    rows, in top-k order). Must follow this step's compressor write into the main pool."""
    hot = pools.hot
    if hot is None:
        return rows
    assert hot_base is not None  # decode_step checks it
    return gather_rows(pools.compressors[layer].device_rows, rows, hot_base, hot.rows[layer],
                       hot.rows_copied_on_device)
