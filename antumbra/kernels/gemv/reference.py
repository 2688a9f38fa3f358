"""PyTorch reference of the few-token linear (`triton.gemv_into`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def gemv_into_reference(
    x: torch.Tensor, weights: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
    rows: torch.Tensor | None = None, scale: float = 1.0,
) -> None:
    """For each weight W_i [N_i, K] and its output O_i [R, N_i]:
    O_i[rows[t]] = (x[t] @ W_i^T, rounded to x's dtype, widened to float32) * scale, in O_i's dtype.
    x: [T, K]; rows: [T] integer output rows (None: row t). The product accumulates in float32."""
    targets = torch.arange(x.shape[0], device=x.device) if rows is None else rows.long()
    for weight, out in zip(weights, outs, strict=True):
        y = torch.mm(x.float(), weight.float().t()).to(x.dtype).float() * scale
        out[targets] = y.to(out.dtype)
