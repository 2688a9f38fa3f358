"""Counter-based sampling noise and the Gumbel race, in plain PyTorch: the definition the kernel
reproduces.

A row draws token j with probability softmax(l / T)_j by taking

    argmax_j  l_j / T + G_j,      G_j = -log(-log(u_j))   (Gumbel(0, 1))

over the tokens whose raw logit is at least the row's `min_logit` (top-k / top-p cut), or
`argmax_j l_j` when T == 0. The uniforms are not drawn from a generator: they are a pure
function of the row's 64-bit seed (two 32-bit halves s_lo, s_hi), the number of tokens its
request has sampled (the counter c) and the token id j:

    a = mix(s_lo ^ mix(c + K1)),  b = mix(s_hi ^ mix(a + K2))        (the row's keys)
    h_j = mix(mix((j + a) mod 2^32) ^ b),   u_j = max(h_j >> 8, 1) * 2^-24

where `mix` is a bijective 32-bit avalanche (xor-shift / multiply rounds, multiplies mod 2^32).
A request's draws therefore depend on nothing but its seed and its own progress: not on the
batch around it, its row, the device, or whether the step was replayed from a CUDA graph; and
the host hands the device seeds and counters, never per-row hashes. u_j takes 2^24 - 1 values
in (0, 1), so -log(u_j) is never 0 and G_j is finite (between about -2.8 and 16.6).
"""

from __future__ import annotations

import torch
from torch import Tensor

MIX_MUL_1 = 0x7FEB352D
MIX_MUL_2 = 0x846CA68B
KEY_ADD_1 = 0x9E3779B9  # odd constants that keep a zero seed and a zero counter apart
KEY_ADD_2 = 0x7F4A7C15
UNIFORM_BITS = 24
_MASK32 = 0xFFFFFFFF


def as_int32(value: int) -> int:
    """A uint32 bit pattern as the int32 that stores it (rows travel in int32 tensors)."""
    value &= _MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


def pack_rows(seeds: list[int], counters: list[int], temperatures: list[float]) -> Tensor:
    """The race's per-row inputs as one [4, B] int32 tensor: the seed's low and high 32 bits, the
    counter, and the temperature's float32 bits (0 = greedy), so they reach the device in one copy."""
    # One tensor built from one nested list: a decode step packs every row, every step.
    bits = torch.tensor(temperatures, dtype=torch.float32).view(torch.int32).tolist()
    low, high = [as_int32(s) for s in seeds], [as_int32(s >> 32) for s in seeds]
    return torch.tensor([low, high, [as_int32(c) for c in counters], bits], dtype=torch.int32)


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), without int64 overflow (16-bit limbs)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _MASK32


def _mix(x: Tensor) -> Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_MUL_1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_MUL_2)
    return x ^ (x >> 16)


def _u32(x: Tensor) -> Tensor:
    return x.to(torch.int64) & _MASK32


def row_keys_reference(rows: Tensor) -> tuple[Tensor, Tensor]:
    """rows: [4, B] int32 (`pack_rows`) -> the keys (a, b): [B] int64 holding uint32 values."""
    seed_lo, seed_hi, counter = _u32(rows[0]), _u32(rows[1]), _u32(rows[2])
    a = _mix(seed_lo ^ _mix((counter + KEY_ADD_1) & _MASK32))
    b = _mix(seed_hi ^ _mix((a + KEY_ADD_2) & _MASK32))
    return a, b


def noise_bits_reference(rows: Tensor, vocab: int) -> Tensor:
    """rows: [4, B] int32 -> [B, V] int64 holding the uint32 h_j."""
    a, b = row_keys_reference(rows)
    j = torch.arange(vocab, dtype=torch.int64, device=rows.device)  # [V]
    h = _mix((j[None, :] + a[:, None]) & _MASK32)
    return _mix(h ^ b[:, None])


def gumbel_reference(rows: Tensor, vocab: int) -> Tensor:
    """rows: [4, B] int32 -> [B, V] float32 Gumbel(0, 1) noise."""
    bits = (noise_bits_reference(rows, vocab) >> (32 - UNIFORM_BITS)).clamp_min(1)
    u = bits.to(torch.float32) * 2.0**-UNIFORM_BITS
    return -torch.log(-torch.log(u))


def race_sample_reference(logits: Tensor, rows: Tensor, min_logit: Tensor) -> Tensor:
    """One token per row.

    logits: [B, V] float (read as float32); rows: [4, B] int32 as `pack_rows` lays it out;
    min_logit: [B] float32, tokens with a smaller raw logit are excluded (-inf: none)
    -> [B] int64 token ids (the lowest id among exact ties).
    """
    temperature = rows[3].contiguous().view(torch.float32)  # [B] float32
    raw = logits.float()
    if not bool((temperature != 0).any()):  # all greedy: skip drawing noise over the whole vocabulary
        return raw.masked_fill(raw < min_logit[:, None], float("-inf")).argmax(dim=-1)
    greedy = temperature[:, None] == 0
    safe_t = torch.where(temperature == 0, torch.ones_like(temperature), temperature)
    score = torch.where(greedy, raw, raw / safe_t[:, None] + gumbel_reference(rows, raw.shape[1]))
    score = score.masked_fill(raw < min_logit[:, None], float("-inf"))
    return score.argmax(dim=-1)


# ------------------------------------------------------------------ the race over adjusted logits
#
# Sparse logit adjustments (`replicas/penalties.py` builds them): entry e changes the logit of
# token tokens[e] in row rows[e] (entries sorted by row, then token) to
#
#     v = l + bias_e;   v = v * inv_e if v > 0 else v * rep_e;   v = v - sub_e
#
# with values[:, e] = (bias, inv, rep, sub): `inv` is 1 / repetition penalty rounded once to
# float32, so the kernel's arithmetic is the same multiplications, bit for bit. A bias of -inf
# bans the token. min_p is a per-row `slack` (T * ln(min_p) in float32, -inf: none): the row keeps
# the tokens whose adjusted logit is at least its largest adjusted logit plus the slack.


