"""mHC (manifold-constrained hyper-connection) mixing in plain PyTorch: the definition the kernels reproduce.

The residual is n streams per token, `[T, n, D]`. Before a sub-block:

    f     = flatten(X) / rms(flatten(X))                       [T, n*D] float32, unweighted RMS norm
    mix   = f @ fn^T                                           [T, (2+n)*n]
    pre   = sigmoid(mix[:n] * scale[0] + base[:n]) + hc_eps
    post  = 2 * sigmoid(mix[n:2n] * scale[1] + base[n:2n])
    comb  = Sinkhorn(softmax_rows(mix[2n:].view(n, n) * scale[2] + base[2n:]) + hc_eps)
    collapsed = sum_i pre_i X_i                                [T, D] in the streams' dtype

Sinkhorn: one column normalisation, then (iters - 1) x [row, column] normalisations, each dividing
by (sum + hc_eps). After the sub-block: X'_k = post_k * y + sum_j comb[j, k] X_j.
Same math as the model's `HyperConnection.pre` / `.post`, with the post mixing done in float32 and
rounded once (the model rounds comb, post and the partial products to the streams' dtype first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def sinkhorn_reference(comb_logits: Tensor, iters: int, eps: float) -> Tensor:
    """comb_logits: [T, n, n] float32 -> [T, n, n]: row softmax + eps, then alternating normalisations."""
    comb = torch.softmax(comb_logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def mhc_pre_reference(
    streams: Tensor, fn: Tensor, base: Tensor, scale: Tensor, iters: int, hc_eps: float, norm_eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """streams: [T, n, D] float; fn: [(2+n)*n, n*D] float32; base: [(2+n)*n] float32; scale: [3] float32.

    -> (collapsed [T, D] streams.dtype, post [T, n] float32, comb [T, n, n] float32).
    """
    n = streams.shape[1]
    flat = streams.flatten(1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mix = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    s_pre, s_post, s_comb = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * s_post + post_b)
    comb = sinkhorn_reference(comb_w.view(-1, n, n) * s_comb + comb_b.view(n, n), iters, hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)
    return collapsed, post, comb


def mhc_post_reference(streams: Tensor, block_out: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """X'_k = post_k * y + sum_j comb[j, k] X_j.

    streams: [T, n, D]; block_out: [T, D]; post: [T, n] float32; comb: [T, n, n] float32
    -> [T, n, D] streams.dtype (computed in float32, rounded once).
    """
    mixed = torch.matmul(comb.float().transpose(-1, -2), streams.float())
    out = post.float().unsqueeze(-1) * block_out.float().unsqueeze(-2) + mixed
    return out.to(streams.dtype)


def mhc_head_reference(
    streams: Tensor, fn: Tensor, base: Tensor, scale: Tensor, hc_eps: float, norm_eps: float
) -> Tensor:
    """The final collapse before the output norm (no post, no Sinkhorn): pre = sigmoid(f @ fn^T *
    scale + base) + hc_eps with f the RMS-normed flattened streams, then sum_i pre_i X_i.

    streams: [T, n, D] float; fn: [n, n*D] float32; base: [n] float32; scale: [1] float32
    -> [T, D] streams.dtype (the model's `HyperHead`)."""
    flat = streams.flatten(1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)
