"""The per-step batch description the model reads and writes the pools through.

The runner flattens one scheduler step into T tokens from B requests; the model
never holds per-request tensors, only these indices into the shared pools.

Nothing here reads a device tensor back: what a step's index sizes depend on (how wide
the compressed index is, which tokens close a window, whether every token has its SWA
page) follows from host-side facts the scheduler already has (each chunk's start,
length and block table), carried in `ForwardBatch`. A read of device data (`.item()`,
`nonzero()`, `bool(tensor)`) would drain the stream and leave the device idle while the
host launches the rest of the step; so would a copy from pageable memory (`to_device`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from antumbra.cachestore.pools import KVPools

from .hot_stage import LongChunk, StagePlan, plan_stage


def to_device(values: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host-built values (a list: int64) -> the same tensor on `device`, without waiting for it.

    CUDA stages a copy from pageable memory synchronously: the stream drains before it starts.
    For a CUDA target the values go to pinned memory first and the copy is asynchronous; the
    caching host allocator keeps the pinned block until the copy has run, so the caller may drop
    its host tensor at once. On any other device this is a plain copy."""
    pinned = device.type == "cuda"
    if isinstance(values, torch.Tensor):
        host = values.pin_memory() if pinned and not values.is_pinned() else values
    else:
        host = torch.tensor(values, dtype=torch.long, pin_memory=pinned)
    return host.to(device, non_blocking=True)


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, device
    positions: torch.Tensor  # [T] int64, absolute position of each token in its sequence
    req_index: torch.Tensor  # [T] int64 in [0, B): which request each token belongs to
    block_tables: torch.Tensor  # [B, P] int64 virtual page of each logical page, -1 past the end
    logits_indices: torch.Tensor  # [N] int64 rows of T whose logits are wanted
    spans: tuple[tuple[int, int], ...]  # host-side: token rows [row0, row1) of each request, in order
    # Host-side facts of the same step, so the index never reads the device tensors above back:
    starts: tuple[int, ...]  # [B] position of each request's first token of the step (= positions[row0])
    vpages: tuple[tuple[int, ...], ...]  # [B][P_b] each request's block table (block_tables without -1)
    replay_until: tuple[int, ...] = ()  # [B] windows closing at or before keep their rows; (): none
    hot_buffers: tuple[int, ...] = ()  # host-side: HiSparse buffer of each request (-1 none)
    # [T, L, k] int64 experts each token must use in each MoE layer (routing replay), None: route freely
    routed_experts: torch.Tensor | None = None
    stream_indices: torch.Tensor | None = None  # [M] int64 rows of T whose last-layer streams are kept

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


# Chunks at least this long attend in query blocks that share one gathered key window;
# shorter ones (decodes) gather a window per query, batched across sequences.
LONG_SPAN_TOKENS = 32


@dataclass(frozen=True)
class WindowIndex:
    """Rows of the SWA pool each query attends to: positions pos-W+1 .. pos."""

    rows: torch.Tensor  # [T, W] int64 SWA row (0 where invalid)
    valid: torch.Tensor  # [T, W] bool


