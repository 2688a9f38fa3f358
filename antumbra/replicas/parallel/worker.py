"""A rank other than 0: a Ray actor that holds its shard of the model and of nothing else.

Its life, each step driven by rank 0 (`gang.py` starts it):
  1. `join`: build the process groups with the other ranks (`comm.Collectives`);
  2. `load`: read its shard of the checkpoint (`loader.py`) and put the model in the plan's
     formats; it reports the bytes it read and holds and its peak resident memory;
  3. `serve`: build its KV pools (the same layout as rank 0's), then loop: receive rank 0's
     `StepMessage`, mirror the bookkeeping into its pools, run the same forward on its shard
     (the collectives inside join rank 0's), until rank 0 sends `STOP` or a collective fails;
  4. a live weight update (`weight_sync.py`): `prepare_weights` stages its new shard beside the
     loop (or `drop_weights` forgets it), and rank 0's `WeightSwap`, between two steps, swaps it in.
It never schedules, samples or returns logits.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any

import torch

from antumbra.config import EngineConfig, ModelConfig

from ..build import build_pools, max_model_len, prepare_model
from ..decode_graphs import decode_graphs_for
from ..plan import resolve_dtype, resolve_plan
from .comm import Collectives
from .layers import build_rank_model, pack_like_plan
from .loader import load_shard, peak_rss_bytes
from .spec import ShardSpec
from .step import CAPTURE_ALL, STOP, FixedStep, PoolMirror, StepMessage
from .weight_sync import Prepared, Source, WeightSwap, worker_prepare, worker_swap

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
        self.staged: dict[int, Any] = {}  # new weights prepared for a swap, by token (`weight_sync.py`)
        self.dropped: set[int] = set()  # tokens of refused updates
        self.weights_version = "0"

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
        model = pack_like_plan(build_rank_model(self.model_config, self.spec, self.comm), self.plan)
        loaded = load_shard(path, self.model_config, self.spec, model, self.device, dtype)
        model.load_state_dict(loaded.state_dict, strict=True, assign=True)
        self.model = prepare_model(model, self.plan)
        return {"rank": self.spec.rank, "bytes_read": loaded.bytes_read, "bytes_held": loaded.bytes_held,
                "peak_rss_bytes": loaded.peak_rss_bytes}

    def serve(self) -> int:
        """Run rank 0's steps until it stops; -> the number of steps run.

        A step that raises here ends this process: its sockets close, so the other ranks' next
        collective fails at once (instead of waiting out the timeout) and rank 0 stops the engine."""
        assert self.comm is not None and self.model is not None, "join and load first"
        pools = build_pools(self.model_config, self.config, self.plan)
        mirror = PoolMirror(pools)
        graphs = decode_graphs_for(self.model, pools, max_model_len(self.model_config, self.config, pools),
                                   self.config, replace(self.plan, capture_at_start=False))
        try:
            while True:
                msg = self.comm.broadcast_object()
                if isinstance(msg, StepMessage):
                    self.model(mirror.apply(msg), pools)
                elif isinstance(msg, FixedStep):
                    assert graphs is not None, "rank 0 ran a fixed-shape step this rank's plan has not"
                    mirror.set_pages(msg.vpages, msg.swa_pages)
                    graphs.replay_inputs(msg.size, msg.count, msg.packed, msg.tables)
                elif msg == CAPTURE_ALL and graphs is not None:
                    graphs.capture_all()
                    continue
                elif isinstance(msg, WeightSwap):
                    worker_swap(self, msg)
                    continue
                elif msg == STOP:
                    return self.steps
                self.steps += 1
        except BaseException:
            log.exception("rank %d failed step %d; leaving the group", self.spec.rank, self.steps)
            logging.shutdown()
            os._exit(1)

    def prepare_weights(self, token: int, source: Source) -> Prepared:
        """Phase 1 of a live weight update (`weight_sync.py`): read and check this rank's new
        shard, staged under `token`; runs beside the step loop, whose `WeightSwap` swaps it in."""
        return worker_prepare(self, token, source)

    def drop_weights(self, token: int) -> None:
        """Forget what was staged under `token` (the update was refused on some rank)."""
        self.dropped.add(token)
        self.staged.pop(token, None)

    def version(self) -> str:
        return self.weights_version

    def stats(self) -> dict[str, float]:
        tensors = [] if self.model is None else list(self.model.state_dict().values())
        held = sum(t.numel() * t.element_size() for t in tensors)
        return {"rank": self.spec.rank, "steps": self.steps, "bytes_held": held,
                "peak_rss_bytes": peak_rss_bytes(),
                "collective_s": self.comm.seconds if self.comm else 0.0}


__all__ = ["RankWorker"]
