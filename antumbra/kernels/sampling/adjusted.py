"""The Gumbel race over adjusted logits (penalties, logit bias, bans, min_p) in the race's two
launches: `race_sample_adjusted_reference` (reference.py) is the definition.

Nothing is written to the logits and no adjusted copy exists. Each program of the partial launch
(row b, chunk s of `CHUNK` tokens, as `triton.py`'s) reads its chunk in tiles of `BLOCK` tokens
and finds, for every token of a tile, whether the row has an entry for it by a binary search of
that (row, tile)'s slice of the sorted entry tokens (`SEARCH` halvings: enough for the longest
slice of the step; slices are offsets the host computes, so a tile without entries, a plain
row's or most of a penalised row's, skips the search), and applies the entry in registers.

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

import torch
import triton
import triton.language as tl
from torch import Tensor

from antumbra.kernels.common.interpreter import prepare

from .reference import UNIFORM_BITS
from .triton import BLOCK, CHUNK, mix, row_keys

prepare()

_NO_ID = tl.constexpr(2**31 - 1)
_SHIFT = tl.constexpr(32 - UNIFORM_BITS)
# Halvings compiled for: the longest slice's bit length rounded up to one of these, so a few
# variants serve every step (a slice holds at most BLOCK entries: 11 halvings).
SEARCH_BUCKETS = (4, 7, 11)
_SCALE = tl.constexpr(2.0**-UNIFORM_BITS)


@triton.jit
def _adjusted(base, j, ok, tok_ptr, adj_ptr, stride_adj, seg_lo, seg_hi, SEARCH: tl.constexpr):
    """The adjusted logits of tokens j (raw where the row has no entry); -inf outside `ok`."""
    x = tl.load(base + j, mask=ok, other=float("-inf")).to(tl.float32)
    if seg_hi > seg_lo:  # a chunk without entries (a plain row's) skips the search
        x = _apply_entries(x, j, tok_ptr, adj_ptr, stride_adj, seg_lo, seg_hi, SEARCH)
    return x


@triton.jit
def _apply_entries(x, j, tok_ptr, adj_ptr, stride_adj, seg_lo, seg_hi, SEARCH: tl.constexpr):
    """x with the entries of tok[seg_lo:seg_hi] (sorted) applied where they name a token of j."""
    lo = tl.zeros_like(j) + seg_lo
    hi = tl.zeros_like(j) + seg_hi
    for _ in tl.static_range(SEARCH):  # lower bound of j in tok[seg_lo:seg_hi]
        active = lo < hi
        mid = (lo + hi) >> 1
        t = tl.load(tok_ptr + mid, mask=active, other=0)
        right = t < j
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & (t >= j), mid, hi)
    inside = lo < seg_hi
    hit = inside & (tl.load(tok_ptr + lo, mask=inside, other=-1) == j)
    bias = tl.load(adj_ptr + lo, mask=hit, other=0.0)
    inv = tl.load(adj_ptr + stride_adj + lo, mask=hit, other=1.0)
    rep = tl.load(adj_ptr + 2 * stride_adj + lo, mask=hit, other=1.0)
    sub = tl.load(adj_ptr + 3 * stride_adj + lo, mask=hit, other=0.0)
    v = x + bias
    v = tl.where(v > 0, v * inv, v * rep) - sub
    return tl.where(hit, v, x)


@triton.jit
def _chunk_race(
    logits_ptr, row, split, stride_row, tok_ptr, adj_ptr, stride_adj, seg_ptr,
    key_a, key_b, temperature, floor_in, slack,
    V: tl.constexpr, S: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, SEARCH: tl.constexpr,
    RUNNING: tl.constexpr,
):
    """Race chunk `split` of `row`: -> (best score, its id, its adjusted logit, the chunk's largest
    adjusted logit). RUNNING: cut at max(floor_in, largest so far + slack), else at floor_in."""
    TILES: tl.constexpr = S * (CHUNK // BLOCK)
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
        tile = row * (TILES + 1) + split * (CHUNK // BLOCK) + off // BLOCK
        seg_lo = tl.load(seg_ptr + tile)
        seg_hi = tl.load(seg_ptr + tile + 1)
        x = _adjusted(base, j, ok, tok_ptr, adj_ptr, stride_adj, seg_lo, seg_hi, SEARCH)
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


# The strides of the packed rows and of the entries follow the step's batch and entry count.
@triton.jit(do_not_specialize=["stride_rows", "stride_adj"])
def _adjusted_partial_kernel(
    logits_ptr, rows_ptr, min_ptr, slack_ptr, seg_ptr, tok_ptr, adj_ptr,
    part_v_ptr, part_i_ptr, part_x_ptr, part_m_ptr,
    stride_row, stride_rows, stride_adj,
    V: tl.constexpr, S: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, SEARCH: tl.constexpr,
    HAS_CUT: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    key_a, key_b, temperature = row_keys(rows_ptr, row, stride_rows)
    slack = tl.load(slack_ptr + row)
    floor_in = tl.load(min_ptr + row) if HAS_CUT else tl.zeros_like(slack) - float("inf")
    top, first, top_x, seen = _chunk_race(
        logits_ptr, row, split, stride_row, tok_ptr, adj_ptr, stride_adj, seg_ptr,
        key_a, key_b, temperature, floor_in, slack, V, S, CHUNK, BLOCK, SEARCH, True,
    )
    tl.store(part_v_ptr + row * S + split, top)
    tl.store(part_i_ptr + row * S + split, first)
    tl.store(part_x_ptr + row * S + split, top_x)
    tl.store(part_m_ptr + row * S + split, seen)


@triton.jit(do_not_specialize=["stride_rows", "stride_adj"])
def _adjusted_combine_kernel(
    logits_ptr, rows_ptr, min_ptr, slack_ptr, seg_ptr, tok_ptr, adj_ptr,
    part_v_ptr, part_i_ptr, part_x_ptr, part_m_ptr, out_ptr,
    stride_row, stride_rows, stride_adj,
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
        for split in range(0, S):
            chunk_max = tl.load(part_m_ptr + row * S + split)
            winner_x = tl.load(part_x_ptr + row * S + split)
            if (chunk_max >= floor) & (winner_x < floor):
                cv, ci, _, _ = _chunk_race(
                    logits_ptr, row, split, stride_row, tok_ptr, adj_ptr, stride_adj, seg_ptr,
                    key_a, key_b, temperature, floor, slack, V, S, CHUNK, BLOCK, SEARCH, False,
                )
                better = (cv > top) | ((cv == top) & (ci < first))
                top = tl.where(better, cv, top)
                first = tl.where(better, ci, first)
    tl.store(out_ptr + row, tl.where(first == _NO_ID, 0, first).to(tl.int64))


class AdjustedWorkspace:
    """Partials of `race_sample_adjusted` for up to `rows` rows of a `vocab`-wide batch."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.splits = triton.cdiv(vocab, CHUNK)
        self.values = torch.empty(4, rows, self.splits, dtype=torch.float32, device=device)
        self.ids = torch.empty(rows, self.splits, dtype=torch.int32, device=device)


