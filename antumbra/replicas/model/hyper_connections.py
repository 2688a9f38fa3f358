"""Manifold-constrained hyper-connections (mHC).

The residual is `hc_mult` streams per token, `[T, n, D]`. Each sub-block collapses
them with `pre`, and writes back `post * y + comb^T @ X`, where `comb` is pushed
towards a doubly-stochastic matrix by Sinkhorn iterations. All mixing weights are
computed in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from antumbra.config import ModelConfig
from antumbra.kernels.mhc import mhc_head, sinkhorn_reference

from .norms import unweighted_rms_norm


def sinkhorn(comb_logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb_logits: [T, n, n] float32 -> [T, n, n], rows then columns normalised."""
    if comb_logits.requires_grad:  # training (the MTP distillation): the same steps, out of place
        return sinkhorn_reference(comb_logits, iters, eps)
    comb = torch.softmax(comb_logits, dim=-1).add_(eps)
    comb.div_(comb.sum(dim=-2, keepdim=True).add_(eps))
    for _ in range(iters - 1):
        comb.div_(comb.sum(dim=-1, keepdim=True).add_(eps))
        comb.div_(comb.sum(dim=-2, keepdim=True).add_(eps))
    return comb


class HyperConnection(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.hc_mult = n
        self.iters = cfg.hc_sinkhorn_iters
        self.hc_eps = cfg.hc_eps
        self.norm_eps = cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * cfg.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def pre(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams: [T, n, D] -> (collapsed [T, D], post [T, n] fp32, comb [T, n, n] fp32)."""
        n = self.hc_mult
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mix = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = sinkhorn(comb_w.view(-1, n, n) * s_comb + comb_b.view(n, n), self.iters, self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return collapsed, post, comb

    @staticmethod
    def post(
        streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """X'_k = post_k * y + sum_j comb[j, k] X_j.  streams [T, n, D], block_out [T, D]."""
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed


class HyperHead(nn.Module):
    """Final collapse of the streams before the output norm: sigmoid weights, no Sinkhorn."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.eps = cfg.hc_eps
        self.norm_eps = cfg.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(n, n * cfg.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams: [T, n, D] -> [T, D] in the streams' dtype."""
        training = torch.is_grad_enabled() and (streams.requires_grad or self.hc_fn.requires_grad)
        if streams.is_cuda and not training:
            # Two launches for the chain's fourteen (no backward: the MTP distillation takes the chain).
            return mhc_head(streams.contiguous(), self.hc_fn, self.hc_base, self.hc_scale, self.eps,
                            self.norm_eps)
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mix = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mix * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
