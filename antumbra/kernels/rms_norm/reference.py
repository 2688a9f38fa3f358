"""Weighted RMS norm in plain PyTorch: the definition the kernel reproduces.

    y = (w * x / sqrt(mean(x^2) + eps)).to(x.dtype)

computed in float32 whatever x's dtype (the model's `RMSNorm`, restated here so the kernels
stay free of model imports).
"""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D] float; weight: [D] float32 -> [..., D] x.dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * x32).to(x.dtype)
