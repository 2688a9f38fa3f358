"""Routed MXFP4 experts for prefill-sized batches: decode the weights once, then grouped GEMMs.

At prefill sizes (hundreds of token slots per expert) a step reads every hit expert's weights
once however they are stored, and the cost is the GEMMs. The fused kernel (`triton.moe_mxfp4`)
decodes each weight tile in registers for every token tile and ran at about a quarter of the
tensor cores' bf16 rate there (TUNING.md). Here the experts are decoded once a step into a bf16
scratch (`dequant_mxfp4_into`, one pass over the packed bytes) and multiplied by
`torch._grouped_mm`: one GEMM per projection over all experts. The decode's tile is a
`Mxfp4DequantConfig` (`DEQUANT_SWEEP` lists the ones `benchmarks/kernels/dequant.py` compares): a
memory-bound pass, a small part of the step's device time.

No host synchronisation: token slots are grouped by expert on the device, each group padded to a
multiple of 16 rows, and the padded layout has a static bound (T*k + 16*E rows) so no size is read
back; the last group's end is that bound (its tail rows are zeros). Each token's k outputs are
gathered back and summed in a fixed order (deterministic, unlike scattered atomic adds).

Semantics: `reference.moe_mxfp4_reference` (weights decoded exactly to bf16; SwiGLU in x's
dtype; routing weights applied after w2, summed in float32).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from antumbra.kernels.common import host_math
from antumbra.kernels.common.codecs import e2m1_times_2pow14
from antumbra.kernels.common.interpreter import prepare
from antumbra.kernels.swiglu import triton as swiglu_kernel

from .reference import MXFP4_BLOCK, swiglu

prepare()

GROUP_ROWS = 16  # group padding: grouped GEMM tiles take rows in multiples of this


@dataclass(frozen=True)
class Mxfp4DequantConfig:
    """Tile of one `_dequant_kernel` program.

    The values are interleaved in registers (`tl.join`) and written in one contiguous store. Two
    other forms were timed on an H200 and removed (TUNING.md): two stride-2 stores, and each pair
    packed into one word of twice the width; both were slower.
    """

    block_r: int = 16  # rows per program
    # packed bytes of a row per program: a power of two >= 16 (whole scale groups). 256: the best of the
    # H200 sweep (TUNING.md)
    block_b: int = 256
    num_warps: int = 4


DEQUANT_CONFIG = Mxfp4DequantConfig()
# Tiles a benchmark compares; the tests run each one. At most 64 packed bytes a thread, so 128
# float32 values at once: a bound on registers from the arithmetic, not a measured limit.
DEQUANT_SWEEP: tuple[Mxfp4DequantConfig, ...] = tuple(
    Mxfp4DequantConfig(block_r=rows, block_b=nbytes, num_warps=warps)
    for rows, nbytes, warps in itertools.product((16, 32, 64), (128, 256, 512), (4, 8))
    if rows * nbytes <= 64 * 32 * warps
)


@triton.jit
def _dequant_kernel(
    packed_ptr,  # [R, C/2] uint8: two e2m1 codes a byte, low nibble first (R = groups * rows)
    scale_ptr,  # [R, C/32] uint8 UE8M0 exponents
    out_ptr,  # [groups * OUT_GROUP_ROWS, C] out, row (g * OUT_GROUP_ROWS + ROW_OFFSET + r)
    num_rows,  # R
    rows_per_group,  # rows of each group in `packed`
    C,  # values per row
    OUT_GROUP_ROWS: tl.constexpr,
    ROW_OFFSET: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_B: tl.constexpr,  # packed bytes per row step (a multiple of 16: whole scale groups)
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    group = rows // rows_per_group
    out_rows = (group * OUT_GROUP_ROWS + ROW_OFFSET + rows % rows_per_group).to(tl.int64)
    half = C // 2
    bytes_ = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    ok = row_ok[:, None] & (bytes_ < half)[None, :]
    codes = tl.load(packed_ptr + rows.to(tl.int64)[:, None] * half + bytes_[None, :], mask=ok, other=0)
    exps = tl.load(scale_ptr + rows.to(tl.int64)[:, None] * (C // 32) + (bytes_ // 16)[None, :], mask=ok,
                   other=127)
    factor = tl.exp2(exps.to(tl.float32) - 127.0)
    # Code values come times 2^-14: restored first (exact), so a zero code stays zero at any scale.
    low = e2m1_times_2pow14(codes & 0xF) * 16384.0 * factor
    high = e2m1_times_2pow14(codes >> 4) * 16384.0 * factor
    values = tl.reshape(tl.join(low, high), [BLOCK_R, 2 * BLOCK_B])  # value 2j, then 2j + 1
    cols = tl.program_id(1) * 2 * BLOCK_B + tl.arange(0, 2 * BLOCK_B)
    dst = out_ptr + out_rows[:, None] * C + cols[None, :]
    tl.store(dst, values.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < C)[None, :])


def dequant_mxfp4_into(
    out: Tensor, packed: Tensor, scale: Tensor, row_offset: int = 0, config: Mxfp4DequantConfig | None = None
) -> Tensor:
    """Decode packed [G, R, C/2] (scales [G, R, C/32]) into out[:, row_offset : row_offset + R] of
    out [G, R_out, C] (bf16 / fp16 / fp32, contiguous) in one launch; -> out.

    config: the tile (None = `DEQUANT_CONFIG`); its `block_b` is capped at next_power_of_2(C/2), so
    narrow rows do not launch mostly masked tiles."""
    config = config or DEQUANT_CONFIG
    groups, rows, half = packed.shape
    cols = 2 * half
    assert out.is_contiguous() and out.shape[0] == groups and out.shape[2] == cols
    assert row_offset + rows <= out.shape[1] and cols % MXFP4_BLOCK == 0
    assert scale.shape == (groups, rows, cols // MXFP4_BLOCK)
    assert config.block_b >= 16 and host_math.next_power_of_2(config.block_b) == config.block_b, config
    assert host_math.next_power_of_2(config.block_r) == config.block_r, config
    assert out.dtype in (torch.bfloat16, torch.float16, torch.float32), out.dtype
    block_b = min(config.block_b, host_math.next_power_of_2(half))
    grid = (host_math.cdiv(groups * rows, config.block_r), host_math.cdiv(half, block_b))
    _dequant_kernel[grid](
        packed.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8), out, groups * rows,
        rows, cols, OUT_GROUP_ROWS=out.shape[1], ROW_OFFSET=row_offset, BLOCK_R=config.block_r,
        BLOCK_B=block_b, num_warps=config.num_warps,
    )
    return out


def group_slots(topk_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, int]:
    """topk_ids [T, k] -> (dest [T*k] int64: the padded row of each (token, slot) pair, row-major;
    offs [E] int32: cumulative group ends for `torch._grouped_mm`; the padded row count), all on
    the device, nothing read back."""
    pairs = topk_ids.numel()
    flat = topk_ids.reshape(-1).long()
    # Not `bincount`: on CUDA it reads the largest id back to size its output (a sync).
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + GROUP_ROWS - 1) // GROUP_ROWS * GROUP_ROWS
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    first = counts.cumsum(0) - counts  # sorted position of each expert's first pair
    dest_sorted = (ends - padded)[expert_of] + torch.arange(pairs, device=flat.device) - first[expert_of]
    dest = torch.empty_like(dest_sorted)
    dest[order] = dest_sorted
    total = pairs + GROUP_ROWS * num_experts  # >= the padded sum: a static bound
    offs = ends.to(torch.int32)
    offs[-1:].fill_(total)  # the last group also covers the zero tail
    return dest, offs, total


def moe_mxfp4_grouped(
    x: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w1: Tensor,
    w1_scale: Tensor,
    w3: Tensor,
    w3_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    swiglu_limit: float,
) -> Tensor:
    """As `triton.moe_mxfp4` (same arguments and layouts), for many tokens: x [T, D] contiguous,
    topk_weights [T, k] float, topk_ids [T, k] int in [0, E) -> [T, D] x.dtype. Decodes all E experts
    (scratch: 3 * E * I * D elements of x's dtype)."""
    num_tokens, d = x.shape
    num_experts, inter, _ = w1.shape
    top_k = topk_ids.shape[1]
    w13 = torch.empty(num_experts, 2 * inter, d, dtype=x.dtype, device=x.device)
    dequant_mxfp4_into(w13, w1, w1_scale, 0)
    dequant_mxfp4_into(w13, w3, w3_scale, inter)
    w2_dense = dequant_mxfp4_into(torch.empty(num_experts, d, inter, dtype=x.dtype, device=x.device), w2,
                                  w2_scale)
    dest, offs, total = group_slots(topk_ids, num_experts)
    slots = _padded_rows(x, dest, total, top_k)
    hidden = torch._grouped_mm(slots, w13.transpose(-2, -1), offs=offs)  # [total, 2I]
    if x.is_cuda and x.dtype in swiglu_kernel.DTYPES:  # one launch, torch's values bit for bit
        act = swiglu_kernel.swiglu(hidden[:, :inter], hidden[:, inter:], swiglu_limit)
    else:
        act = swiglu(hidden[:, :inter], hidden[:, inter:], swiglu_limit).contiguous()
    y = torch._grouped_mm(act, w2_dense.transpose(-2, -1), offs=offs)  # [total, D]
    if x.is_cuda:
        return combine_slots(y, dest, topk_weights)
    per_slot = y[dest].view(num_tokens, top_k, d).float()
    return torch.einsum("tkd,tk->td", per_slot, topk_weights.float()).to(x.dtype)


def _padded_rows(x: Tensor, dest: Tensor, total: int, top_k: int) -> Tensor:
    """[total, D]: row dest[p] holds x[p // top_k], every other row zeros. A gather from x with a zero
    row appended (each padded row names its source), not a scatter into zeros: on CUDA torch's row
    gather is a vectorised copy, its indexed assignment an elementwise kernel (TUNING.md)."""
    num_tokens, d = x.shape
    src = torch.full((total,), num_tokens, dtype=torch.long, device=x.device)
    src[dest] = torch.arange(dest.numel(), device=x.device) // top_k
    return torch.cat([x, x.new_zeros(1, d)])[src]


@triton.jit
def _combine_kernel(
    y_ptr,  # *T [total, D] each padded row's expert output, contiguous
    dest_ptr,  # *i64 [T * TOPK] the padded row of each (token, slot) pair
    w_ptr,  # *f32 [T * TOPK] routing weights
    out_ptr,  # *T [T, D] out
    D: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    for slot in tl.static_range(TOPK):  # slot order: a fixed float32 sum
        row = tl.load(dest_ptr + token * TOPK + slot)
        weight = tl.load(w_ptr + token * TOPK + slot)
        acc += tl.load(y_ptr + row * D + cols, mask=ok, other=0.0).to(tl.float32) * weight
    tl.store(out_ptr + token * D + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


COMBINE_BLOCK_D = 1024  # channels per program of `_combine_kernel`


def combine_slots(y: Tensor, dest: Tensor, topk_weights: Tensor) -> Tensor:
    """out[t] = sum over slots s of y[dest[t * k + s]] * topk_weights[t, s], in float32, slot by slot,
    rounded once to y's dtype: [T, D]. One launch for the gather, the weighting and the sum (the torch
    chain is a gather, a float32 copy, a batched GEMV and a cast). y [total, D] contiguous; dest [T * k]
    int64; topk_weights [T, k]."""
    num_tokens, top_k = topk_weights.shape
    d = y.shape[1]
    out = torch.empty(num_tokens, d, dtype=y.dtype, device=y.device)
    if num_tokens:
        block_d = min(COMBINE_BLOCK_D, host_math.next_power_of_2(d))
        _combine_kernel[(num_tokens, host_math.cdiv(d, block_d))](
            y.contiguous(), dest.contiguous(), topk_weights.float().contiguous(), out, D=d, TOPK=top_k,
            BLOCK_D=block_d, num_warps=4)
    return out
