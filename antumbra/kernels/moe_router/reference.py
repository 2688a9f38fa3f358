"""The MoE router after its gate projection, in plain PyTorch: the definition the kernel reproduces.

For gate logits L [T, E] (bfloat16 or float32; the projection `x @ W^T` stays a matmul) and k:

    s = score(L)                      sqrt(softplus(L)) or sigmoid(L), in L's dtype, op by op
    ids = top-k(s + bias)             score routing (the bias in float32, so the choice is too);
          tid2eid[token_ids]          hash routing
    ids = replay where replay >= 0    routing replay (R3): a row of ids, or of -1 to leave the
                                      router's choice (a row replayed in part depends on the order
                                      of the choice, which is not defined)
    w = s[ids] / (sum(s[ids]) + 1e-20) * scaling, in L's dtype

This restates `Router.forward` of `replicas/model/moe.py` so the kernels stay free of model imports;
the tests check that the two agree bit for bit. The order of a row's k experts is not part of the
definition: top-k may list the chosen set in any order, and each expert keeps its own weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

SCORINGS = ("sqrtsoftplus", "sigmoid")  # what the kernel computes; softmax stays a torch chain
NORM_EPS = 1e-20


def scores_reference(logits: Tensor, scoring: str) -> Tensor:
    """[T, E] -> [T, E] in logits' dtype."""
    if scoring == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")


def route_reference(
    logits: Tensor, top_k: int, scaling: float, scoring: str, *, bias: Tensor | None = None,
    token_ids: Tensor | None = None, tid2eid: Tensor | None = None, replay: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """logits [T, E]; bias [E] float32 (score routing) or token_ids [T] with tid2eid [V, k] int64
    (hash routing); replay [T, k] int64 or None -> (weights [T, k] logits' dtype, ids [T, k] int64)."""
    scores = scores_reference(logits, scoring)
    if tid2eid is not None:
        assert token_ids is not None, "hash routing reads the token ids"
        ids = tid2eid[token_ids].long()
    else:
        assert bias is not None, "score routing adds its correction bias"
        ids = torch.topk(scores + bias, top_k, dim=-1, sorted=False).indices
    if replay is not None:
        ids = torch.where(replay >= 0, replay.long(), ids)
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + NORM_EPS)
    return weights * scaling, ids
