"""Dense linear with an FP8-block weight in plain PyTorch: the definition the Triton kernel reproduces.

The weight is the DeepSeek-V4 release layout for dense linears: `float8_e4m3fn` values [N, K] and one
UE8M0 scale per 128 x 128 block, [ceil(N/128), ceil(K/128)] (`float8_e8m0fnu`, or the exponent bytes
as `uint8`: 2^(e - 127)). Element (n, k) of the weight is `w[n, k] * scale[n // 128, k // 128]`, and

    y = x @ W^T,   accumulated in float32, returned in x.dtype.

The block dequantisation is restated here so the kernels stay free of model imports; the tests check
it against the model's `replicas.model.quant.dequant_fp8_block`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

FP8_BLOCK = 128

__all__ = ["FP8_BLOCK", "dequant_fp8_weight", "fp8_linear_reference"]


def dequant_fp8_weight(weight: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """weight: [N, K] float8_e4m3fn; scale: [ceil(N/128), ceil(K/128)] float8_e8m0fnu / uint8.

    -> [N, K] dtype. Exact in bfloat16 too (a power-of-two multiple of an e4m3 value), so the
    "dequantise, then F.linear" chain the kernel replaces loses nothing by materialising bf16.
    """
    n, k = weight.shape
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    factors = scale.to(torch.float32).repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:n, :k]
    return (weight.to(torch.float32) * factors).to(dtype)


def fp8_linear_reference(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    """x: [..., K] float; weight: [N, K] float8_e4m3fn; scale: [ceil(N/128), ceil(K/128)] -> [..., N] x.dtype.

    Products and sums in float32 whatever x.dtype is.
    """
    return F.linear(x.float(), dequant_fp8_weight(weight, scale)).to(x.dtype)
