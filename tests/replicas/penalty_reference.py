"""The host reference the device-resident penalty state is checked against: the sparse entries
`penalties.py` builds from a request's host history (its prompt and output ids), with the
min_tokens bans as (row, token) pairs, applied by `kernels/sampling.adjust_reference`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from antumbra.kernels.sampling import adjust_reference, min_p_floor_reference, race_sample_reference
from antumbra.replicas.penalties import TokenCounts, build_entries, with_bans
from antumbra.replicas.sampling_cuts import min_p_slack, top_k_top_p_floor
from antumbra.replicas.sampling_params import SamplingParams


def host_adjusted(logits: torch.Tensor, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
                  outputs: Sequence[Sequence[int]], eos: Sequence[int]) -> torch.Tensor:
    """[B, V] float32: logits [B, V] adjusted from each row's host history (not modified)."""
    histories = [TokenCounts(p).update(o) if q.adjusts_logits else None
                 for q, p, o in zip(params, prompts, outputs, strict=True)]
    bans = [(row, t) for row, (q, o) in enumerate(zip(params, outputs, strict=True)) if len(o) < q.min_tokens
            for t in sorted(set(eos).union(q.stop_token_ids))]
    entries = with_bans(build_entries(params, histories), bans)
    adjusted = logits.float().clone()
    if entries is not None:
        adjust_reference(adjusted, entries.rows, entries.tokens, entries.values)
    return adjusted


def host_tokens(logits: torch.Tensor, packed: torch.Tensor, params: Sequence[SamplingParams],
                prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                eos: Sequence[int]) -> list[int]:
    """The tokens the race draws over the host-adjusted logits, cut as the sampler cuts: top-k /
    top-p, then min_p, on the adjusted logits. packed: [4, B] int32 (`pack_rows`)."""
    adjusted = host_adjusted(logits, params, prompts, outputs, eos)
    floor = top_k_top_p_floor(adjusted, list(params))
    if floor is None:
        floor = torch.full((adjusted.shape[0],), float("-inf"))
    if any(p.min_p > 0 for p in params):
        floor = torch.maximum(floor, min_p_floor_reference(adjusted, min_p_slack(list(params))))
    return race_sample_reference(adjusted, packed, floor).tolist()