@dataclass(frozen=True)
class CompressedIndex:
    """For one compression rate m: the causal entries of each query and the windows closed this step."""

    entry_rows: torch.Tensor  # [T, C] int64 pool row of entry w = 0..C-1 of the query's sequence
    entry_valid: torch.Tensor  # [T, C] bool: w < (pos + 1) // m
    event_tokens: torch.Tensor  # [E] int64 rows of T whose token closes a window
    event_rows: torch.Tensor  # [E] int64 pool row the new entry is written to
    event_positions: torch.Tensor  # [E] int64 position of the window's first token (w * m)
    event_src_rows: torch.Tensor  # [E, m] int64 state rows of the window's tokens
    event_prev_rows: torch.Tensor  # [E, m] int64 state rows of the previous window's tokens
    event_has_prev: torch.Tensor  # [E] bool: w > 0
    # host-side: per span of the step, the entries its last token reads (stop // m), in span order
    span_entries: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepIndex:
    new_swa_rows: torch.Tensor  # [T] int64 SWA / state row of each new token
    spans: tuple[tuple[int, int], ...]  # token rows of each request
    short_rows: torch.Tensor  # [S] int64 rows of chunks shorter than LONG_SPAN_TOKENS (decodes)
    long_spans: tuple[tuple[int, int], ...]  # token rows of chunks at least LONG_SPAN_TOKENS long
    long_stops: tuple[int, ...]  # host-side: the position after each long span's last token
    hot_buffers: tuple[int, ...]  # HiSparse buffer of each request, in span order
    window: WindowIndex
    compressed: dict[int, CompressedIndex]  # by rate
    # HiSparse with long chunks in the step: the C4 rows they read, staged per CSA layer (hot_stage.py)
    stage: StagePlan | None = None


