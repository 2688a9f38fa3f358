"""Context-parallel prefill: a prompt split into contiguous slices, one per rank, every layer per slice.

Rank r owns positions [a_r, b_r) and its own `KVPools` (same layout as every rank; the request's
block table is the same on each, so a position's rows have the same indices everywhere). Layer l of
rank r reads, besides its own slice, only layer-l rows of earlier positions, which earlier ranks
write. Before running layer l, rank r therefore receives, per layer (W window, m a compressor's rate,
c its overlap, d its head dim; `Exchange` counts exactly these):

  tensor                          positions / windows                      size per layer
  ------------------------------  ---------------------------------------  -------------------------------
  SWA kv rows                     [max(0, a_r - W + 1), a_r): the window   (W - 1) x kv row bytes
                                   crossing the slice edge (from every
                                   rank those positions belong to)
  compressor state (kv and gate)  [floor(a_r/m)*m - (c-1)*m, a_r): the     2 x c*m x c*d x 4 bytes, per
   of the layer's compressor and   windows crossing the edge (the open      compressor (main, indexer)
   its indexer                     one, and the previous one CSA reads)
  compressed rows (C4 / C128)     windows [0, a_r // m): every earlier     (a_r // m) x row bytes
   and indexer keys                compressed row (all-gathered: the        (new rows of each earlier rank,
                                   indexer's top-k ranks all of them)       sent once to every later rank)

With these, each rank's layer l is exactly a chunked-prefill step of its slice over the earlier
rows, so the KV and the logits equal one rank's. Ranks run layer l once the rows of layer l from
earlier ranks have arrived: a wavefront, R ranks finish L layers in L + R - 1 slice-layer times.
This module runs the ranks in one process (the exchange is a copy between their pools, counted);
a gloo / NCCL group moves the same tensors with send / recv.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from antumbra.cachestore.pools import CompressorPool, KVPools
from antumbra.config import SLIDING

from ..model.forward_batch import ForwardBatch, build_step_index
from ..model.model import DeepseekV4


@dataclass(frozen=True)
class LayerExchange:
    """What rank `rank` received before layer `layer`."""

    layer: int
    rank: int
    swa_rows: int
    state_rows: int
    compressed_rows: int
    nbytes: int


@dataclass(frozen=True)
class CPResult:
    logits: torch.Tensor  # [N, V] float32, every prompt position
    exchanges: tuple[LayerExchange, ...]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.exchanges)


def split_slices(num_tokens: int, num_ranks: int) -> list[tuple[int, int]]:
    """Contiguous, nearly equal slices [a_r, b_r) covering [0, num_tokens)."""
    if not 1 <= num_ranks <= num_tokens:
        raise ValueError(f"{num_ranks} ranks for {num_tokens} tokens")
    edges = [round(r * num_tokens / num_ranks) for r in range(num_ranks + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


def _by_owner(slices: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(rank, a, b): the part [a, b) of positions [lo, hi) each rank owns."""
    return [(r, max(lo, a), min(hi, b)) for r, (a, b) in enumerate(slices) if max(lo, a) < min(hi, b)]


def _swa_rows(pools: KVPools, vpages: list[int], lo: int, hi: int) -> torch.Tensor:
    page = pools.layout.page_size
    table = pools.swa_page_table_host()
    return torch.tensor([table[vpages[p // page]] * page + p % page for p in range(lo, hi)], dtype=torch.long)


def _receive(
    layer: int, rank: int, ranks: list[KVPools], vpages: list[int], slices: list[tuple[int, int]]
) -> LayerExchange:
    """Copy into rank `rank`'s pools the layer-`layer` rows it reads of earlier ranks' positions."""
    dst = ranks[rank]
    start, page = slices[rank][0], dst.layout.page_size
    swa_lo = max(0, start - dst.layout.window + 1)
    for src, a, b in _by_owner(slices, swa_lo, start):
        rows = _swa_rows(dst, vpages, a, b)
        dst.swa_kv[layer, rows] = ranks[src].swa_kv[layer, rows]
    swa, state, comp = start - swa_lo, 0, 0
    nbytes = swa * dst.kv_format.row_bytes
    for kind in ("compressors", "indexers"):
        pool: CompressorPool | None = getattr(dst, kind).get(layer)
        if pool is None:
            continue
        m = pool.spec.rate
        lo = max(0, (start // m) * m - (pool.spec.overlap - 1) * m)
        for src, a, b in _by_owner(slices, lo, start):
            rows = _swa_rows(dst, vpages, a, b)
            other = getattr(ranks[src], kind)[layer]
            pool.state_kv[rows], pool.state_gate[rows] = other.state_kv[rows], other.state_gate[rows]
        state += start - lo
        nbytes += 2 * (start - lo) * pool.state_kv.shape[1] * pool.state_kv.element_size()
        # window w is written by the rank owning its last token (w + 1) * m - 1
        for src, a, b in _by_owner([(x // m, y // m) for x, y in slices], 0, start // m):
            rows = torch.tensor(
                [(vpages[w * m // page] * page + (w * m) % page) // m for w in range(a, b)], dtype=torch.long
            )
            pool.rows[rows] = getattr(ranks[src], kind)[layer].rows[rows]
        comp += start // m
        nbytes += (start // m) * pool.row_format.row_bytes
    return LayerExchange(layer, rank, swa, state, comp, nbytes)


@torch.no_grad()
def cp_prefill(
    model: DeepseekV4,
    ranks: list[KVPools],
    vpages: list[int],
    token_ids: list[int],
    slices: list[tuple[int, int]],
) -> CPResult:
    """Prefill `token_ids` from position 0 over `len(ranks)` ranks; -> logits of every position.

    `vpages`: the request's block table, allocated in every rank's pools with an SWA page attached
    to each page (each rank writes its slice's rows; rows of earlier positions arrive by exchange).
    """
    if len(slices) != len(ranks) or slices[0][0] != 0 or slices[-1][1] != len(token_ids):
        raise ValueError("one contiguous slice per rank, covering the prompt")
    cfg = model.config
    device = model.lm_head.weight.device
    rates = {cfg.compress_rate(i) for i in range(cfg.num_layers)} - {0}
    ropes = model.rope_tables()
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    table = torch.tensor([vpages], dtype=torch.long, device=device)
    states = []
    for pools, (a, b) in zip(ranks, slices, strict=True):
        batch = ForwardBatch(
            input_ids=ids[a:b],
            positions=torch.arange(a, b, device=device),
            req_index=torch.zeros(b - a, dtype=torch.long, device=device),
            block_tables=table,
            logits_indices=torch.arange(b - a, device=device),
            spans=((0, b - a),),
        )
        index = build_step_index(batch, pools, cfg.sliding_window, rates)
        cos_sin = {name: t.cos_sin(batch.positions) for name, t in ropes.items()}
        streams = (
            model.model.embed_tokens(batch.input_ids).unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        )
        states.append([batch, index, cos_sin, streams])
    exchanges = []
    for layer_id, layer in enumerate(model.model.layers):
        kind = "main" if cfg.layer_types[layer_id] == SLIDING else "compress"
        for r, state in enumerate(states):
            if r > 0:
                exchanges.append(_receive(layer_id, r, ranks, vpages, slices))
            batch, index, cos_sin, streams = state
            state[3], _ = layer(
                streams, batch.input_ids, cos_sin[kind], ropes["compress"], index, ranks[r], None
            )
    logits = [model.lm_head(model.model.norm(model.model.hc_head(s[3]))).float() for s in states]
    return CPResult(torch.cat(logits), tuple(exchanges))
