"""The target's plain forward over one whole sequence, with pools of its own: no paging decisions, no
cache reuse between calls. The reference decoder and the distillation read the target through it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from antumbra.cachestore.pools import KVPools, PoolLayout
from antumbra.config import CacheConfig

from ..model.forward_batch import ForwardBatch
from ..model.model import DeepseekV4


@dataclass(frozen=True)
class PlainOutput:
    logits: torch.Tensor  # [S, V] float32: the next-token logits at every position
    streams: torch.Tensor  # [S, n, D] model dtype: the last layer's residual streams (before hc_head)


@torch.no_grad()
def plain_forward(model: DeepseekV4, token_ids: list[int]) -> PlainOutput:
    """Every position of `token_ids` (a sequence from position 0) in one general step over fresh pools."""
    cfg = model.config
    device = model.lm_head.weight.device
    page = cfg.page_size
    num_pages = -(-len(token_ids) // page)
    layout = PoolLayout.build(cfg, CacheConfig(num_virtual_tokens=num_pages * page), num_pages)
    pools = KVPools(layout, model.lm_head.weight.dtype, device)
    vpages = pools.alloc_virtual_pages(num_pages)
    for vpage in vpages:
        pools.attach_swa(vpage)
    n = len(token_ids)
    rows = torch.arange(n, device=device)
    batch = ForwardBatch(
        input_ids=torch.tensor(token_ids, dtype=torch.long, device=device),
        positions=rows,
        req_index=torch.zeros(n, dtype=torch.long, device=device),
        block_tables=torch.tensor([vpages], dtype=torch.long, device=device),
        logits_indices=rows,
        spans=((0, n),),
        starts=(0,),
        vpages=(tuple(vpages),),
    )
    step = model.general_step(batch, pools)
    streams, _ = model.run_layers(batch.input_ids, step)
    return PlainOutput(model.logits(model.head(streams)), streams)
