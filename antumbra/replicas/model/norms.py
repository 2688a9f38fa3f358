"""RMS norms. Weights stay in float32 and the product is taken in float32, cast once."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from antumbra.kernels.rms_norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The kernel has no backward: under autograd (the MTP distillation trains a block) the chain.
        training = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if x.is_cuda and not training:
            # One launch instead of upcast, norm and downcast: a decode step runs a dozen of these.
            return rms_norm(x, self.weight.float(), self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-row RMS normalisation without a weight (the per-head q norm, mHC input norm)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