def entry_segments(rows: Tensor, tokens: Tensor, batch: int, vocab: int) -> tuple[Tensor, int]:
    """Host side: [B, T + 1] int32 offsets of each (row, tile of BLOCK tokens)'s slice of the
    sorted entries (T tiles cover the row's chunks), and the halvings to compile for (enough for
    the longest slice). rows / tokens [E] int64 (CPU)."""
    tiles = triton.cdiv(vocab, CHUNK) * (CHUNK // BLOCK)
    span = tiles * BLOCK
    keys = rows * span + tokens
    bounds = torch.arange(batch)[:, None] * span + torch.arange(tiles + 1)[None, :] * BLOCK
    seg = torch.searchsorted(keys, bounds.reshape(-1)).view(batch, tiles + 1)
    longest = int((seg[:, 1:] - seg[:, :-1]).max()) if tokens.numel() else 0
    need = longest.bit_length()  # a slice of n entries halves to empty in n.bit_length() steps
    return seg.to(torch.int32), next(b for b in SEARCH_BUCKETS if b >= need)


def race_sample_adjusted(
    logits: Tensor,
    rows_in: Tensor,
    min_logit: Tensor | None,
    slack: Tensor,
    seg: Tensor,
    tokens: Tensor,
    values: Tensor,
    search: int,
    *,
    out: Tensor | None = None,
    workspace: AdjustedWorkspace | None = None,
) -> Tensor:
    """As `race_sample_adjusted_reference`, all inputs on the logits' device: logits [B, V]
    float32/bf16 (unit stride along V); rows_in [4, B] int32; min_logit [B] float32 or None (no
    cut); slack [B] float32; seg [B, S + 1] int32 and `search` from `entry_segments`; tokens [E]
    int32; values [4, E] float32 (a column slice of a wider buffer is fine) -> [B] int64."""
    batch, vocab = logits.shape
    assert logits.stride(1) == 1 and logits.dtype in (torch.float32, torch.bfloat16)
    assert rows_in.shape == (4, batch) and rows_in.dtype == torch.int32 and rows_in.stride(1) == 1
    assert slack.shape == (batch,) and slack.dtype == torch.float32 and slack.is_contiguous()
    assert tokens.dtype == torch.int32 and values.dtype == torch.float32 and values.stride(1) == 1
    assert values.shape == (4, tokens.shape[0]) and seg.dtype == torch.int32 and seg.is_contiguous()
    if out is None:
        out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    if workspace is None:
        workspace = AdjustedWorkspace(batch, vocab, logits.device)
    splits = workspace.splits
    assert seg.shape == (batch, splits * (CHUNK // BLOCK) + 1) and workspace.ids.shape[0] >= batch
    has_cut = min_logit is not None
    cut = min_logit if min_logit is not None else slack  # not read without a cut
    part_v, part_x, part_m = workspace.values[0], workspace.values[1], workspace.values[2]
    shared = (logits, rows_in, cut, slack, seg, tokens, values, part_v, workspace.ids, part_x, part_m)
    strides = (logits.stride(0), rows_in.stride(0), values.stride(0))
    meta = dict(V=vocab, S=splits, CHUNK=CHUNK, BLOCK=BLOCK, SEARCH=search, HAS_CUT=has_cut)
    _adjusted_partial_kernel[(batch, splits)](*shared, *strides, **meta, num_warps=4)
    _adjusted_combine_kernel[(batch,)](
        *shared, out, *strides, **meta, BLOCK_S=max(16, triton.next_power_of_2(splits)), num_warps=4,
    )
    return out