def build_step_index(batch: ForwardBatch, pools: KVPools, window: int, rates: set[int]) -> StepIndex:
    """The step's rows into the pools, by device ops on the batch's tensors; every size and every
    host-built row list comes from the batch's host facts (one asynchronous copy for those lists)."""
    page = pools.layout.page_size
    table = pools.swa_page_of_vpage
    _check_swa_attached(batch, pools)

    def slot_parts(req: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vpage = batch.block_tables[req, pos // page]
        return vpage, pos % page

    def swa_rows(req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        vpage, offset = slot_parts(req, pos)
        return table[vpage] * page + offset

    def has_swa(req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return table[slot_parts(req, pos)[0]] >= 0

    req, pos = batch.req_index, batch.positions
    new_rows = swa_rows(req, pos)

    back = torch.arange(window - 1, -1, -1, device=pos.device)
    win_pos = pos[:, None] - back[None, :]
    win_req = req[:, None].expand_as(win_pos)
    # Keys without an SWA page only occur in a replay's first window, whose rows are
    # recomputed as inexact anyway; everywhere else the scheduler keeps them attached.
    win_valid = (win_pos >= 0) & has_swa(win_req, win_pos.clamp(min=0))
    win_rows = torch.where(win_valid, swa_rows(win_req, win_pos.clamp(min=0)), 0)

    by_rate = sorted(rates)
    short = [r for r0, r1 in batch.spans if r1 - r0 < LONG_SPAN_TOKENS for r in range(r0, r1)]
    events = [_event_tokens(batch, m) for m in by_rate]
    lists = [short, *events]
    # One copy for every host-built list of the step, split into views on the device.
    packed = to_device([r for rows in lists for r in rows], pos.device)
    short_rows, *event_tokens = packed.split([len(rows) for rows in lists])
    compressed = {
        m: _compressed_index(batch, req, pos, m, page, swa_rows, tokens)
        for m, tokens in zip(by_rate, event_tokens, strict=True)
    }
    long = [(b, span) for b, span in enumerate(batch.spans) if span[1] - span[0] >= LONG_SPAN_TOKENS]
    return StepIndex(
        new_rows,
        batch.spans,
        short_rows,
        tuple(span for _, span in long),
        tuple(_stops(batch)[b] for b, _ in long),
        batch.hot_buffers,
        WindowIndex(win_rows, win_valid),
        compressed,
        _stage_plan(batch, pools, compressed, [b for b, _ in long]),
    )


def _stage_plan(batch: ForwardBatch, pools: KVPools, compressed: dict[int, CompressedIndex],
                long: list[int]) -> StagePlan | None:
    """HiSparse: the rows the step's long chunks (batch indices `long`) stage per CSA layer."""
    if pools.hot is None or not pools.hot.layers or not long:
        return None
    pool = pools.compressors[pools.hot.layers[0]]
    rate = pool.spec.rate
    chunks = []
    for b in long:
        (r0, r1), start = batch.spans[b], batch.starts[b]
        stop = start + r1 - r0
        replayed = batch.replay_until[b] if batch.replay_until else 0
        # The windows closing in the step are those `_event_tokens` lists: past max(start, replay).
        chunks.append(LongChunk(r1 - 1, stop // rate, min(max(start, replayed), stop) // rate))
    return plan_stage(compressed[rate].entry_rows, chunks, pool.rows.shape[0])


def _stops(batch: ForwardBatch) -> list[int]:
    """The position after each span's last token."""
    return [start + r1 - r0 for (r0, r1), start in zip(batch.spans, batch.starts, strict=True)]


def _check_swa_attached(batch: ForwardBatch, pools: KVPools) -> None:
    """Every token of the step must have an SWA page to write its row to; checked on the pools'
    host table (the device table holds the same pages)."""
    page = pools.layout.page_size
    for (r0, r1), start, vpages in zip(batch.spans, batch.starts, batch.vpages, strict=True):
        if r1 == r0:
            continue
        last = start + r1 - r0 - 1
        for p in range(start // page, last // page + 1):
            if p >= len(vpages) or vpages[p] < 0 or not pools.has_swa(vpages[p]):
                raise RuntimeError("a scheduled token has no SWA page attached")


def _event_tokens(batch: ForwardBatch, rate: int) -> list[int]:
    """Rows of the step's tokens that close a window of `rate` (position p with (p + 1) % rate == 0),
    in row order; while a request replays, windows closing at or before its replay_until kept their
    entries and close again only past it."""
    out: list[int] = []
    for b, ((r0, r1), start) in enumerate(zip(batch.spans, batch.starts, strict=True)):
        replayed = batch.replay_until[b] if batch.replay_until else 0
        lowest = max(start, replayed) + 1  # the smallest p + 1 that may close
        first = -(-lowest // rate) * rate  # ... rounded up to a window end
        out.extend(range(r0 + first - 1 - start, r1, rate))
    return out


def _compressed_index(batch, req, pos, rate, page, swa_rows, event_tokens) -> CompressedIndex:
    """event_tokens: [E] int64 device rows of the tokens closing a window (`_event_tokens`)."""
    device = pos.device
    num_ready = (pos + 1) // rate  # entries a query at pos may read
    span_entries = tuple(stop // rate for stop in _stops(batch))
    width = max((n for n, (r0, r1) in zip(span_entries, batch.spans, strict=True) if r1 > r0), default=0)
    w = torch.arange(width, device=device)
    entry_valid = w[None, :] < num_ready[:, None]
    first_pos = (w * rate)[None, :].expand(pos.shape[0], -1)
    vpage = batch.block_tables[req[:, None].expand_as(first_pos), first_pos // page]
    rows = (vpage * page + first_pos % page) // rate
    entry_rows = torch.where(entry_valid, rows, 0)

    ev_req, ev_pos = req[event_tokens], pos[event_tokens]
    ev_first = ev_pos + 1 - rate
    ev_vpage = batch.block_tables[ev_req, ev_first // page]
    event_rows = (ev_vpage * page + ev_first % page) // rate
    offsets = torch.arange(rate, device=device)
    src_pos = ev_first[:, None] + offsets[None, :]
    ev_req_m = ev_req[:, None].expand_as(src_pos)
    src_rows = swa_rows(ev_req_m, src_pos)
    has_prev = ev_first > 0
    prev_pos = (src_pos - rate).clamp(min=0)
    prev_rows = torch.where(has_prev[:, None], swa_rows(ev_req_m, prev_pos), 0).clamp(min=0)
    return CompressedIndex(
        entry_rows=entry_rows,
        entry_valid=entry_valid,
        event_tokens=event_tokens,
        event_rows=event_rows,
        event_positions=ev_first,
        event_src_rows=src_rows,
        event_prev_rows=prev_rows,
        event_has_prev=has_prev,
        span_entries=span_entries,
    )
