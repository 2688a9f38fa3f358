"""Live weight updates of a parallel replica: every rank re-reads its own shard, and all ranks swap
to the new weights together, or none does.

The two-phase rule, driven by rank 0 (`gang.RankGang.prepare_weights` / `swap_weights`):
1. Prepare, on every rank at once, when the update is queued (`Training.queue_weights`, in the
   caller's thread; the replica keeps serving on the old weights meanwhile, the workers reading
   through an actor call beside their step loop). A rank reads its shard of the new checkpoint
   through the sharded loader (`loader.py`, which plans the checkpoint against the full model
   from its headers first: a missing, unexpected or mis-shaped tensor fails before any data is
   read), or takes the slices of a state dict that rank 0 cut for it (`layers.shard_tensor`);
   then checks every tensor against the live one it replaces (name, shape, dtype) and that its
   values are finite, and holds it staged under the update's token. Nothing live is touched.
2. Decide, on rank 0, from every rank's answer.
   * Any rank failed: every rank drops what it staged (an actor call), the update raises
     `WeightUpdateError` naming each failed rank and why, and nothing is queued: the replica
     serves on, on the old weights and version.
   * All prepared: the swap is queued on the driver (`driver.py`), which runs it between steps
     once the requests in flight have finished on the old weights (later ones wait). Rank 0
     sends `WeightSwap` through the step broadcast and swaps its own; each rank copies its
     staged tensors into its live ones (in place: captured decode graphs keep their addresses)
     before it reads the next message, so every step before the swap ran on the old weights on
     every rank and every step after it runs on the new ones on every rank. The ranks confirm
     the swap (one all-reduce) before the update's future resolves.
A rank that fails during the swap itself would leave the ranks on different weights: that is a
`FatalEngineError` (the engine stops and the replica restarts), never a silent mix.

Cost: from prepare to swap a rank holds its shard twice (the staged copy, on its device), once
more for each further update queued before the first is swapped in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from antumbra.config import ModelConfig

from ..plan import ExecutionPlan
from ..weights import WeightUpdateError, Writes, commit_writes, stage_weights
from .layers import build_rank_model, pack_like_plan, shard_tensor
from .loader import load_shard
from .spec import ShardSpec

log = logging.getLogger(__name__)

Source = str | Mapping[str, torch.Tensor]  # a checkpoint directory, or the rank's slices of a state dict


@dataclass(frozen=True)
class WeightSwap:
    """Sent through the step broadcast: swap in what was staged under `token` (every rank has it)."""

    token: int
    version: str


@dataclass(frozen=True)
class StagedUpdate:
    """An update every rank has prepared, waiting for its swap; `writes` are rank 0's."""

    token: int
    version: str
    writes: Writes
    tensors: int  # over all ranks


@dataclass(frozen=True)
class Prepared:
    """One rank's answer to prepare."""

    rank: int
    error: str | None  # None: staged, ready to swap
    tensors: int = 0


def _non_finite(state: Mapping[str, torch.Tensor]) -> list[str]:
    bad = []
    for name, t in state.items():
        if t.is_floating_point() and t.dtype != torch.float8_e8m0fnu:
            if not bool(torch.isfinite(t if t.element_size() > 1 else t.float()).all()):
                bad.append(name)
    return bad


def _against_live(model: nn.Module, state: Mapping[str, torch.Tensor]) -> Writes:
    """The rank's freshly loaded shard matched to its live tensors (same names, shapes, dtypes)."""
    live = dict(model.state_dict(keep_vars=True))
    problems = [f"unexpected {n}" for n in state if n not in live]
    problems += [f"missing {n}" for n in live if n not in state]
    problems += [f"{n}: {tuple(t.shape)} {t.dtype} for {tuple(live[n].shape)} {live[n].dtype}"
                 for n, t in state.items()
                 if n in live and (t.shape != live[n].shape or t.dtype != live[n].dtype)]
    if problems:
        raise WeightUpdateError(f"the new shard does not fit the rank's model: {problems[:5]}")
    return [(live[n], state[n]) for n in live]


def stage_rank_weights(source: Source, model: nn.Module, cfg: ModelConfig, spec: ShardSpec,
                       plan: ExecutionPlan, device: torch.device) -> Writes:
    """Phase 1 on one rank: its new weights read and checked, staged beside the live `model`."""
    if isinstance(source, Mapping):
        bad = _non_finite(source)
        writes = stage_weights(model, source)
    else:
        meta = pack_like_plan(build_rank_model(cfg, spec, None), plan)
        loaded = load_shard(source, cfg, spec, meta, device, plan.dtype)
        bad = _non_finite(loaded.state_dict)
        writes = _against_live(model, loaded.state_dict)
    if bad:
        raise WeightUpdateError(f"non-finite values (NaN or inf) in {bad[:5]}")
    return writes


def prepare(rank: int, stage: Callable[[], Writes]) -> tuple[Prepared, Writes | None]:
    """Run `stage`; -> the rank's answer and, when it succeeded, its staged writes."""
    try:
        writes = stage()
    except Exception as exc:  # any failure to prepare refuses the update on every rank
        return Prepared(rank, f"{type(exc).__name__}: {exc}"), None
    return Prepared(rank, None, len(writes)), writes


def swap_in(writes: Writes | None) -> bool:
    """Phase 2 on one rank: copy the staged weights into the live ones; False if it failed."""
    if writes is None:
        return False
    try:
        commit_writes(writes)
    except Exception:
        log.exception("swapping in the staged weights failed")
        return False
    return True


def rank_sources(source: str | Path | Mapping[str, torch.Tensor], cfg: ModelConfig,
                 spec: ShardSpec) -> list[Source]:
    """What each rank prepares from: the checkpoint directory, or its own slices of the state dict
    (cut on rank 0 and copied, so that only the slice travels and every rank, rank 0 too, keeps
    the values as they were now, whatever the caller does with its tensors before the swap)."""
    if not isinstance(source, Mapping):
        return [str(source)] * spec.world_size
    return [{n: shard_tensor(t.detach().cpu(), n, spec.for_rank(rank), cfg).clone()
             for n, t in source.items()} for rank in range(spec.world_size)]


def worker_prepare(worker: Any, token: int, source: Source) -> Prepared:
    """A worker's (`worker.py`) phase 1: stage its new weights in `worker.staged[token]`."""
    answer, writes = prepare(worker.spec.rank, lambda: stage_rank_weights(
        source, worker.model, worker.model_config, worker.spec, worker.plan, worker.device))
    if writes is not None and token not in worker.dropped:  # dropped: rank 0 gave up waiting for it
        worker.staged[token] = writes
    return answer


def worker_swap(worker: Any, msg: WeightSwap) -> None:
    """A worker's phase 2, on its step loop between two steps: swap in, and confirm with the others."""
    ok = swap_in(worker.staged.pop(msg.token, None))
    if ok:
        worker.weights_version = msg.version
    worker.comm.agree(ok)


__all__ = ["Prepared", "Source", "StagedUpdate", "WeightSwap", "prepare", "rank_sources",
           "stage_rank_weights", "swap_in", "worker_prepare", "worker_swap"]
