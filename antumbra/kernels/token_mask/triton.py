"""The allowed-token mask applied to a batch of logits in one launch (`reference.py` defines it).

Grid (B, ceil(V / BLOCK)): each program reads BLOCK logits of one row and the BLOCK / 32 mask
words that cover them, and writes the logits with banned tokens at -inf. Every input is a device
tensor, so the launch can be captured in a CUDA graph, and `out` may alias `logits`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from antumbra.kernels.common import host_math
from antumbra.kernels.common.interpreter import prepare

prepare()

BLOCK = 2048


@triton.jit
def _apply_mask_kernel(
    logits_ptr,  # *f32/bf16 [B, V], row stride `stride_logits`
    mask_ptr,  # *i32 [B, W], row stride `stride_mask`
    out_ptr,  # *same as logits [B, V], row stride `stride_out`
    stride_logits,
    stride_mask,
    stride_out,
    V,
    W,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < V
    word = cols // 32
    words = tl.load(mask_ptr + row * stride_mask + word, mask=inside & (word < W), other=0)
    allowed = ((words >> (cols % 32)) & 1) != 0
    # In float32 whatever the logits' type: bf16 constants do not build in the CPU interpreter.
    values = tl.load(logits_ptr + row * stride_logits + cols, mask=inside).to(tl.float32)
    masked = tl.where(allowed, values, float("-inf"))
    tl.store(out_ptr + row * stride_out + cols, masked.to(out_ptr.dtype.element_ty), mask=inside)


def apply_token_mask(logits: Tensor, bitmask: Tensor, out: Tensor | None = None) -> Tensor:
    """logits [B, V] float32 / bfloat16 (unit column stride), bitmask [B, W] int32 on the same
    device -> out [B, V] (allocated unless given; may be `logits`)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [B, V] with unit column stride, got {tuple(logits.shape)}")
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(
            f"bitmask must be [{logits.shape[0]}, W] int32, got {tuple(bitmask.shape)} {bitmask.dtype}")
    if bitmask.stride(1) != 1:
        bitmask = bitmask.contiguous()
    if out is None:
        out = torch.empty_like(logits)
    batch, vocab = logits.shape
    if batch == 0:
        return out
    grid = (batch, host_math.cdiv(vocab, BLOCK))
    _apply_mask_kernel[grid](
        logits, bitmask, out, logits.stride(0), bitmask.stride(0), out.stride(0), vocab,
        bitmask.shape[1], BLOCK=BLOCK,
    )
    return out
