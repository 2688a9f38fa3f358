"""The decode step's indices in two launches per step plus one per rate (see `reference.py`).

Built from PyTorch ops, the same indices take about a hundred small launches a step (gathers,
clamps, comparisons, selects over [B, W] and [B, C] tensors), each a few microseconds in a
captured graph. Here `_window_kernel` writes the new rows and the window rows, one program per
decode row, and `_rate_kernel` a tile of one rate's entry rows per program, program 0 of each
row also the window that row closes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from antumbra.kernels.common import host_math
from antumbra.kernels.common.interpreter import prepare

prepare()


@triton.jit
def _swa_row(tables_ptr, swa_map_ptr, b, p, mask, PAGE: tl.constexpr, P: tl.constexpr):
    """SWA row of positions p (any shape) of row b; -1 where the page has none or p < 0."""
    p0 = tl.maximum(p, 0)
    vpage = tl.load(tables_ptr + b * P + tl.minimum(p0 // PAGE, P - 1), mask=mask, other=-1)
    swa_page = tl.load(swa_map_ptr + tl.maximum(vpage, 0), mask=mask, other=-1)
    ok = (vpage >= 0) & (swa_page >= 0) & (p >= 0)
    return tl.where(ok, swa_page * PAGE + p0 % PAGE, -1)


@triton.jit
def _window_kernel(
    tables_ptr, swa_map_ptr, pos_ptr, active_ptr, new_rows_ptr, window_rows_ptr, scratch_swa,
    PAGE: tl.constexpr, P: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + b)
    act = tl.load(active_ptr + b) != 0
    own = _swa_row(tables_ptr, swa_map_ptr, b, pos, True, PAGE, P)
    tl.store(new_rows_ptr + b, tl.where(act & (own >= 0), own, scratch_swa))
    j = tl.arange(0, BLOCK_W)
    jmask = j < W
    rows = _swa_row(tables_ptr, swa_map_ptr, b, pos - (W - 1) + j, jmask, PAGE, P)
    rows = tl.where(act, rows, -1)
    tl.store(window_rows_ptr + b * W + j, rows.to(tl.int32), mask=jmask)


@triton.jit
def _rate_kernel(
    tables_ptr, swa_map_ptr, pos_ptr, active_ptr,
    entry_rows_ptr, num_entries_ptr, event_rows_ptr, event_first_ptr,
    src_rows_ptr, prev_rows_ptr, has_prev_ptr,
    C, scratch_swa, scratch_comp,
    PAGE: tl.constexpr, P: tl.constexpr, RATE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    pos = tl.load(pos_ptr + b)
    act = tl.load(active_ptr + b) != 0
    n = tl.where(act, (pos + 1) // RATE, 0)
    w = tile * BLOCK_C + tl.arange(0, BLOCK_C)
    wmask = w < C
    first = w.to(tl.int64) * RATE
    vpage = tl.load(tables_ptr + b * P + tl.minimum(first // PAGE, P - 1), mask=wmask, other=-1)
    entry = vpage * (PAGE // RATE) + (first % PAGE) // RATE
    tl.store(entry_rows_ptr + b * C + w, tl.where(w < n, entry, -1).to(tl.int32), mask=wmask)
    if tile == 0:
        tl.store(num_entries_ptr + b, n.to(tl.int32))
        closes = act & ((pos + 1) % RATE == 0)
        ev_first = tl.maximum(pos + 1 - RATE, 0)
        ev_vpage = tl.load(tables_ptr + b * P + tl.minimum(ev_first // PAGE, P - 1))
        row = ev_vpage * (PAGE // RATE) + (ev_first % PAGE) // RATE
        tl.store(event_rows_ptr + b, tl.where(closes, row, scratch_comp))
        tl.store(event_first_ptr + b, ev_first)
        has_prev = closes & (ev_first > 0)
        tl.store(has_prev_ptr + b, has_prev.to(tl.int8))
        k = tl.arange(0, BLOCK_R)
        kmask = k < RATE
        src = _swa_row(tables_ptr, swa_map_ptr, b, ev_first + k, kmask, PAGE, P)
        tl.store(src_rows_ptr + b * RATE + k, tl.where(closes, src, scratch_swa), mask=kmask)
        prev = _swa_row(tables_ptr, swa_map_ptr, b, ev_first + k - RATE, kmask, PAGE, P)
        tl.store(prev_rows_ptr + b * RATE + k, tl.where(has_prev, prev, scratch_swa), mask=kmask)


def _check(tables: Tensor, swa_map: Tensor, positions: Tensor, active: Tensor) -> None:
    assert tables.dtype == swa_map.dtype == positions.dtype == torch.int64, (
        "tables, swa_map, positions: int64"
    )
    assert tables.is_contiguous() and swa_map.is_contiguous() and positions.is_contiguous()
    assert active.shape == positions.shape and active.is_contiguous()


def window_index(
    tables: Tensor,
    swa_map: Tensor,
    positions: Tensor,
    active: Tensor,
    page: int,
    window: int,
    scratch_swa: int,
) -> tuple[Tensor, Tensor]:
    """As `window_index_reference`; `active` bool or integer (non-zero = active)."""
    _check(tables, swa_map, positions, active)
    b = positions.shape[0]
    new_rows = torch.empty(b, dtype=torch.int64, device=positions.device)
    window_rows = torch.empty(b, window, dtype=torch.int32, device=positions.device)
    if b:
        _window_kernel[(b,)](
            tables, swa_map, positions, active, new_rows, window_rows, scratch_swa,
            PAGE=page, P=tables.shape[1], W=window, BLOCK_W=host_math.next_power_of_2(window),
        )
    return new_rows, window_rows


def rate_index(
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
    """As `rate_index_reference`; `active` bool or integer (non-zero = active)."""
    _check(tables, swa_map, positions, active)
    assert page % rate == 0, "a page holds whole windows"
    b, device = positions.shape[0], positions.device
    entry_rows = torch.empty(b, width, dtype=torch.int32, device=device)
    num_entries = torch.empty(b, dtype=torch.int32, device=device)
    event_rows = torch.empty(b, dtype=torch.int64, device=device)
    event_first = torch.empty(b, dtype=torch.int64, device=device)
    src_rows = torch.empty(b, rate, dtype=torch.int64, device=device)
    prev_rows = torch.empty(b, rate, dtype=torch.int64, device=device)
    has_prev = torch.empty(b, dtype=torch.int8, device=device)
    if b:
        block_c = max(16, min(1024, host_math.next_power_of_2(max(width, 1))))
        _rate_kernel[(b, max(1, host_math.cdiv(width, block_c)))](
            tables, swa_map, positions, active,
            entry_rows, num_entries, event_rows, event_first, src_rows, prev_rows, has_prev,
            width, scratch_swa, scratch_comp,
            PAGE=page, P=tables.shape[1], RATE=rate, BLOCK_C=block_c, BLOCK_R=host_math.next_power_of_2(rate),
        )
    return entry_rows, num_entries, event_rows, event_first, src_rows, prev_rows, has_prev.view(torch.bool)
