"""The prefill side of a KV handoff: a request's rows read out of the pools into a payload.

It needs only the pools, so the engine core can call it without this package importing the core
(the decode side, `adopt.py`, works on the core itself).
"""

from __future__ import annotations

from dataclasses import dataclass

from antumbra.cachestore.pools import KVPools

from ..request import Request
from .payload import KVPayload, LayoutKey, max_skip_pages
from .rows import read_rows


@dataclass
class TransferCounters:
    exported_requests: int = 0
    exported_bytes: int = 0
    exported_pages: int = 0
    adopted_requests: int = 0
    adopted_bytes: int = 0
    adopted_pages: int = 0  # pages whose rows arrived
    skipped_pages: int = 0  # prefix pages the decode side had cached (their rows were not sent)
    failed_adoptions: int = 0


def export_request(pools: KVPools, transfers: TransferCounters, request: Request) -> KVPayload:
    """The payload of a request that has just sampled its first token (its pages still held)."""
    lay = pools.layout
    n = request.num_computed_tokens
    assert n == request.num_prompt_tokens and request.num_output_tokens == 1, \
        "export after the first token only"
    skip = min(int(request.export_kv_from or 0), max_skip_pages(lay, n))
    tensors = read_rows(pools, request.vpages, n, skip)
    payload = KVPayload(
        request_id=request.request_id,
        layout=LayoutKey.of(pools),
        prompt_token_ids=tuple(request.prompt_token_ids),
        num_tokens=n,
        skip_pages=skip,
        first_token=request.output_token_ids[0],
        first_logprobs=request.logprobs[0] if request.logprobs else None,
        finish_reason=None,
        cached_tokens=request.num_cached_tokens,
        text=request.text,
        tensors=tensors,
    )
    transfers.exported_requests += 1
    transfers.exported_bytes += payload.nbytes
    transfers.exported_pages += payload.num_sent_pages
    return payload
