"""The prefill side of a KV handoff: a request's rows read out of the pools into a payload.

The engine hands `export_request` to its core, which calls it when such a request finishes: the core
knows no more of disaggregation than that hook (the decode side, `adopt.py`, works on the core itself).
"""

from __future__ import annotations

import torch

from antumbra.cachestore.pools import KVPools

from ..core import TransferCounters
from ..request import KVHandoff, Request
from .payload import DRAFT_STREAMS, KVPayload, LayoutKey, max_skip_pages
from .rows import read_rows


def export_request(pools: KVPools, transfers: TransferCounters, request: Request) -> KVPayload:
    """The payload of a request that has just sampled its first token (its pages still held)."""
    lay = pools.layout
    n = request.num_computed_tokens
    assert n == request.num_prompt_tokens and request.num_output_tokens == 1, \
        "export after the first token only"
    skip = min(int(request.handoff.export_from) if request.handoff is not None else 0, max_skip_pages(lay, n))
    tensors = read_rows(pools, request.kv.vpages, n, skip)
    streams = _draft_streams(request.handoff, n) if request.handoff is not None else None
    if streams is not None:
        tensors[DRAFT_STREAMS] = streams
    payload = KVPayload(
        request_id=request.request_id,
        layout=LayoutKey.of(pools),
        prompt_token_ids=tuple(request.prompt_token_ids),
        num_tokens=n,
        skip_pages=skip,
        first_token=request.output_token_ids[0],
        first_logprobs=request.record.logprobs[0] if request.record.logprobs else None,
        finish_reason=None,
        cached_tokens=request.num_cached_tokens,
        text="",  # the output side's text of the first token replaces it (`disaggregation.prefill_export`)
        tensors=tensors,
    )
    transfers.exported_requests += 1
    transfers.exported_bytes += payload.nbytes
    transfers.exported_pages += payload.num_sent_pages
    return payload


def _draft_streams(handoff: KVHandoff, num_tokens: int) -> torch.Tensor | None:
    """The streams at the prompt's last min(N, window) positions, on the CPU; None when the handoff
    keeps none or they do not cover those positions (the decode side then drafts without them)."""
    if handoff.streams is None:  # kept only when the handoff sends them
        return None
    m = min(num_tokens, handoff.stream_window)
    end = handoff.streams_start + handoff.streams.shape[0]
    if end != num_tokens or handoff.streams.shape[0] < m:
        return None
    return handoff.streams[-m:].cpu()
