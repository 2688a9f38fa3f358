"""A context-parallel prefill handed to a decode engine as a KV payload (kv_transfer/payload.py).

After `cp_prefill` the *last* rank's pools hold everything a continuation at N reads: its own
slice's rows, and (received before each layer) the window before its slice, the compressor state
crossing its edge and every earlier compressed row / indexer key. Since that rank's window and
compressor reach end at N, reading the payload from its pools alone is enough: one rank sends it,
and the decode side adopts it exactly as it adopts a single-rank prefill's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from antumbra.cachestore.pools import KVPools

from ..kv_transfer.payload import KVPayload, LayoutKey
from ..kv_transfer.rows import read_rows
from ..model.model import DeepseekV4
from .prefill import cp_prefill, split_slices


def cp_prefill_payload(
    model: DeepseekV4,
    make_pools: Callable[[], KVPools],
    token_ids: list[int],
    num_ranks: int,
    request_id: str,
) -> KVPayload:
    """Prefill `token_ids` over `num_ranks` ranks (fresh pools from `make_pools`, same layout as the
    decode engine's) and pick the first token greedily; -> the payload a decode engine adopts
    (`first_logprobs` is {t0: logprob})."""
    n = len(token_ids)
    ranks = [make_pools() for _ in range(num_ranks)]
    num_pages = -(-n // ranks[0].layout.page_size)
    vpages = ranks[0].alloc_virtual_pages(num_pages)
    for pools in ranks:
        if pools is not ranks[0] and pools.alloc_virtual_pages(num_pages) != vpages:
            raise RuntimeError("fresh rank pools must hand out the same pages")
        for vpage in vpages:
            pools.attach_swa(vpage)
    result = cp_prefill(model, ranks, vpages, token_ids, split_slices(n, num_ranks))
    last = result.logits[-1]
    first = int(torch.argmax(last))
    logprob = float(torch.log_softmax(last, dim=-1)[first])
    return KVPayload(
        request_id=request_id,
        layout=LayoutKey.of(ranks[-1]),
        prompt_token_ids=tuple(token_ids),
        num_tokens=n,
        skip_pages=0,
        first_token=first,
        first_logprobs={first: logprob},
        finish_reason=None,
        cached_tokens=0,
        tensors=read_rows(ranks[-1], vpages, n, 0),
    )
