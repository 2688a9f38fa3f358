"""The shared expert's clamped SwiGLU in plain PyTorch: the definition the kernel reproduces.

For gate, up [T, I] (bfloat16 or float32) and limit L:

    y = silu(min(gate, L)) * clamp(up, -L, L)

in the inputs' dtype, op by op as torch computes it: in bfloat16 `silu` rounds its result to
bfloat16 before the product, which rounds once more. With `fp8_round_trip`, y then takes the
release numerics' FP8 round trip per 128 channels of a row (UE8M0 scale 2^k with
k = ceil(log2(max(amax, 1e-4) * fl32(1/448))), values / 2^k rounded to e4m3, times 2^k).

This is the model's `swiglu` followed by `quant.fp8_roundtrip(y, 128)`, restated here so the
kernels stay free of model imports; the tests check the round trip against the model's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

FP8_BLOCK = 128  # channels per UE8M0 scale
_E4M3_MAX = 448.0
_AMAX_FLOOR = 1e-4


def _ceil_log2(v: Tensor) -> Tensor:
    """Exact ceil(log2 v) of positive float32 v (int32), from v = m * 2^e with m in [0.5, 1)."""
    mantissa, exponent = torch.frexp(v)
    return torch.where(mantissa == 0.5, exponent - 1, exponent)


def _fp8_round_trip(y: Tensor) -> Tensor:
    """y: [T, I] float -> the same shape and dtype; the last block zero-padded when I is not a
    multiple of 128 (zeros leave its amax as it is)."""
    rows, width = y.shape
    pad = -width % FP8_BLOCK
    blocks = F.pad(y.float(), (0, pad)).reshape(rows, -1, FP8_BLOCK)
    inverse = torch.tensor(1.0 / _E4M3_MAX, dtype=torch.float32, device=y.device)
    k = _ceil_log2(blocks.abs().amax(-1, keepdim=True).clamp(min=_AMAX_FLOOR) * inverse)
    scaled = torch.ldexp(blocks, -k).clamp(-_E4M3_MAX, _E4M3_MAX)
    out = torch.ldexp(scaled.to(torch.float8_e4m3fn).float(), k)
    return out.reshape(rows, -1)[:, :width].to(y.dtype)


def swiglu_reference(gate: Tensor, up: Tensor, limit: float, fp8_round_trip: bool) -> Tensor:
    """gate, up: [T, I] bfloat16 / float32 (one dtype) -> [T, I] that dtype."""
    y = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
    return _fp8_round_trip(y) if fp8_round_trip else y
