"""Weighted RMS norm in one launch (see `reference.py`).

One program per row reads the row once, reduces its sum of squares in float32 and writes
the normalised, weighted row in x's dtype. The torch chain it replaces on a bf16 row is an
upcast, the fused norm and a downcast: three launches, each a full pass, which a decode
step pays a dozen times over rows of a few thousand channels.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from antumbra.kernels.interpreter import prepare

prepare()


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Output allocation; tests swap in a NaN fill to catch unwritten elements."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, eps, D: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * D + cols, (x * r * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_constexprs(d: int) -> dict[str, Any]:
    """Constexprs and launch options for rows of d channels: the model's widths only."""
    block = triton.next_power_of_2(d)
    return dict(D=d, BLOCK_D=block, num_warps=max(1, min(8, block // 512)))


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """As `rms_norm_reference`: x [..., D] float (made contiguous); weight [D] float32 -> x.dtype."""
    d = x.shape[-1]
    assert weight.shape == (d,) and weight.dtype == torch.float32, "weight must be float32 [D]"
    x2 = x.contiguous().view(-1, d)
    out = _empty(*x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), out, float(eps), **rms_norm_constexprs(d))
    return out.view(x.shape)
