"""A context-parallel prefill handed to a decode engine as a KV payload (kv_transfer/payload.py).

After `cp_prefill` the *last* rank's pools hold everything a continuation at N reads: its own
slice's rows, and (received before each layer) the window before its slice, the compressor state
crossing its edge and every earlier compressed row / indexer key. Since that rank's window and
compressor reach end at N, reading the payload from its pools alone is enough: one rank sends it,
and the decode side adopts it exactly as it adopts a single-rank prefill's.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from antumbra.cachestore.pools import KVPools
from antumbra.config import EngineConfig, ModelConfig

from ..build import build_pools
from ..kv_transfer.payload import DRAFT_STREAMS, KVPayload, LayoutKey
from ..kv_transfer.rows import read_rows
from ..model.model import DeepseekV4
from ..plan import ExecutionPlan
from .prefill import CPResult, cp_prefill, cp_prefill_rank, split_slices


def run_gloo_ranks(
    model: DeepseekV4,
    ranks: list[KVPools],
    vpages: list[int],
    token_ids: list[int],
    slices: list[tuple[int, int]],
    timeout_s: float = 300.0,
) -> list[CPResult]:
    """`cp_prefill_rank` on every rank at once: one thread per rank, joined by a gloo group over an
    in-process store (the ranks share the model's weights, each has its own pools); -> per rank."""
    store = dist.HashStore()
    results: dict[int, CPResult] = {}
    errors: list[BaseException] = []
    model.rope_tables()  # built once, before the ranks share the model

    def run(r: int) -> None:
        try:
            group = dist.ProcessGroupGloo(store, r, len(ranks), datetime.timedelta(seconds=timeout_s))
            results[r] = cp_prefill_rank(model, ranks[r], vpages, token_ids, slices, r, group)
        except BaseException as exc:  # re-raised by the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), name=f"cp-rank-{r}") for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise RuntimeError(f"a context-parallel rank failed: {errors[0]!r}") from errors[0]
    if len(results) != len(ranks):
        raise TimeoutError(f"context-parallel ranks did not finish within {timeout_s} s")
    return [results[r] for r in range(len(ranks))]


def cp_prefill_payload(
    model: DeepseekV4,
    make_pools: Callable[[], KVPools],
    token_ids: list[int],
    num_ranks: int,
    request_id: str,
    *,
    skip_pages: int = 0,
    over_gloo: bool = False,
    draft_streams: bool = False,
) -> KVPayload:
    """Prefill `token_ids` over `num_ranks` ranks (fresh pools from `make_pools`, same layout as the
    decode engine's) and pick the first token greedily; -> the payload a decode engine adopts
    (`first_logprobs` is {t0: logprob}; compressed rows from page `skip_pages`). `over_gloo` runs
    the ranks at once (`run_gloo_ranks`), else one after another in this thread. `draft_streams`:
    with the last window's streams a speculating receiver's drafter reads (`DRAFT_STREAMS`), joined
    from the ranks' tails (a slice shorter than the window takes the rest from the ranks before it)."""
    n = len(token_ids)
    ranks = [make_pools() for _ in range(num_ranks)]
    num_pages = -(-n // ranks[0].layout.page_size)
    vpages = ranks[0].alloc_virtual_pages(num_pages)
    for pools in ranks:
        if pools is not ranks[0] and pools.alloc_virtual_pages(num_pages) != vpages:
            raise RuntimeError("fresh rank pools must hand out the same pages")
        for vpage in vpages:
            pools.attach_swa(vpage)
    slices = split_slices(n, num_ranks)
    tail: torch.Tensor | None
    if over_gloo:
        results = run_gloo_ranks(model, ranks, vpages, token_ids, slices)
        last = results[-1].logits[-1]
        tail = torch.cat([r.tail_streams for r in results if r.tail_streams is not None])
    else:
        result = cp_prefill(model, ranks, vpages, token_ids, slices)
        last, tail = result.logits[-1], result.tail_streams
    tensors = read_rows(ranks[-1], vpages, n, skip_pages)
    if draft_streams and tail is not None:
        tensors[DRAFT_STREAMS] = tail[-min(n, model.config.sliding_window) :].cpu()
    first = int(torch.argmax(last))
    logprob = float(torch.log_softmax(last, dim=-1)[first])
    return KVPayload(
        request_id=request_id,
        layout=LayoutKey.of(ranks[-1]),
        prompt_token_ids=tuple(token_ids),
        num_tokens=n,
        skip_pages=skip_pages,
        first_token=first,
        first_logprobs={first: logprob},
        finish_reason=None,
        cached_tokens=0,
        tensors=tensors,
    )


def prompt_pools(
    model_config: ModelConfig, config: EngineConfig, plan: ExecutionPlan, num_tokens: int
) -> KVPools:
    """Pools of an engine's layout and row formats sized for one prompt (each page with an SWA page)."""
    pages = -(-num_tokens // model_config.page_size)
    cache = dataclasses.replace(
        config.cache,
        num_virtual_tokens=pages * model_config.page_size,
        num_swa_pages=pages,
        hisparse_rows_per_request=None,
        device_budget_bytes=None,
    )
    return build_pools(model_config, dataclasses.replace(config, cache=cache), plan)
