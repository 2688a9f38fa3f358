"""Allowed-token masks: a packed int32 bitmask per row, and logits with the banned tokens at -inf.

A row's mask holds `ceil(V / 32)` int32 words; token t is allowed when bit `t % 32` of word
`t // 32` is set (little-endian bit order within a word, as llguidance and xgrammar fill them).
A row of all ones (-1 words) leaves its logits unchanged, which is how a batch mixes constrained
and unconstrained rows in one launch. Bits past the vocabulary are ignored; a mask narrower than
the vocabulary bans the tokens it does not cover.
"""

from __future__ import annotations

import torch
from torch import Tensor


def words_for(vocab_size: int) -> int:
    """int32 words of one row's mask."""
    return (vocab_size + 31) // 32


def unpack_bits_reference(bitmask: Tensor, vocab_size: int) -> Tensor:
    """bitmask: [B, W] int32 -> [B, vocab_size] bool (True: allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.to(torch.int32)[:, :, None] >> shifts) & 1  # [B, W, 32]
    allowed = bits.reshape(bitmask.shape[0], -1).bool()[:, :vocab_size]
    if allowed.shape[1] < vocab_size:  # a narrow mask bans what it does not cover
        pad = torch.zeros(bitmask.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool,
                          device=bitmask.device)
        allowed = torch.cat([allowed, pad], dim=1)
    return allowed


def apply_token_mask_reference(logits: Tensor, bitmask: Tensor, out: Tensor | None = None) -> Tensor:
    """logits [B, V] float, bitmask [B, W] int32 -> out [B, V] (a new tensor unless given; it may be
    `logits` itself) with every banned token at -inf and the rest copied."""
    if bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {logits.shape[0]} rows of logits")
    allowed = unpack_bits_reference(bitmask.to(logits.device), logits.shape[1])
    result = logits.masked_fill(~allowed, float("-inf"))
    if out is None:
        return result
    out.copy_(result)
    return out


def pack_allowed_reference(allowed: Tensor) -> Tensor:
    """[B, V] bool -> [B, ceil(V / 32)] int32 bitmask (the inverse of `unpack_bits_reference`)."""
    batch, vocab = allowed.shape
    words = words_for(vocab)
    padded = torch.zeros(batch, words * 32, dtype=torch.int64, device=allowed.device)
    padded[:, :vocab] = allowed.to(torch.int64)
    weights = (1 << torch.arange(32, dtype=torch.int64, device=allowed.device))
    packed = (padded.view(batch, words, 32) * weights).sum(dim=-1)  # [B, W] in [0, 2^32)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
