"""Lightning-indexer scores and top-k selection, in plain PyTorch: the definition.

For query row b (a decode request or one prefill token) and candidate j, whose key is
row cand_rows[b, j] of the layer's indexer key pool:

    score[b, j] = scale * sum_h weights[b, h] * ReLU(q[b, h] . keys_pool[cand_rows[b, j]])

A candidate is valid when cand_rows[b, j] >= 0 and j < num_candidates[b] (when given).
The selection is the k valid candidates of highest score, reported as their POOL ROWS
(cand_rows[b, j]), -1 where fewer than k are valid. Ties are broken towards the lower
candidate index j; the order of the k rows within a row of the output is not part of
the definition (compare sets).

`weights` already carries num_heads^-0.5 (as `Indexer.select` builds it); `scale` is
index_head_dim^-0.5 by default.
"""

from __future__ import annotations

import torch


def candidate_mask(cand_rows: torch.Tensor, num_candidates: torch.Tensor | None) -> torch.Tensor:
    """cand_rows: [B, N] int; num_candidates: [B] int or None -> [B, N] bool valid candidates."""
    valid = cand_rows >= 0
    if num_candidates is not None:
        index = torch.arange(cand_rows.shape[1], device=cand_rows.device)
        valid &= index[None, :] < num_candidates.to(cand_rows.device)[:, None]
    return valid


def indexer_scores_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys_pool: torch.Tensor,
    cand_rows: torch.Tensor,
    num_candidates: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """q: [B, Hi, di]; weights: [B, Hi] fp32; keys_pool: [Rc, di]; cand_rows: [B, N] int
    (-1 = none); num_candidates: [B] int or None -> scores [B, N] fp32, -inf where invalid."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    valid = candidate_mask(cand_rows, num_candidates)
    keys = keys_pool[cand_rows.clamp(min=0).long()].float()  # [B, N, di]
    logits = torch.einsum("bhd,bnd->bnh", q.float(), keys).relu()  # [B, N, Hi]
    scores = torch.einsum("bnh,bh->bn", logits, weights.float()) * scale
    return scores.masked_fill(~valid, float("-inf"))


def topk_rows_reference(
    scores: torch.Tensor,
    cand_rows: torch.Tensor,
    k: int,
    num_candidates: torch.Tensor | None = None,
    *,
    stable: bool = True,
) -> torch.Tensor:
    """scores: [B, N] fp32; cand_rows: [B, N] int -> [B, k] int32 pool rows, -1 padded.

    `stable=True` sorts with a stable descending sort, which realises the tie rule
    (lower candidate index first) exactly; `stable=False` is plain `torch.topk`, whose
    choice among equal scores is unspecified (the baseline a kernel is timed against).
    """
    valid = candidate_mask(cand_rows, num_candidates)
    masked = scores.float().masked_fill(~valid, float("-inf"))
    take = min(k, scores.shape[1])
    if stable:
        chosen = torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :take]
    else:
        chosen = masked.topk(take, dim=1).indices
    rows = torch.where(valid.gather(1, chosen), cand_rows.gather(1, chosen).to(torch.int32), -1)
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int32, device=scores.device)
    out[:, :take] = rows
    return out


def indexer_topk_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys_pool: torch.Tensor,
    cand_rows: torch.Tensor,
    k: int,
    num_candidates: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    stable: bool = True,
) -> torch.Tensor:
    """Scores then top-k: [B, k] int32 pool rows of the chosen candidates, -1 padded."""
    scores = indexer_scores_reference(q, weights, keys_pool, cand_rows, num_candidates, scale)
    return topk_rows_reference(scores, cand_rows, k, num_candidates, stable=stable)
