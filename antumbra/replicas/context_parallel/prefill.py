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
`cp_prefill` runs the ranks in one process (the exchange is a copy between their pools, counted);
`cp_prefill_rank` is one rank of a torch.distributed group (gloo / NCCL), the same tensors moving as
one send / recv per pair of ranks and layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from antumbra.cachestore.pools import CompressorPool, KVPools

from ..model.forward_batch import ForwardBatch
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
    # [m, n, D] the last layer's streams at the last m = min(slice, window) positions of the slice (of
    # the prompt, for `cp_prefill`): what a speculating receiver's drafter reads (`DRAFT_STREAMS`)
    tail_streams: torch.Tensor | None = None

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


# One message: (name of the pool tensor, row indices), in a fixed order both ends compute alike.
Plan = list[tuple[str, torch.Tensor]]


def _tensor(pools: KVPools, layer: int, name: str) -> torch.Tensor:
    """The 2-D pool tensor a plan entry names: "swa", or "<compressors|indexers>.<field>"."""
    if name == "swa":
        return pools.swa_kv[layer]
    kind, field = name.split(".")
    return getattr(getattr(pools, kind)[layer], field)


def _plan(
    pools: KVPools, layer: int, src: int, dst: int, vpages: list[int], slices: list[tuple[int, int]]
) -> tuple[Plan, LayerExchange]:
    """What rank `src` sends rank `dst` (src < dst) before `dst` runs `layer` (the module's table)."""
    start, page = slices[dst][0], pools.layout.page_size
    own = [slices[src]]  # the positions `src` owns: it sends only rows it wrote
    plan: Plan = []
    swa = state = comp = nbytes = 0
    for _, a, b in _by_owner(own, max(0, start - pools.layout.window + 1), start):
        plan.append(("swa", _swa_rows(pools, vpages, a, b)))
        swa += b - a
        nbytes += (b - a) * pools.kv_format.row_bytes
    for kind in ("compressors", "indexers"):
        pool: CompressorPool | None = getattr(pools, kind).get(layer)
        if pool is None:
            continue
        m = pool.spec.rate
        lo = max(0, (start // m) * m - (pool.spec.overlap - 1) * m)
        for _, a, b in _by_owner(own, lo, start):
            rows = _swa_rows(pools, vpages, a, b)
            plan += [(f"{kind}.state_kv", rows), (f"{kind}.state_gate", rows)]
            state += b - a
            nbytes += 2 * (b - a) * pool.state_kv.shape[1] * pool.state_kv.element_size()
        # window w is written by the rank owning its last token (w + 1) * m - 1
        for _, a, b in _by_owner([(x // m, y // m) for x, y in own], 0, start // m):
            windows = [(vpages[w * m // page] * page + (w * m) % page) // m for w in range(a, b)]
            plan.append((f"{kind}.rows", torch.tensor(windows, dtype=torch.long)))
            comp += b - a
            nbytes += (b - a) * pool.row_format.row_bytes
    return plan, LayerExchange(layer, dst, swa, state, comp, nbytes)


def _merged(parts: list[LayerExchange]) -> LayerExchange:
    first = parts[0]
    return LayerExchange(
        first.layer,
        first.rank,
        sum(p.swa_rows for p in parts),
        sum(p.state_rows for p in parts),
        sum(p.compressed_rows for p in parts),
        sum(p.nbytes for p in parts),
    )


def _receive(
    layer: int, rank: int, ranks: list[KVPools], vpages: list[int], slices: list[tuple[int, int]]
) -> LayerExchange:
    """Copy into rank `rank`'s pools the layer-`layer` rows it reads of earlier ranks' positions."""
    parts = []
    for src in range(rank):
        plan, counted = _plan(ranks[rank], layer, src, rank, vpages, slices)
        for name, rows in plan:
            _tensor(ranks[rank], layer, name)[rows] = _tensor(ranks[src], layer, name)[rows]
        parts.append(counted)
    return _merged(parts)


def _rank_state(
    model: DeepseekV4, pools: KVPools, vpages: list[int], ids: torch.Tensor, a: int, b: int
) -> list:
    """[batch, layer step, hc streams [b - a, n, D]] of one rank's slice."""
    device = ids.device
    batch = ForwardBatch(
        input_ids=ids[a:b],
        positions=torch.arange(a, b, device=device),
        req_index=torch.zeros(b - a, dtype=torch.long, device=device),
        block_tables=torch.tensor([vpages], dtype=torch.long, device=device),
        logits_indices=torch.arange(b - a, device=device),
        spans=((0, b - a),),
        starts=(a,),
        vpages=(tuple(vpages),),
    )
    return [batch, model.general_step(batch, pools), model.embed(batch.input_ids)]


def _run_layer(model: DeepseekV4, layer_id: int, state: list, pools: KVPools) -> None:
    batch, step, streams = state
    state[2], _ = model.model.layers[layer_id](streams, batch.input_ids, step)


def _logits(model: DeepseekV4, streams: torch.Tensor) -> torch.Tensor:
    return model.logits(model.head(streams))


@torch.no_grad()
def cp_prefill_rank(
    model: DeepseekV4,
    pools: KVPools,
    vpages: list[int],
    token_ids: list[int],
    slices: list[tuple[int, int]],
    rank: int,
    group: Any,
) -> CPResult:
    """One rank of a CP group (a torch.distributed ProcessGroup: gloo on CPUs, NCCL on GPUs); -> the
    logits of its slice [b_r - a_r, V] and what it received.

    Per layer: receive one message from each earlier rank, run the layer on the slice, post one
    message to each later rank (the rows of the module's table that this rank wrote); messages are
    flat byte buffers whose layout both ends derive from the slices (`_plan`), tagged by layer."""
    ids = torch.tensor(token_ids, dtype=torch.long, device=model.lm_head.weight.device)
    state = _rank_state(model, pools, vpages, ids, *slices[rank])
    exchanges, posted = [], []
    for layer_id in range(model.config.num_layers):
        parts = []
        for src in range(rank):
            plan, counted = _plan(pools, layer_id, src, rank, vpages, slices)
            views = [_tensor(pools, layer_id, name)[rows] for name, rows in plan]
            buffer = torch.empty(sum(v.numel() * v.element_size() for v in views), dtype=torch.uint8)
            if buffer.numel():
                group.recv([buffer], src, layer_id).wait()
            offset = 0
            for (name, rows), view in zip(plan, views, strict=True):
                size = view.numel() * view.element_size()
                chunk = buffer[offset : offset + size].view(view.dtype).view(view.shape)
                _tensor(pools, layer_id, name)[rows] = chunk.to(view.device)
                offset += size
            parts.append(counted)
        if parts:
            exchanges.append(_merged(parts))
        _run_layer(model, layer_id, state, pools)
        for dst in range(rank + 1, len(slices)):
            plan, _ = _plan(pools, layer_id, rank, dst, vpages, slices)
            views = [
                _tensor(pools, layer_id, name)[rows].contiguous().view(-1).view(torch.uint8)
                for name, rows in plan
            ]
            if views and sum(v.numel() for v in views):
                message = torch.cat(views).cpu()
                posted.append((group.send([message], dst, layer_id), message))
    for work, _ in posted:
        work.wait()
    return CPResult(_logits(model, state[2]), tuple(exchanges), state[2][-model.config.sliding_window :])


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
    ids = torch.tensor(token_ids, dtype=torch.long, device=model.lm_head.weight.device)
    states = [
        _rank_state(model, pools, vpages, ids, a, b) for pools, (a, b) in zip(ranks, slices, strict=True)
    ]
    exchanges = []
    for layer_id in range(model.config.num_layers):
        for r, state in enumerate(states):
            if r > 0:
                exchanges.append(_receive(layer_id, r, ranks, vpages, slices))
            _run_layer(model, layer_id, state, ranks[r])
    tail = torch.cat([s[2] for s in states])[-model.config.sliding_window :]
    return CPResult(torch.cat([_logits(model, s[2]) for s in states]), tuple(exchanges), tail)
