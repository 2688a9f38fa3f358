"""A rank other than 0: a Ray actor that holds its shard of the model and of nothing else.

Its life, each step driven by rank 0 (`gang.py` starts it):
  1. `join`: build the process groups with the other ranks (`comm.Collectives`);
  2. `load`: read its shard of the checkpoint (`loader.py`) and put the model in the plan's
     formats; it reports the bytes it read and holds and its peak resident memory;
  3. `serve`: build its KV pools (the same layout as rank 0's), then loop: receive rank 0's
     `StepMessage`, mirror the bookkeeping into its pools, run the same forward on its shard
     (the collectives inside join rank 0's), until rank 0 sends `STOP` or a collective fails.
It never schedules, samples or returns logits.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from antumbra.config import EngineConfig, ModelConfig

from ..build import build_pools, prepare_model
from ..plan import resolve_dtype, resolve_plan
from .comm import Collectives
from .layers import build_rank_model
from .loader import load_shard, peak_rss_bytes
from .spec import ShardSpec
from .step import STOP, PoolMirror

log = logging.getLogger(__name__)


class RankWorker:
    def __init__(self, spec: ShardSpec, config: EngineConfig, model_config: ModelConfig, layout: str) -> None:
        self.spec = spec
        self.config = config
        self.model_config = model_config
        self.plan = resolve_plan(config, layout)
        self.device = self.plan.device
        if self.device.type == "cuda":
            torch.cuda.set_device(0)  # Ray exposes only this rank's GPU
            self.device = torch.device("cuda", 0)
            self.plan = resolve_plan(config, layout)
        else:
            torch.set_num_threads(max(1, int(os.environ.get("ANTUMBRA_RANK_THREADS", "1"))))
        self.comm: Collectives | None = None
        self.model: Any = None
        self.steps = 0

    def node_address(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def gpu_ids(self) -> list[int]:
        import ray

        return [int(g) for g in ray.get_gpu_ids()]

    def pid(self) -> int:
        return os.getpid()

    def join(self, host: str, port: int, timeout_s: float) -> int:
        self.comm = Collectives(self.spec, host, port, self.device, timeout_s)
        return self.spec.rank

    def load(self, path: str) -> dict[str, int]:
        dtype = resolve_dtype(self.config.dtype)
        model = build_rank_model(self.model_config, self.spec, self.comm)
        loaded = load_shard(path, self.model_config, self.spec, model, self.device, dtype)
        model.load_state_dict(loaded.state_dict, strict=True, assign=True)
        self.model = prepare_model(model, self.plan)
        return {"rank": self.spec.rank, "bytes_read": loaded.bytes_read, "bytes_held": loaded.bytes_held,
                "peak_rss_bytes": loaded.peak_rss_bytes}

    def serve(self) -> int:
        """Run rank 0's steps until it stops; -> the number of steps run."""
        assert self.comm is not None and self.model is not None, "join and load first"
        pools = build_pools(self.model_config, self.config, self.plan)
        mirror = PoolMirror(pools)
        while True:
            msg = self.comm.broadcast_object()
            if msg == STOP:
                return self.steps
            batch = mirror.apply(msg)
            self.model(batch, pools)
            self.steps += 1

    def stats(self) -> dict[str, float]:
        held = (
            0
            if self.model is None
            else sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        )
        return {
            "rank": self.spec.rank,
            "steps": self.steps,
            "bytes_held": held,
            "peak_rss_bytes": peak_rss_bytes(),
            "collective_s": self.comm.seconds if self.comm else 0.0,
        }


__all__ = ["RankWorker"]
