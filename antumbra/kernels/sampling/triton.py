"""The Gumbel race over a batch of logits in two launches (see `reference.py` for the definition).

1. `_race_partial_kernel`, grid (B, S): program (b, s) walks `CHUNK` vocabulary entries of row b,
   computes each entry's noise from the row's keys in registers (no noise tensor exists), and
   keeps per lane the best score and the first id reaching it; it writes the chunk's best
   (score, id) to a [B, S] workspace.
2. `_race_combine_kernel`, grid (B,): the best of a row's S partials, lowest id among equal
   scores, so exact ties resolve to the lowest token id as `torch.argmax` does.

S = ceil(V / CHUNK) is fixed by the vocabulary, so one compiled variant serves every batch size
and both launches can be captured in a CUDA graph (all inputs are device tensors). The split
keeps a batch of one row spread over the multiprocessors; the race reads each logit once.
NaN logits never win (a NaN score fails every comparison).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from antumbra.kernels.common import host_math
from antumbra.kernels.common.interpreter import prepare

from .reference import KEY_ADD_1, KEY_ADD_2, MIX_MUL_1, MIX_MUL_2, UNIFORM_BITS

prepare()

# One tile a chunk: V4's vocabulary then makes about one program per multiprocessor at batch 1,
# where the noise's arithmetic, not the logits' bytes, bounds each program.
CHUNK = 1024
BLOCK = 1024
_NO_ID = tl.constexpr(2**31 - 1)
_MUL_1 = tl.constexpr(MIX_MUL_1)
_MUL_2 = tl.constexpr(MIX_MUL_2)
_ADD_1 = tl.constexpr(KEY_ADD_1)
_ADD_2 = tl.constexpr(KEY_ADD_2)
_SHIFT = tl.constexpr(32 - UNIFORM_BITS)
_SCALE = tl.constexpr(2.0**-UNIFORM_BITS)


@triton.jit
def mix(x):
    """The reference's 32-bit avalanche on uint32 lanes (multiplies wrap mod 2^32)."""
    x = x ^ (x >> 16)
    x = x * _MUL_1
    x = x ^ (x >> 15)
    x = x * _MUL_2
    return x ^ (x >> 16)


@triton.jit
def row_keys(rows_ptr, row, stride_rows):
    """Row `row` of the packed [4, B] rows -> (key a, key b, temperature) of its noise."""
    seed_lo = tl.load(rows_ptr + row).to(tl.uint32, bitcast=True)
    seed_hi = tl.load(rows_ptr + stride_rows + row).to(tl.uint32, bitcast=True)
    counter = tl.load(rows_ptr + 2 * stride_rows + row).to(tl.uint32, bitcast=True)
    temperature = tl.load(rows_ptr + 3 * stride_rows + row).to(tl.float32, bitcast=True)
    key_a = mix(seed_lo ^ mix(counter + _ADD_1))
    key_b = mix(seed_hi ^ mix(key_a + _ADD_2))
    return key_a, key_b, temperature


# The packed rows' stride is the batch size of whoever built them: not worth a variant per size.
@triton.jit(do_not_specialize=["stride_rows"])
def _race_partial_kernel(
    logits_ptr,  # *f32/bf16 [B, V] with row stride `stride_row`
    rows_ptr,  # *i32 [4, B], row stride `stride_rows`: seed low / high bits, counter, temperature's f32 bits
    min_ptr,  # *f32 [B] raw-logit cut (-inf: none)
    part_v_ptr,  # *f32 [B, S] out
    part_i_ptr,  # *i32 [B, S] out
    stride_row,
    stride_rows,
    V: tl.constexpr,
    S: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    key_a, key_b, temperature = row_keys(rows_ptr, row, stride_rows)
    min_logit = tl.load(min_ptr + row)
    greedy = temperature == 0.0
    safe_t = tl.where(greedy, 1.0, temperature)
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], _NO_ID, tl.int32)
    base = logits_ptr + row.to(tl.int64) * stride_row
    for off in tl.static_range(0, CHUNK, BLOCK):
        j = split * CHUNK + off + tl.arange(0, BLOCK)
        ok = j < V
        logit = tl.load(base + j, mask=ok, other=float("-inf")).to(tl.float32)
        h = mix(mix(j.to(tl.uint32) + key_a) ^ key_b)
        u = tl.maximum(h >> _SHIFT, 1).to(tl.float32) * _SCALE
        gumbel = -tl.log(-tl.log(u))
        score = tl.where(greedy, logit, logit / safe_t + gumbel)
        score = tl.where(ok & (logit >= min_logit), score, float("-inf"))
        better = score > best_v
        best_v = tl.where(better, score, best_v)
        best_i = tl.where(better, j, best_i)
    top = tl.max(best_v, axis=0)
    first = tl.min(tl.where(best_v == top, best_i, _NO_ID), axis=0)
    tl.store(part_v_ptr + row * S + split, top)
    tl.store(part_i_ptr + row * S + split, first)


@triton.jit
def _race_combine_kernel(part_v_ptr, part_i_ptr, out_ptr, S: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    ok = s < S
    v = tl.load(part_v_ptr + row * S + s, mask=ok, other=float("-inf"))
    i = tl.load(part_i_ptr + row * S + s, mask=ok, other=_NO_ID)
    top = tl.max(v, axis=0)
    first = tl.min(tl.where(v == top, i, _NO_ID), axis=0)
    # A row with every entry excluded (or NaN) falls back to token 0, as argmax over -inf does.
    tl.store(out_ptr + row, tl.where(first == _NO_ID, 0, first).to(tl.int64))


class RaceWorkspace:
    """Partials of `race_sample` for up to `rows` rows of a `vocab`-wide batch (reused per step)."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.splits = host_math.cdiv(vocab, CHUNK)
        self.values = torch.empty(rows, self.splits, dtype=torch.float32, device=device)
        self.ids = torch.empty(rows, self.splits, dtype=torch.int32, device=device)


def race_sample(
    logits: Tensor,
    rows_in: Tensor,
    min_logit: Tensor,
    *,
    out: Tensor | None = None,
    workspace: RaceWorkspace | None = None,
) -> Tensor:
    """As `race_sample_reference`: logits [B, V] float32/bf16 (unit stride along V); rows_in
    [4, B] int32 (`pack_rows`' layout; a column slice of a wider buffer is fine); min_logit [B]
    float32; all on one device -> [B] int64."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and logits.dtype in (torch.float32, torch.bfloat16)
    assert rows_in.shape == (4, rows) and rows_in.dtype == torch.int32 and rows_in.stride(1) == 1
    assert min_logit.shape == (rows,) and min_logit.dtype == torch.float32 and min_logit.is_contiguous()
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if workspace is None:
        workspace = RaceWorkspace(rows, vocab, logits.device)
    splits = workspace.splits
    assert workspace.values.shape[0] >= rows and workspace.values.shape[1] == splits
    _race_partial_kernel[(rows, splits)](
        logits, rows_in, min_logit, workspace.values, workspace.ids, logits.stride(0), rows_in.stride(0),
        V=vocab, S=splits, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4,
    )
    _race_combine_kernel[(rows,)](
        workspace.values,
        workspace.ids,
        out,
        S=splits,
        BLOCK_S=max(16, host_math.next_power_of_2(splits)),
        num_warps=1,
    )
    return out
