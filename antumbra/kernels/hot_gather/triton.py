"""The HiSparse page-in as one launch (see `reference.py` for the contract).

One program copies BLOCK_K selected rows of one decode row, the full width in BLOCK_W tiles. On a
GPU `src` is the host tier seen through its device-mapped address (pinned host memory is
addressable from the device: `cachestore.host_tier.device_view`), so the loads travel over PCIe;
small row blocks give many programs, hence many reads in flight, which is what bounds a
zero-copy read. Unused entries (-1) load and store nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from antumbra.kernels.common import host_math
from antumbra.kernels.common.interpreter import prepare

prepare()

BLOCK_K = 4  # selected rows per program


@triton.jit
def _gather_kernel(
    src_ptr, rows_ptr, base_ptr, dst_ptr, slots_ptr, counter_ptr, K, src_stride, dst_stride,
    W: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, COUNT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    jmask = j < K
    row = tl.load(rows_ptr + b * K + j, mask=jmask, other=-1).to(tl.int64)
    valid = jmask & (row >= 0)
    slot = tl.load(base_ptr + b) + j
    tl.store(slots_ptr + b * K + j, tl.where(valid, slot, -1).to(tl.int32), mask=jmask)
    src_row = src_ptr + tl.maximum(row, 0) * src_stride
    dst_row = dst_ptr + slot * dst_stride
    for w0 in tl.static_range(0, W, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        mask = valid[:, None] & (w < W)[None, :]
        values = tl.load(src_row[:, None] + w[None, :], mask=mask)
        tl.store(dst_row[:, None] + w[None, :], values, mask=mask)
    if COUNT:
        tl.atomic_add(counter_ptr, tl.sum(valid.to(tl.int64)))


def gather_rows(
    src: Tensor, rows: Tensor, base: Tensor, dst: Tensor, counter: Tensor | None = None
) -> Tensor:
    """src [N, W], rows [B, K] int32, base [B] int64, dst [M, W] -> slots [B, K] int32 (dst rows, -1)."""
    if src.dtype != dst.dtype or src.shape[1] != dst.shape[1]:
        raise ValueError(f"rows of {src.dtype} x {src.shape[1]} cannot go to a buffer of "
                         f"{dst.dtype} x {dst.shape[1]}")
    if src.stride(1) != 1 or dst.stride(1) != 1:
        raise ValueError("the host tier and the hot buffers must store each row contiguously")
    b, k = rows.shape
    slots = torch.empty(b, k, dtype=torch.int32, device=rows.device)
    if b == 0 or k == 0:
        return slots
    width = src.shape[1]
    grid = (b, host_math.cdiv(k, BLOCK_K))
    _gather_kernel[grid](
        src, rows.contiguous(), base.contiguous(), dst, slots, counter if counter is not None else slots,
        k, src.stride(0), dst.stride(0),
        W=width, BLOCK_K=BLOCK_K, BLOCK_W=min(host_math.next_power_of_2(width), 512),
        COUNT=counter is not None,
    )
    return slots
