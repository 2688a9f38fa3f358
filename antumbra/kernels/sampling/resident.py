"""The Gumbel race over logits adjusted from per-slot device tables (penalties, logit bias,
min_tokens bans, min_p) in the race's two launches: `race_sample_slots_reference`
(reference.py) is the definition.

A row that adjusts its logits names a *slot* (`slots[b]`, -1: none) of `SlotTables`, which
hold, per slot, the generated-token counts and the prompt-or-output membership over the whole
vocabulary, the penalty scalars, and a short sorted list of the tokens whose logit is biased or
banned. Nothing is written to the logits and no adjusted copy exists. Each program of the
partial launch (row b, chunk s of `CHUNK` tokens, as `triton.py`'s) reads its chunk in tiles of
`BLOCK` tokens; for a row with a slot it reads the counts and membership of the tile its
penalties need beside the logits (coalesced, no search), and looks the tile's tokens up in the
slot's list only where the list has entries in that tile (a binary search of `SEARCH` halvings
over the tile's slice of the list: offsets computed once per slot when it is filled). A plain
row reads its logits only.

min_p needs the row's largest adjusted logit, which no program knows while it reads its chunk.
Each program cuts at the largest logit it has seen so far plus the slack: a looser cut than the
row's, so the tokens it races are a superset of the ones the row keeps. It records its winner's
adjusted logit and its chunk's largest; the combine launch (one program per row) takes the
row's floor from those, keeps the chunks whose winner clears it (the best of a superset that is
kept is the best of the kept tokens, ties included) and races again, in that program, only the
chunks that hold kept tokens but whose winner fell short of the floor. Rows without min_p have
no slack (-inf) and never race again.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from antumbra.kernels.common import host_math
from antumbra.kernels.common.interpreter import prepare

from .reference import UNIFORM_BITS
from .triton import BLOCK, CHUNK, mix, row_keys

prepare()

_NO_ID = tl.constexpr(2**31 - 1)
_SHIFT = tl.constexpr(32 - UNIFORM_BITS)
# Halvings compiled for: the longest tile slice's bit length rounded up to one of these, so a few
# variants serve every step (a slice holds at most BLOCK entries: 11 halvings).
SEARCH_BUCKETS = (4, 7, 11)
_SCALE = tl.constexpr(2.0**-UNIFORM_BITS)


class SlotTables(NamedTuple):
    """Per-slot adjustment tables on one device, for S slots over V tokens (T = `tiles(V)`, W the
    lists' width):

    counts [S, V] int32: generated-token counts; seen [S, V] uint8: 1 where the token is in the
    prompt or was generated; scalars [S, 4] float64: frequency penalty, presence penalty,
    repetition factor and its inverse (the last two hold float32 values); ints [S, 2] int32:
    min_tokens, and which tables the slot's penalties read (`READS_COUNTS`: frequency or presence
    set; `READS_SEEN`: a repetition factor other than 1; a row reads neither table otherwise, and
    skipping one changes nothing: it would multiply by 1 or subtract 0); list_seg [S, T + 1] int32: each
    tile's slice of the slot's list; list_tok [S, W] int32: the listed tokens, sorted; list_val
    [S, 2, W] float32: their bias, and 1 where the token is banned while the row has sampled fewer
    than min_tokens tokens."""

    counts: Tensor
    seen: Tensor
    scalars: Tensor
    ints: Tensor
    list_seg: Tensor
    list_tok: Tensor
    list_val: Tensor


READS_COUNTS = 1
READS_SEEN = 2


def empty_tables(slots: int, vocab: int, width: int, device: torch.device) -> SlotTables:
    """Zeroed tables (every list empty: tokens -1) for `slots` slots."""
    return SlotTables(
        counts=torch.zeros(slots, vocab, dtype=torch.int32, device=device),
        seen=torch.zeros(slots, vocab, dtype=torch.uint8, device=device),
        scalars=torch.zeros(slots, 4, dtype=torch.float64, device=device),
        ints=torch.zeros(slots, 2, dtype=torch.int32, device=device),
        list_seg=torch.zeros(slots, tiles(vocab) + 1, dtype=torch.int32, device=device),
        list_tok=torch.full((slots, width), -1, dtype=torch.int32, device=device),
        list_val=torch.zeros(slots, 2, width, dtype=torch.float32, device=device),
    )


def tiles(vocab: int) -> int:
    """Tiles of BLOCK tokens that cover a row's chunks."""
    return host_math.cdiv(vocab, CHUNK) * (CHUNK // BLOCK)


def list_segments(tokens: Tensor, vocab: int) -> Tensor:
    """[T + 1] int32 offsets of each tile's slice of sorted `tokens` [n] int64 (host)."""
    bounds = torch.arange(tiles(vocab) + 1, dtype=torch.int64) * BLOCK
    return torch.searchsorted(tokens, bounds).to(torch.int32)


def search_for(seg: Tensor) -> int:
    """The halvings the longest slice of `seg` ([..., T + 1] int32) needs, as a compiled bucket."""
    longest = int((seg[..., 1:] - seg[..., :-1]).max()) if seg.numel() > 1 else 0
    need = longest.bit_length()  # a slice of n entries halves to empty in n.bit_length() steps
    return next(b for b in SEARCH_BUCKETS if b >= need)


@triton.jit
def _listed(x, j, slot, tile, counter, min_tokens, seg_ptr, tok_ptr, val_ptr, T1, W, SEARCH: tl.constexpr):
    """x plus the bias of the tokens of j the slot's list names (-inf: banned while counter <
    min_tokens); x itself where the tile has no entry."""
    seg_lo = tl.load(seg_ptr + slot * T1 + tile)
    seg_hi = tl.load(seg_ptr + slot * T1 + tile + 1)
    v = x
    if seg_hi > seg_lo:
        tok = tok_ptr + slot * W
        lo = tl.zeros_like(j) + seg_lo
        hi = tl.zeros_like(j) + seg_hi
        for _ in tl.static_range(SEARCH):  # lower bound of j in tok[seg_lo:seg_hi]
            active = lo < hi
            mid = (lo + hi) >> 1
            t = tl.load(tok + mid, mask=active, other=0)
            lo = tl.where(active & (t < j), mid + 1, lo)
            hi = tl.where(active & (t >= j), mid, hi)
        inside = lo < seg_hi
        hit = inside & (tl.load(tok + lo, mask=inside, other=-1) == j)
        val = val_ptr + slot * 2 * W
        bias = tl.load(val + lo, mask=hit, other=0.0)
        ban = tl.load(val + W + lo, mask=hit, other=0.0)
        bias = tl.where((ban != 0.0) & (counter < min_tokens), float("-inf"), bias)
        v = tl.where(hit, x + bias, x)
    return v


@triton.jit
def _penalised(v, j, ok, slot, reads, counts_ptr, seen_ptr, scal_ptr, V: tl.constexpr):
    """v after the repetition factor (tokens seen) and the subtracted frequency / presence
    penalties, as `penalties.py` orders them; each table read only where its penalty is set."""
    row = slot.to(tl.int64) * V
    if (reads & 2) != 0:  # READS_SEEN
        s = tl.load(seen_ptr + row + j, mask=ok, other=0)
        rep = tl.load(scal_ptr + slot * 4 + 2).to(tl.float32)
        inv = tl.load(scal_ptr + slot * 4 + 3).to(tl.float32)
        v = tl.where(s != 0, tl.where(v > 0, v * inv, v * rep), v)
    if (reads & 1) != 0:  # READS_COUNTS
        c = tl.load(counts_ptr + row + j, mask=ok, other=0)
        frequency = tl.load(scal_ptr + slot * 4)
        presence = tl.load(scal_ptr + slot * 4 + 1)
        sub = c.to(tl.float64) * frequency + tl.where(c > 0, presence, 0.0)
        v = v - sub.to(tl.float32)
    return v


@triton.jit
def _adjusted(base, j, ok, slot, tile, counter, min_tokens, reads,
              counts_ptr, seen_ptr, scal_ptr, seg_ptr, tok_ptr, val_ptr, T1, W,
              V: tl.constexpr, SEARCH: tl.constexpr):
    """The adjusted logits of tokens j (raw for a row without a slot); -inf outside `ok`."""
    x = tl.load(base + j, mask=ok, other=float("-inf")).to(tl.float32)
    if slot >= 0:
        x = _listed(x, j, slot, tile, counter, min_tokens, seg_ptr, tok_ptr, val_ptr, T1, W, SEARCH)
        if reads != 0:
            x = _penalised(x, j, ok, slot, reads, counts_ptr, seen_ptr, scal_ptr, V)
    return x


@triton.jit
def _chunk_race(
    logits_ptr, row, split, stride_row, slot, counter, min_tokens, reads,
    counts_ptr, seen_ptr, scal_ptr, seg_ptr, tok_ptr, val_ptr, T1, W,
    key_a, key_b, temperature, floor_in, slack,
    V: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, SEARCH: tl.constexpr,
    RUNNING: tl.constexpr,
):
    """Race chunk `split` of `row`: -> (best score, its id, its adjusted logit, the chunk's largest
    adjusted logit). RUNNING: cut at max(floor_in, largest so far + slack), else at floor_in."""
    greedy = temperature == 0.0
    safe_t = tl.where(greedy, 1.0, temperature)
    base = logits_ptr + row.to(tl.int64) * stride_row
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_x = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], _NO_ID, tl.int32)
    seen = float("-inf")
    for off in tl.static_range(0, CHUNK, BLOCK):
        j = split * CHUNK + off + tl.arange(0, BLOCK)
        ok = j < V
        tile = split * (CHUNK // BLOCK) + off // BLOCK
        x = _adjusted(base, j, ok, slot, tile, counter, min_tokens, reads,
                      counts_ptr, seen_ptr, scal_ptr, seg_ptr, tok_ptr, val_ptr, T1, W, V, SEARCH)
        seen = tl.maximum(seen, tl.max(x, axis=0))
        floor = tl.maximum(floor_in, seen + slack) if RUNNING else floor_in
        h = mix(mix(j.to(tl.uint32) + key_a) ^ key_b)
        u = tl.maximum(h >> _SHIFT, 1).to(tl.float32) * _SCALE
        gumbel = -tl.log(-tl.log(u))
        score = tl.where(greedy, x, x / safe_t + gumbel)
        score = tl.where(ok & (x >= floor), score, float("-inf"))
        better = score > best_v
        best_v = tl.where(better, score, best_v)
        best_i = tl.where(better, j, best_i)
        best_x = tl.where(better, x, best_x)
    top = tl.max(best_v, axis=0)
    first = tl.min(tl.where(best_v == top, best_i, _NO_ID), axis=0)
    top_x = tl.max(tl.where(best_i == first, best_x, float("-inf")), axis=0)
    return top, first, top_x, seen


@triton.jit
def _row_slot(slots_ptr, rows_ptr, ints_ptr, row, stride_rows):
    """(slot, the row's sampled-token counter, its slot's min_tokens, the tables it reads)."""
    slot = tl.load(slots_ptr + row)
    counter = tl.load(rows_ptr + 2 * stride_rows + row)
    safe = tl.maximum(slot, 0)
    min_tokens = tl.load(ints_ptr + safe * 2)
    reads = tl.load(ints_ptr + safe * 2 + 1)
    return slot, counter, min_tokens, reads


# The packed rows' stride follows the step's batch; the lists' width follows the widest list.
@triton.jit(do_not_specialize=["stride_rows", "T1", "W"])
def _slots_partial_kernel(
    logits_ptr, rows_ptr, min_ptr, slack_ptr, slots_ptr,
    counts_ptr, seen_ptr, scal_ptr, ints_ptr, seg_ptr, tok_ptr, val_ptr,
    part_v_ptr, part_i_ptr, part_x_ptr, part_m_ptr,
    stride_row, stride_rows, T1, W,
    V: tl.constexpr, S: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, SEARCH: tl.constexpr,
    HAS_CUT: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    key_a, key_b, temperature = row_keys(rows_ptr, row, stride_rows)
    slot, counter, min_tokens, reads = _row_slot(slots_ptr, rows_ptr, ints_ptr, row, stride_rows)
    slack = tl.load(slack_ptr + row)
    floor_in = tl.load(min_ptr + row) if HAS_CUT else tl.zeros_like(slack) - float("inf")
    top, first, top_x, seen = _chunk_race(
        logits_ptr, row, split, stride_row, slot, counter, min_tokens, reads,
        counts_ptr, seen_ptr, scal_ptr, seg_ptr, tok_ptr, val_ptr, T1, W,
        key_a, key_b, temperature, floor_in, slack, V, CHUNK, BLOCK, SEARCH, True,
    )
    tl.store(part_v_ptr + row * S + split, top)
    tl.store(part_i_ptr + row * S + split, first)
    tl.store(part_x_ptr + row * S + split, top_x)
    tl.store(part_m_ptr + row * S + split, seen)


@triton.jit(do_not_specialize=["stride_rows", "T1", "W"])
def _slots_combine_kernel(
    logits_ptr, rows_ptr, min_ptr, slack_ptr, slots_ptr,
    counts_ptr, seen_ptr, scal_ptr, ints_ptr, seg_ptr, tok_ptr, val_ptr,
    part_v_ptr, part_i_ptr, part_x_ptr, part_m_ptr, out_ptr,
    stride_row, stride_rows, T1, W,
    V: tl.constexpr, S: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, SEARCH: tl.constexpr,
    HAS_CUT: tl.constexpr, BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    ok = s < S
    v = tl.load(part_v_ptr + row * S + s, mask=ok, other=float("-inf"))
    i = tl.load(part_i_ptr + row * S + s, mask=ok, other=_NO_ID)
    x = tl.load(part_x_ptr + row * S + s, mask=ok, other=float("-inf"))
    m = tl.load(part_m_ptr + row * S + s, mask=ok, other=float("-inf"))
    slack = tl.load(slack_ptr + row)
    floor = tl.load(min_ptr + row) if HAS_CUT else tl.zeros_like(slack) - float("inf")
    floor = tl.maximum(floor, tl.max(m, axis=0) + slack)  # slack -inf: no min_p, floor unchanged
    valid = ok & (x >= floor)
    v = tl.where(valid, v, float("-inf"))
    top = tl.max(v, axis=0)
    first = tl.min(tl.where(valid & (v == top), i, _NO_ID), axis=0)
    redo = ok & (m >= floor) & (x < floor)
    if tl.sum(redo.to(tl.int32), axis=0) > 0:
        key_a, key_b, temperature = row_keys(rows_ptr, row, stride_rows)
        slot, counter, min_tokens, reads = _row_slot(slots_ptr, rows_ptr, ints_ptr, row, stride_rows)
        for split in range(0, S):
            chunk_max = tl.load(part_m_ptr + row * S + split)
            winner_x = tl.load(part_x_ptr + row * S + split)
            if (chunk_max >= floor) & (winner_x < floor):
                cv, ci, _, _ = _chunk_race(
                    logits_ptr, row, split, stride_row, slot, counter, min_tokens, reads,
                    counts_ptr, seen_ptr, scal_ptr, seg_ptr, tok_ptr, val_ptr, T1, W,
                    key_a, key_b, temperature, floor, slack, V, CHUNK, BLOCK, SEARCH, False,
                )
                better = (cv > top) | ((cv == top) & (ci < first))
                top = tl.where(better, cv, top)
                first = tl.where(better, ci, first)
    tl.store(out_ptr + row, tl.where(first == _NO_ID, 0, first).to(tl.int64))


class AdjustedWorkspace:
    """Partials of `race_sample_slots` for up to `rows` rows of a `vocab`-wide batch."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.splits = host_math.cdiv(vocab, CHUNK)
        self.values = torch.empty(4, rows, self.splits, dtype=torch.float32, device=device)
        self.ids = torch.empty(rows, self.splits, dtype=torch.int32, device=device)


def race_sample_slots(
    logits: Tensor,
    rows_in: Tensor,
    min_logit: Tensor | None,
    slack: Tensor,
    slots: Tensor,
    tables: SlotTables,
    search: int,
    *,
    out: Tensor | None = None,
    workspace: AdjustedWorkspace | None = None,
) -> Tensor:
    """As `race_sample_slots_reference`, all inputs on the logits' device: logits [B, V]
    float32/bf16 (unit stride along V); rows_in [4, B] int32; min_logit [B] float32 or None (no
    cut); slack [B] float32; slots [B] int32 (-1: no slot); `tables` as `SlotTables` describes,
    contiguous; `search` from `search_for` over the slots' segments -> [B] int64. Reads only."""
    batch, vocab = logits.shape
    assert logits.stride(1) == 1 and logits.dtype in (torch.float32, torch.bfloat16)
    assert rows_in.shape == (4, batch) and rows_in.dtype == torch.int32 and rows_in.stride(1) == 1
    assert slack.shape == (batch,) and slack.dtype == torch.float32 and slack.is_contiguous()
    assert slots.shape == (batch,) and slots.dtype == torch.int32 and slots.is_contiguous()
    assert tables.counts.shape[1] == vocab and tables.list_seg.shape[1] == tiles(vocab) + 1
    assert all(t.is_contiguous() for t in tables)
    if out is None:
        out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    if workspace is None:
        workspace = AdjustedWorkspace(batch, vocab, logits.device)
    splits = workspace.splits
    assert workspace.ids.shape[0] >= batch and workspace.vocab == vocab
    has_cut = min_logit is not None
    cut = min_logit if min_logit is not None else slack  # not read without a cut
    part_v, part_x, part_m = workspace.values[0], workspace.values[1], workspace.values[2]
    shared = (logits, rows_in, cut, slack, slots, *tables, part_v, workspace.ids, part_x, part_m)
    sizes = (logits.stride(0), rows_in.stride(0), tables.list_seg.shape[1], tables.list_tok.shape[1])
    meta = dict(V=vocab, S=splits, CHUNK=CHUNK, BLOCK=BLOCK, SEARCH=search, HAS_CUT=has_cut)
    _slots_partial_kernel[(batch, splits)](*shared, *sizes, **meta, num_warps=4)
    _slots_combine_kernel[(batch,)](
        *shared, out, *sizes, **meta, BLOCK_S=max(16, host_math.next_power_of_2(splits)), num_warps=4,
    )
    return out
