"""What rank 0 broadcasts before each forward, and how another rank applies it to its pools.

Rank 0 owns the scheduler, ShadowRadix and every piece of pool bookkeeping (free lists, the
virtual-page -> SWA-page table, HiSparse buffer ownership). Another rank holds pool *rows*
only, the same rows as rank 0 (see `spec.py`), and needs from the bookkeeping exactly what its
forward reads:
* the step's `ForwardBatch` (token ids, positions, request index, block tables, logits rows,
  spans, replay limits, hot buffers, replayed experts), CPU tensors;
* the SWA page of each virtual page in the block tables (the forward reads the table only at
  those pages; the other entries of a rank's table may be stale and are never read);
* the generation of each HiSparse hot buffer in the step: a buffer whose generation changed
  was released and given to another request since the rank last saw it, so its residency map
  is reset before the forward (the gathers then run the same LRU on every rank);
* the compressed-row copies that admission made since the last step (SWA replay copies a
  cached page's compressed rows into a request's own pages), applied before the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from antumbra.cachestore.pools import KVPools

from ..model.forward_batch import ForwardBatch


@dataclass(frozen=True)
class StepMessage:
    batch: ForwardBatch  # on the CPU
    vpages: torch.Tensor  # [P] int64 virtual pages of the block tables
    swa_pages: torch.Tensor  # [P] int64 their SWA pages (-1: none)
    hot_generations: tuple[int, ...]  # per request of the batch (-1: no hot buffer)
    copies: tuple[tuple[int, int], ...]  # (from vpage, to vpage) compressed-row copies, in order


@dataclass(frozen=True)
class FixedStep:
    """A fixed-shape decode step (`decode_graphs.py`): rank 0's static inputs, and the SWA pages
    of the virtual pages its block tables name (the graphs read the device table there)."""

    size: int  # padded batch size (the graph's)
    count: int  # live rows
    packed: torch.Tensor  # [4, size] int64: token ids, positions, active, sources
    tables: torch.Tensor  # [size, P] int64 block tables
    vpages: torch.Tensor  # [K] int64
    swa_pages: torch.Tensor  # [K] int64


STOP = "stop"  # the message that ends another rank's loop
CAPTURE_ALL = "capture_all"  # capture every decode graph now (rank 0 does the same)


def fixed_step(
    size: int, count: int, packed: torch.Tensor, tables: torch.Tensor, pools: KVPools
) -> FixedStep:
    vpages = torch.unique(tables[tables >= 0])
    swa = pools.swa_page_of_vpage[vpages.to(pools.swa_page_of_vpage.device)].cpu()
    return FixedStep(size, count, packed, tables, vpages, swa)


def _to(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    moved: dict[str, Any] = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            moved[f.name] = value.to(device)
    return replace(batch, **moved)


def step_message(batch: ForwardBatch, pools: KVPools) -> StepMessage:
    """Rank 0: the message for this forward (drains the pools' recorded copies)."""
    tables = batch.block_tables
    vpages = torch.unique(tables[tables >= 0])
    swa = pools.swa_page_of_vpage[vpages.to(pools.swa_page_of_vpage.device)]
    hot = pools.hot
    gens = tuple(hot.generation[b] if hot is not None and b >= 0 else -1 for b in batch.hot_buffers)
    copies = tuple(pools.compressed_copies or ())
    if pools.compressed_copies is not None:
        pools.compressed_copies.clear()
    return StepMessage(_to(batch, torch.device("cpu")), vpages.cpu(), swa.cpu(), gens, copies)


class PoolMirror:
    """Another rank's view of rank 0's bookkeeping: applies each message to its own pools."""

    def __init__(self, pools: KVPools) -> None:
        self.pools = pools
        self._generations: dict[int, int] = {}

    def set_pages(self, vpages: torch.Tensor, swa_pages: torch.Tensor) -> None:
        self.pools.mirror_swa_pages(vpages, swa_pages)

    def apply(self, msg: StepMessage) -> ForwardBatch:
        """Bring the pools to rank 0's state for this forward; -> the batch on this rank's device."""
        pools = self.pools
        self.set_pages(msg.vpages, msg.swa_pages)
        for src, dst in msg.copies:
            pools.copy_compressed(src, dst)
        hot = pools.hot
        if hot is not None:
            for buffer, generation in zip(msg.batch.hot_buffers, msg.hot_generations, strict=True):
                if buffer >= 0 and self._generations.get(buffer) != generation:
                    hot.reset(buffer)
                    self._generations[buffer] = generation
        return _to(msg.batch, pools.device)


__all__ = ["CAPTURE_ALL", "STOP", "FixedStep", "PoolMirror", "StepMessage", "fixed_step", "step_message"]
