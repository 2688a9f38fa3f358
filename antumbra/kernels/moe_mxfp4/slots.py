"""A token's k routed outputs summed, and the shared expert's output added, in one launch (see
`sum_slots_reference`): the torch chain it replaces is a strided reduction and an add, two launches
a layer that at decode sizes cost more than their work.

Program (t, j) reads channels [j * BLOCK, (j + 1) * BLOCK) of token t's k pair rows (adjacent in
the per-pair output, `[T * k, D]`), adds them in float32 in slot order, rounds the sum to the
activation dtype, then adds the addend's row in float32 and rounds again: the values of
`y.view(T, k, D).sum(1) + addend`, torch's sum taken in slot order (torch's own CUDA reduction may
add the k values in another order, which can move the sum's last bit before its rounding).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from antumbra.kernels.common import host_math
from antumbra.kernels.common.codecs import narrowed, widened
from antumbra.kernels.common.interpreter import prepare

prepare()

BLOCK = 512  # channels a program: V4's 4096 give eight programs a token


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Output allocation; tests swap in a NaN fill to catch unwritten elements."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _sum_slots_kernel(
    y_ptr,  # *T [T * TOPK, D] each (token, slot) pair's output, a token's TOPK rows adjacent
    add_ptr,  # *T [T, D] added to each token's sum
    out_ptr,  # out: *T [T, D]
    D,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < D
    first = y_ptr + t * TOPK * D + cols
    acc = tl.zeros([BLOCK], tl.float32)
    for slot in tl.static_range(TOPK):
        acc += widened(tl.load(first + slot * D, mask=ok, other=0.0)).to(tl.float32)
    dt: tl.constexpr = out_ptr.dtype.element_ty
    routed = widened(narrowed(acc, dt)).to(tl.float32)
    shared = widened(tl.load(add_ptr + t * D + cols, mask=ok, other=0.0)).to(tl.float32)
    tl.store(out_ptr + t * D + cols, narrowed(routed + shared, dt), mask=ok)


def sum_slots_constexprs(top_k: int) -> dict[str, Any]:
    """Constexprs and launch options of `_sum_slots_kernel`: the model's k only."""
    return dict(TOPK=top_k, BLOCK=BLOCK, num_warps=4)


def sum_slots(y: Tensor, top_k: int, addend: Tensor) -> Tensor:
    """y: [T * k, D] the pairs' outputs, contiguous; addend: [T, D] y.dtype (bf16, fp16 or fp32)
    -> [T, D] y.dtype, as `sum_slots_reference`."""
    num_tokens, d = addend.shape
    assert y.shape == (num_tokens * top_k, d) and y.is_contiguous() and addend.dtype == y.dtype
    out = _empty(num_tokens, d, dtype=y.dtype, device=y.device)
    if num_tokens == 0:
        return out
    _sum_slots_kernel[(num_tokens, host_math.cdiv(d, BLOCK))](
        y, addend.contiguous(), out, d, **sum_slots_constexprs(top_k),
    )
    return out