def adjust_reference(logits: Tensor, rows: Tensor, tokens: Tensor, values: Tensor) -> None:
    """Apply the entries to logits [B, V] float32 in place. rows / tokens [E] int64 on any
    device, values [4, E] float32 (bias, inv, rep, sub)."""
    if tokens.numel() == 0:
        return
    device = logits.device
    rows, tokens = rows.to(device, non_blocking=True), tokens.to(device, non_blocking=True)
    bias, inv, rep, sub = values.to(device, non_blocking=True)
    v = logits[rows, tokens] + bias
    logits[rows, tokens] = torch.where(v > 0, v * inv, v * rep) - sub


def min_p_floor_reference(adjusted: Tensor, slack: Tensor) -> Tensor:
    """[B] float32: the smallest adjusted logit min_p keeps in each row (-inf where slack is)."""
    floor = adjusted.amax(dim=-1) + slack
    return torch.where(slack == float("-inf"), slack, floor)


def race_sample_adjusted_reference(
    logits: Tensor,
    rows_in: Tensor,
    min_logit: Tensor,
    entries: tuple[Tensor, Tensor, Tensor],
    slack: Tensor,
) -> Tensor:
    """`race_sample_reference` over the adjusted logits, each row also cut at its min_p floor.

    logits [B, V] float (not modified); rows_in [4, B] int32; min_logit [B] float32 (a cut on the
    adjusted logits, -inf: none); entries (rows, tokens, values) as `adjust_reference` takes
    them; slack [B] float32 -> [B] int64."""
    adjusted = logits.float().clone()
    adjust_reference(adjusted, *entries)
    floor = torch.maximum(min_logit, min_p_floor_reference(adjusted, slack))
    return race_sample_reference(adjusted, rows_in, floor)


# ------------------------------------------------------------------ the same from per-slot tables
#
# `resident.py`'s `SlotTables` hold each slot's counts c_j, prompt-or-output membership s_j,
# scalars (frequency, presence, repetition factor r and its inverse, float32 values) and a sorted
# list of (token, bias, ban) entries. A row with slot k has, for every token j,
#
#     v = l + bias_j   (-inf instead where j is banned and the row's counter < min_tokens)
#     v = v * inv if v > 0 else v * r,   where s_j               (when r != 1)
#     v = v - f32(c_j * frequency + (c_j > 0) * presence)        (in float64, rounded once;
#                                                                 when either is set)
#
# which is the sparse entries' arithmetic on every token (an unlisted, unseen token is unchanged).


def adjust_slots_reference(
    logits: Tensor, counters: Tensor, slots: Tensor, tables: tuple[Tensor, ...]
) -> None:
    """Apply each slotted row's adjustments to logits [B, V] float32 in place. counters [B] int64
    (tokens each row has sampled), slots [B] int64 (-1: none), both on the logits' device;
    `tables` a `resident.SlotTables` on that device."""
    counts, seen, scalars, ints, _, list_tok, list_val = tables
    rows = (slots >= 0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return
    vocab = logits.shape[1]
    slot = slots[rows]
    tok = list_tok[slot].long()  # [R, W], -1 past each list's end
    listed = tok >= 0
    column = torch.where(listed, tok, vocab)
    values = list_val[slot]  # [R, 2, W]
    banned = (values[:, 1] != 0) & (counters[rows] < ints[slot, 0])[:, None]
    entry_bias = torch.where(banned, float("-inf"), values[:, 0])
    wide = torch.zeros(rows.numel(), vocab + 1, dtype=torch.float32, device=logits.device)
    hit = torch.zeros(rows.numel(), vocab + 1, dtype=torch.bool, device=logits.device)
    wide.scatter_(1, column, torch.where(listed, entry_bias, 0.0))
    hit.scatter_(1, column, listed)
    x = logits[rows]
    v = torch.where(hit[:, :vocab], x + wide[:, :vocab], x)
    reads_seen = ((ints[slot, 1] & 2) != 0)[:, None]  # resident.READS_SEEN
    reads_counts = ((ints[slot, 1] & 1) != 0)[:, None]  # resident.READS_COUNTS
    frequency, presence = scalars[slot, 0, None], scalars[slot, 1, None]
    rep, inv = scalars[slot, 2, None].float(), scalars[slot, 3, None].float()
    c = counts[slot]
    v = torch.where(reads_seen & (seen[slot] != 0), torch.where(v > 0, v * inv, v * rep), v)
    sub = (c.double() * frequency + torch.where(c > 0, presence, 0.0)).float()
    logits[rows] = torch.where(reads_counts, v - sub, v)


def race_sample_slots_reference(
    logits: Tensor,
    rows_in: Tensor,
    min_logit: Tensor,
    slots: Tensor,
    tables: tuple[Tensor, ...],
    slack: Tensor,
) -> Tensor:
    """`race_sample_reference` over the logits adjusted from the slot tables, each row also cut at
    its min_p floor. logits [B, V] float (not modified); rows_in [4, B] int32; min_logit [B]
    float32 (a cut on the adjusted logits, -inf: none); slots [B] int (-1: none); slack [B] float32
    -> [B] int64."""
    adjusted = logits.float().clone()
    adjust_slots_reference(adjusted, rows_in[2].long(), slots.long(), tables)
    floor = torch.maximum(min_logit, min_p_floor_reference(adjusted, slack))
    return race_sample_reference(adjusted, rows_in, floor)
