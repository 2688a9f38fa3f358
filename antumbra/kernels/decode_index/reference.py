"""The indices a fixed-shape decode step reads, in plain PyTorch: the definition the kernels reproduce.

Inputs, per decode row b (a sequence decoding the token at position pos[b]):
  tables    [B, P] int64  virtual page of each logical page of the sequence, -1 past its end
  swa_map   [V]    int64  SWA page attached to each virtual page, -1 when none
  positions [B]    int64
  active    [B]    bool (or integer, non-zero = active)   False for padded rows

The SWA / state row of position p is `swa_map[tables[b, p // page]] * page + p % page`, or -1
when the page has no SWA page (or p < 0). Outputs:
  * `window_index`: new_rows [B] int64, the row of the token itself (`scratch_swa` for padded
    rows and for a missing page, so a write never leaves the pool), and window_rows [B, W] int32,
    the rows of positions pos-W+1..pos (-1 where missing, all -1 for padded rows).
  * `rate_index`, per compression rate m with width C: entry_rows [B, C] int32, the compressed
    row `vpage * (page // m) + (w * m % page) // m` of entry w while w < (pos + 1) // m, else -1;
    num_entries [B] int32; and the window this token closes, if any: event_rows [B] int64 (the
    compressed row written, `scratch_comp` if none), event_first [B] int64 (the window's first
    position, clamped at 0), src_rows / prev_rows [B, m] int64 (state rows of the window and the
    previous one; `scratch_swa` when there is none) and has_prev [B] bool.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _swa_rows(tables: Tensor, swa_map: Tensor, req: Tensor, p: Tensor, page: int) -> Tensor:
    max_pages = tables.shape[1]
    vpage = tables[req, (p.clamp(min=0) // page).clamp(max=max_pages - 1)]
    swa_page = swa_map[vpage.clamp(min=0)]
    ok = (vpage >= 0) & (swa_page >= 0) & (p >= 0)
    return torch.where(ok, swa_page * page + p.clamp(min=0) % page, -1)


def window_index_reference(
    tables: Tensor,
    swa_map: Tensor,
    positions: Tensor,
    active: Tensor,
    page: int,
    window: int,
    scratch_swa: int,
) -> tuple[Tensor, Tensor]:
    active = active != 0
    rows_b = torch.arange(positions.shape[0], device=positions.device)
    own = _swa_rows(tables, swa_map, rows_b, positions, page)
    new_rows = torch.where(active & (own >= 0), own, scratch_swa)
    back = torch.arange(window - 1, -1, -1, device=positions.device)
    win_pos = positions[:, None] - back[None, :]
    win = _swa_rows(tables, swa_map, rows_b[:, None].expand_as(win_pos), win_pos, page)
    return new_rows, torch.where(active[:, None], win, -1).to(torch.int32)


def rate_index_reference(
    tables: Tensor,
    swa_map: Tensor,
    positions: Tensor,
    active: Tensor,
    page: int,
    rate: int,
    width: int,
    scratch_swa: int,
    scratch_comp: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (entry_rows, num_entries, event_rows, event_first, src_rows, prev_rows, has_prev)."""
    device = positions.device
    active = active != 0
    max_pages = tables.shape[1]
    rows_b = torch.arange(positions.shape[0], device=device)
    per_page = page // rate
    num_entries = torch.where(active, (positions + 1) // rate, 0)
    w = torch.arange(width, device=device)
    first = w * rate
    vpage = tables[:, (first // page).clamp(max=max_pages - 1)]  # [B, C]
    entry = vpage * per_page + (first % page) // rate
    entry_rows = torch.where(w[None, :] < num_entries[:, None], entry, -1).to(torch.int32)

    closes = active & ((positions + 1) % rate == 0)
    ev_first = (positions + 1 - rate).clamp(min=0)
    ev_vpage = tables[rows_b, (ev_first // page).clamp(max=max_pages - 1)]
    event_rows = torch.where(closes, ev_vpage * per_page + (ev_first % page) // rate, scratch_comp)
    src_pos = ev_first[:, None] + torch.arange(rate, device=device)[None, :]
    req_m = rows_b[:, None].expand_as(src_pos)
    src_rows = torch.where(closes[:, None], _swa_rows(tables, swa_map, req_m, src_pos, page), scratch_swa)
    has_prev = closes & (ev_first > 0)
    prev_rows = torch.where(
        has_prev[:, None], _swa_rows(tables, swa_map, req_m, src_pos - rate, page), scratch_swa
    )
    return entry_rows, num_entries.to(torch.int32), event_rows, ev_first, src_rows, prev_rows, has_prev
