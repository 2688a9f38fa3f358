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

from antumbra.kernels.common import host_math
from antumbra.kernels.common.codecs import (
    ACT_BLOCK,
    E4M3_MAX,
    FP8_FLOOR,
    e4m3_round,
    pow2,
    scale_exponent,
)
from antumbra.kernels.common.interpreter import prepare

prepare()


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Output allocation; tests swap in a NaN fill to catch unwritten elements."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _normed(x, w, eps, D: tl.constexpr):
    """A float32 row (zeros past D) and its float32 weight -> the weighted, normalised row."""
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    return x * r * w


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, eps, D: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * D + cols, _normed(x, w, eps, D).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_constexprs(d: int) -> dict[str, Any]:
    """Constexprs and launch options for rows of d channels: the model's widths only."""
    block = host_math.next_power_of_2(d)
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


@triton.jit
def _rms_norm_fp8_kernel(x_ptr, w_ptr, out_ptr, act_ptr, eps, D: tl.constexpr, BLOCK: tl.constexpr,
                         FLOOR: tl.constexpr, INV_QMAX: tl.constexpr, QMAX: tl.constexpr):
    """The norm as `_rms_norm_kernel`, and beside it the stored row's FP8 round trip per BLOCK
    channels (`kv_codes.fp8_roundtrip` of `out`): D a multiple of BLOCK and a power of two."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + row * D + cols).to(tl.float32)
    y = _normed(x, tl.load(w_ptr + cols), eps, D).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * D + cols, y)
    blocks = tl.reshape(y.to(tl.float32), [D // BLOCK, BLOCK])
    k = scale_exponent(tl.max(tl.abs(blocks), 1), FLOOR, INV_QMAX)
    scaled = tl.minimum(tl.maximum(blocks * pow2(-k)[:, None], -QMAX), QMAX)
    q = e4m3_round(scaled) * pow2(k)[:, None]
    tl.store(act_ptr + row * D + cols, tl.reshape(q, [D]).to(act_ptr.dtype.element_ty))


def fuses_fp8(d: int) -> bool:
    """Whether `rms_norm_fp8` takes rows of d channels (whole 128-channel blocks, a power of two)."""
    return d >= ACT_BLOCK and d % ACT_BLOCK == 0 and d & (d - 1) == 0


def rms_norm_fp8(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x, weight, eps), fp8_roundtrip of it) in one launch; x [..., D] float with
    `fuses_fp8(D)`, weight [D] float32 -> two tensors of x's shape and dtype. Release numerics
    feed the norm's output to the compressors unrounded and to the FP8 linears rounded.

    The second output is the round trip of the first, bit for bit. Compiled, the first may differ
    from `rms_norm`'s in float32 by the order of the row's sum of squares (seen on the H200 from
    the 8th decode step of a float32 run); under the interpreter they are equal."""
    d = x.shape[-1]
    assert fuses_fp8(d), f"rows of {d} channels: use rms_norm, then fp8_roundtrip"
    assert weight.shape == (d,) and weight.dtype == torch.float32, "weight must be float32 [D]"
    x2 = x.contiguous().view(-1, d)
    out = _empty(*x2.shape, dtype=x.dtype, device=x.device)
    act = _empty(*x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_fp8_kernel[(x2.shape[0],)](
            x2, weight.contiguous(), out, act, float(eps), D=d, BLOCK=ACT_BLOCK, FLOOR=FP8_FLOOR,
            INV_QMAX=1.0 / E4M3_MAX, QMAX=E4M3_MAX, num_warps=max(1, min(8, d // 512)))
    return out.view(x.shape), act.view(x.shape)
