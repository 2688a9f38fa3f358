"""A step's drawn tokens counted into their rows' penalty slots, in one launch (see
`count_drawn_reference`).

Program b reads row b's slot (-1: none, which counts into the scratch row no slot reads) and drawn
token, adds one to `counts[slot, token]` and sets `seen[slot, token]`. The add is atomic: padded
rows all count into the scratch row. The torch chain is a where, a cast, the flat index's two
launches, a ones fill and two scatters, each at decode sizes costing more than its work; counts are
integers, so the launch gives the chain's tables exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from antumbra.kernels.common.interpreter import prepare

prepare()


@triton.jit
def _count_kernel(
    tokens_ptr,  # *int [B] drawn tokens
    slots_ptr,  # *int [B] slots, -1: none
    counts_ptr,  # *i32 [S + 1, V] in/out
    seen_ptr,  # *u8 [S + 1, V] in/out
    scratch,  # the scratch row (S)
    V,
):
    b = tl.program_id(0)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    slot = tl.where(slot >= 0, slot, scratch)
    offset = slot * V + tl.load(tokens_ptr + b).to(tl.int64)
    tl.atomic_add(counts_ptr + offset, 1, sem="relaxed")
    tl.store(seen_ptr + offset, 1)


def count_drawn(tokens: Tensor, slots: Tensor, counts: Tensor, seen: Tensor, scratch: int) -> None:
    """As `count_drawn_reference`: tokens [B] integer, slots [B] integer (-1: none), counts
    [S + 1, V] int32 and seen [S + 1, V] uint8 contiguous, scratch the row slot -1 counts into;
    every tensor on one device."""
    assert tokens.shape == slots.shape and tokens.dim() == 1, "tokens and slots must be one [B] shape"
    assert counts.dtype == torch.int32 and seen.dtype == torch.uint8 and counts.shape == seen.shape
    assert counts.is_contiguous() and seen.is_contiguous() and 0 <= scratch < counts.shape[0]
    if tokens.numel():
        _count_kernel[(tokens.shape[0],)](tokens, slots, counts, seen, scratch, counts.shape[1], num_warps=1)


def count_drawn_reference(tokens: Tensor, slots: Tensor, counts: Tensor, seen: Tensor, scratch: int) -> None:
    """counts[slot, token] += 1 and seen[slot, token] = 1 for each row's (slot, drawn token); a row
    without a slot (-1) counts into row `scratch`."""
    index = torch.where(slots >= 0, slots.long(), scratch)
    flat = index * counts.shape[1] + tokens.long()
    counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    seen.view(-1).scatter_(0, flat, 1)
