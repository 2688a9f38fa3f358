"""The cut of each row's draw as one threshold on its (adjusted) logits: top-k, top-p, min_p.

A row keeps the tokens whose logit is at least its threshold. top-k then top-p take a sort of
the rows that use them; min_p needs no sort: p_j >= min_p * p_max <=> l_j >= max(l) + T * ln(min_p),
so it is the row's largest logit plus a per-row `slack` computed on the host. When a row has
both, the stricter threshold wins, which is top-p before min_p as transformers orders them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .sampling_params import SamplingParams

# Below this temperature logits / T overflows fp32 for ordinary logit ranges, and the
# distribution is a point mass to fp32 precision anyway, so such rows are decoded greedily.
_GREEDY_TEMPERATURE = 1e-5


def temperature(p: SamplingParams) -> float:
    return 0.0 if p.temperature < _GREEDY_TEMPERATURE else float(p.temperature)


def filters(p: SamplingParams) -> bool:
    """Whether the row's draw is cut (top-k, top-p or min_p; greedy rows are never cut)."""
    return temperature(p) > 0 and (p.top_k > 0 or p.top_p < 1 or p.min_p > 0)


def sorts(p: SamplingParams) -> bool:
    """Whether the row's cut needs a sort (top-k or top-p)."""
    return temperature(p) > 0 and (p.top_k > 0 or p.top_p < 1)


def min_p_slack(params: Sequence[SamplingParams]) -> Tensor:
    """[B] float32 on the host: T * ln(min_p) of each row cut by min_p, -inf for the others."""
    return torch.tensor(
        [temperature(p) * math.log(p.min_p) if filters(p) and p.min_p > 0 else float("-inf") for p in params],
        dtype=torch.float32,
    )


def top_k_top_p_floor(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor | None:
    """[B] float32: the smallest logit each row's top-k / top-p cut keeps (-inf: no cut); None
    when no row sorts.

    The cut is taken on logits before the division by T because it keeps their order: comparing
    stored values never drops the token that defines the threshold, which a comparison of l / T
    recomputed elsewhere could (the division need not round alike everywhere). Tokens tied
    with the threshold are kept. logits: [B, V] float32.
    """
    batch, vocab = logits.shape
    rows = [i for i, p in enumerate(params) if sorts(p)]
    if not rows:
        return None
    out = torch.full((batch,), float("-inf"), dtype=torch.float32, device=logits.device)
    index = torch.tensor(rows, dtype=torch.long).to(logits.device)
    sorted_raw, _ = logits[index].sort(dim=-1, descending=True)  # [F, V]
    positions = torch.arange(vocab, device=logits.device)
    top_k = torch.tensor([params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in rows])
    kept = positions[None, :] < top_k.to(logits.device)[:, None]  # [F, V] inside the top-k
    temps = torch.tensor([temperature(params[i]) for i in rows], dtype=torch.float32).to(logits.device)
    probs = torch.softmax((sorted_raw / temps[:, None]).masked_fill(~kept, float("-inf")), dim=-1)
    # Keep a token while the better ones have not yet reached top_p: the smallest prefix whose
    # mass is >= top_p. top_p == 1 gets an unreachable bar (fp32 sums can creep past 1.0).
    bar = torch.tensor([params[i].top_p if params[i].top_p < 1 else float("inf") for i in rows])
    mass_before = probs.cumsum(dim=-1) - probs
    kept &= mass_before < bar.to(logits.device)[:, None]
    kept[:, 0] = True  # the best token always survives
    last = kept.sum(dim=-1) - 1  # kept positions form a prefix of the sorted row
    out[index] = sorted_raw.gather(1, last[:, None]).squeeze(1)
    return out
