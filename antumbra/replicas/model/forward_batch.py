"""The per-step batch description the model reads and writes the pools through.

The runner flattens one scheduler step into T tokens from B requests; the model
never holds per-request tensors, only these indices into the shared pools.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from antumbra.cachestore.pools import KVPools


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, device
    positions: torch.Tensor  # [T] int64, absolute position of each token in its sequence
    req_index: torch.Tensor  # [T] int64 in [0, B): which request each token belongs to
    block_tables: torch.Tensor  # [B, P] int64 virtual page of each logical page, -1 past the end
    logits_indices: torch.Tensor  # [N] int64 rows of T whose logits are wanted
    spans: tuple[tuple[int, int], ...]  # host-side: token rows [row0, row1) of each request, in order
    replay_until: torch.Tensor | None = None  # [B] int64: windows closing at or before keep their rows
    hot_buffers: tuple[int, ...] = ()  # host-side: HiSparse buffer of each request (-1 none)
    # [T, L, k] int64 experts each token must use in each MoE layer (routing replay), None: route freely
    routed_experts: torch.Tensor | None = None

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


@dataclass(frozen=True)
class StepIndex:
    new_swa_rows: torch.Tensor  # [T] int64 SWA / state row of each new token
    spans: tuple[tuple[int, int], ...]  # token rows of each request
    short_rows: torch.Tensor  # [S] int64 rows of chunks shorter than LONG_SPAN_TOKENS (decodes)
    long_spans: tuple[tuple[int, int], ...]  # token rows of chunks at least LONG_SPAN_TOKENS long
    hot_buffers: tuple[int, ...]  # HiSparse buffer of each request, in span order
    window: WindowIndex
    compressed: dict[int, CompressedIndex]  # by rate


def build_step_index(batch: ForwardBatch, pools: KVPools, window: int, rates: set[int]) -> StepIndex:
    page = pools.layout.page_size
    table = pools.swa_page_of_vpage

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
    if bool((new_rows < 0).any()):
        raise RuntimeError("a scheduled token has no SWA page attached")

    back = torch.arange(window - 1, -1, -1, device=pos.device)
    win_pos = pos[:, None] - back[None, :]
    win_req = req[:, None].expand_as(win_pos)
    # Keys without an SWA page only occur in a replay's first window, whose rows are
    # recomputed as inexact anyway; everywhere else the scheduler keeps them attached.
    win_valid = (win_pos >= 0) & has_swa(win_req, win_pos.clamp(min=0))
    win_rows = torch.where(win_valid, swa_rows(win_req, win_pos.clamp(min=0)), 0)
    compressed = {m: _compressed_index(batch, req, pos, m, page, swa_rows) for m in sorted(rates)}
    short = [r for r0, r1 in batch.spans if r1 - r0 < LONG_SPAN_TOKENS for r in range(r0, r1)]
    long_spans = tuple((r0, r1) for r0, r1 in batch.spans if r1 - r0 >= LONG_SPAN_TOKENS)
    short_rows = torch.tensor(short, dtype=torch.long).to(pos.device)
    return StepIndex(
        new_rows,
        batch.spans,
        short_rows,
        long_spans,
        batch.hot_buffers,
        WindowIndex(win_rows, win_valid),
        compressed,
    )


def _compressed_index(batch, req, pos, rate, page, swa_rows) -> CompressedIndex:
    device = pos.device
    num_ready = (pos + 1) // rate  # entries a query at pos may read
    width = int(num_ready.max().item()) if pos.numel() else 0
    w = torch.arange(width, device=device)
    entry_valid = w[None, :] < num_ready[:, None]
    first_pos = (w * rate)[None, :].expand(pos.shape[0], -1)
    vpage = batch.block_tables[req[:, None].expand_as(first_pos), first_pos // page]
    rows = (vpage * page + first_pos % page) // rate
    entry_rows = torch.where(entry_valid, rows, 0)

    closes = ((pos + 1) % rate) == 0
    if batch.replay_until is not None:
        closes &= (pos + 1) > batch.replay_until[req]
    event_tokens = closes.nonzero().flatten()
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
    )
