"""How the residual streams pass from one sub-block to the next.

A sub-block ends with its mHC post (`X'_k = post_k * y + sum_j comb[j, k] X_j`) and the next one
starts with its pre over X'. The post is kept pending (`PendingPost`) until the next sub-block
enters, so that with the kernels the two run as `mhc_post_pre`: the pre's mixing launch forms X'
itself, one launch a sub-block fewer. Without them (or when nothing follows: the last layer's
post, before the head) the post runs on its own. Either way the streams are the same values.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from antumbra.kernels.mhc.triton import mhc_post, mhc_post_pre, mhc_pre

from .hyper_connections import HyperConnection


class PendingPost(NamedTuple):
    """A sub-block's post, not yet applied: its input streams [T, n, D], its output [T, D], and
    post [T, n] / comb [T, n, n] float32 from its pre."""

    streams: torch.Tensor
    block_out: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor


Flow = torch.Tensor | PendingPost  # streams [T, n, D], or streams with a post still to apply


def applied(flow: Flow, kernels: bool) -> torch.Tensor:
    """The streams [T, n, D] the flow stands for (its pending post applied)."""
    if isinstance(flow, torch.Tensor):
        return flow
    if kernels:
        return mhc_post(flow.streams.contiguous(), flow.block_out.contiguous(), flow.post, flow.comb)
    return HyperConnection.post(*flow)


def enter(
    hc: HyperConnection, flow: Flow, kernels: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sub-block's entry -> (its streams [T, n, D], collapsed [T, D], post, comb): the pending
    post applied, then `hc`'s pre, fused into the pre's launches with the kernels."""
    if kernels and isinstance(flow, PendingPost):
        return mhc_post_pre(flow.streams.contiguous(), flow.block_out.contiguous(), flow.post, flow.comb,
                            hc.fn, hc.base, hc.scale, hc.iters, hc.hc_eps, hc.norm_eps)
    streams = applied(flow, kernels)
    if kernels:
        collapsed, post, comb = mhc_pre(streams.contiguous(), hc.fn, hc.base, hc.scale, hc.iters, hc.hc_eps,
                                        hc.norm_eps)
    else:
        collapsed, post, comb = hc.pre(streams)
    return streams, collapsed, post, comb
