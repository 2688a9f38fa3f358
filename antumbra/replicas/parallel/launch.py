"""`Engine.from_pretrained` with more than one rank: start the gang, load every rank's shard.

Rank 0 (this process) loads its shard while the workers load theirs, all reading the same
files (`loader.py`); the replica is ready when every rank has its shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from antumbra.config import EngineConfig, ModelConfig

from ..build import load_tokenizer
from ..model.checkpoint_files import detect_layout, load_hf_config
from ..model.model import DeepseekV4
from ..plan import resolve_dtype, resolve_plan
from .gang import RankGang
from .layers import build_rank_model, pack_like_plan
from .loader import load_shard
from .spec import ShardSpec


@dataclass(frozen=True)
class ParallelParts:
    model: DeepseekV4  # rank 0's shard
    tokenizer: Any | None
    mtp_state_dict: dict[str, torch.Tensor]
    layout: str
    gang: RankGang
    loads: list[dict[str, int]]  # per rank: bytes_read, bytes_held, peak_rss_bytes


def load_parallel(path: str | Path, config: EngineConfig, progress: bool | None,
                  cpus_per_rank: float = 1.0) -> ParallelParts:
    path = Path(path)
    cfg = ModelConfig.from_hf(load_hf_config(path))
    spec = ShardSpec(config.tensor_parallel_size, config.expert_parallel_size, 0)
    spec.check(cfg)  # a model the sizes do not divide fails before any rank starts
    layout = detect_layout(path)
    gang = RankGang(spec, config, cfg, layout, cpus_per_rank=cpus_per_rank).start()
    try:
        import ray

        refs = gang.load_workers(str(path))
        assert gang.comm is not None
        device = gang.comm.device
        model = pack_like_plan(build_rank_model(cfg, spec, gang.comm), resolve_plan(config, layout))
        loaded = load_shard(path, cfg, spec, model, device, resolve_dtype(config.dtype), bool(progress))
        model.load_state_dict(loaded.state_dict, strict=True, assign=True)
        mine = {"rank": 0, "bytes_read": loaded.bytes_read, "bytes_held": loaded.bytes_held,
                "peak_rss_bytes": loaded.peak_rss_bytes}
        loads = [mine] + list(ray.get(refs, timeout=gang.timeout_s * 10))
    except BaseException:
        gang.shutdown()
        raise
    gang.loads = loads
    return ParallelParts(model, load_tokenizer(path), loaded.mtp_state_dict, layout, gang, loads)


__all__ = ["ParallelParts", "load_parallel"]
