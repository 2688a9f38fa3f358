"""The model of one rank: `DeepseekV4` with its attention and routed experts cut to the rank's
shard (`spec.py` says which part) and the collectives that put the whole back together.

Invariant: every rank's forward produces the same residual streams as the one-rank model
(up to the summation order of the all-reduces): attention all-reduces the `o_b_proj` partial
sums of its tensor-parallel group before the residual add, and the MoE all-reduces the routed
experts' partial sums over every rank, then adds the replicated shared expert. All ranks end
a layer holding bitwise the same streams (an all-reduce hands every rank the same sum), so the
replicated parts (indexer top-k, routing, HiSparse gathers) choose the same on every rank.
"""

from __future__ import annotations

import dataclasses

import torch

from antumbra.config import ModelConfig

from ..model.attention import Attention
from ..model.fp8_linear import pack_fp8_linears
from ..model.model import DeepseekV4
from ..model.moe import Experts, MoE
from ..model.packed_experts import pack_experts
from ..plan import ExecutionPlan, ExpertFormat, LinearFormat
from .comm import Collectives
from .spec import ShardSpec


class ParallelMoE(MoE):
    """MoE of one rank: the full router, its routed experts (a slice of ids and of the
    intermediate dim), the shared expert replicated; one all-reduce over all ranks.

    The parameter names are those of `MoE` (`gate`, `experts`, `shared_experts`), so a state
    dict of the rank's shard loads by name."""

    def __init__(self, cfg: ModelConfig, layer: int, spec: ShardSpec, comm: Collectives | None) -> None:
        super().__init__(cfg, layer)
        experts = spec.experts(cfg)
        self.first_expert = experts.start
        self.num_local = len(experts)
        self.experts = Experts(dataclasses.replace(cfg, num_experts=self.num_local,
                                                   moe_intermediate_size=spec.intermediate(cfg)))
        self.comm = comm

    def forward(
        self, x: torch.Tensor, x_act: torch.Tensor, input_ids: torch.Tensor, fixed_shape: bool = False,
        replay: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `MoE.forward` (x the same on every rank) -> ([T, D], routed expert ids [T, k] int64).

        The general step runs each of this rank's routed pairs once (one pair per row: the expert
        module sees [M, D] tokens with k = 1). A fixed-shape step may not size work from the routing
        (no host sync, so a CUDA graph can hold it): every local expert runs on every row, the other
        ranks' pairs weighted 0."""
        weights, indices = self.gate(x, input_ids, replay)
        local = indices - self.first_expert
        mine = (local >= 0) & (local < self.num_local)  # [T, k]: the pairs this rank's experts serve
        if fixed_shape:
            weights = torch.where(mine, weights, torch.zeros_like(weights))
            local = torch.where(mine, local, torch.zeros_like(local))
            routed = self.experts(x_act, weights, local, fixed_shape)
        else:
            tokens, slot = mine.nonzero(as_tuple=True)
            routed = torch.zeros_like(x)
            if tokens.numel():
                pairs = (weights[tokens, slot][:, None], local[tokens, slot][:, None])
                pair_out = self.experts(x_act[tokens], *pairs)
                routed.index_add_(0, tokens, pair_out.to(routed.dtype))
        if self.comm is not None:
            self.comm.all_reduce_world(routed)
        return routed + self.shared_experts(x_act), indices


def build_rank_model(cfg: ModelConfig, spec: ShardSpec, comm: Collectives | None) -> DeepseekV4:
    """The rank's model on the meta device (parameters to be assigned by the loader).

    `model.config` stays the full model's config: pools, scheduler and sampler read it."""
    spec.check(cfg)
    with torch.device("meta"):
        model = DeepseekV4(cfg)
        if spec.world_size == 1:
            return model
        attn_cfg = dataclasses.replace(cfg, num_heads=spec.heads(cfg), o_groups=spec.groups(cfg))
        for i, layer in enumerate(model.model.layers):
            layer.self_attn = Attention(attn_cfg, i)
            layer.mlp = ParallelMoE(cfg, i, spec, comm)
    if comm is not None and spec.tp_size > 1:
        for layer in model.model.layers:
            attn: Attention = layer.self_attn  # type: ignore[assignment]
            attn.output_reduce = comm.all_reduce_tp
    return model


def pack_like_plan(model: DeepseekV4, plan: ExecutionPlan) -> DeepseekV4:
    """Swap the (meta) model's experts / linears for their packed modules when the plan keeps
    them packed, so the loader fills the packed buffers directly (`packed_load.py`)."""
    if plan.expert_format is ExpertFormat.MXFP4:
        pack_experts(model)
    if plan.linear_format is LinearFormat.FP8:
        pack_fp8_linears(model)
    return model


def shard_tensor(value: torch.Tensor, name: str, spec: ShardSpec, cfg: ModelConfig) -> torch.Tensor:
    """This rank's part of the full tensor `value` named `name` (a view where possible)."""
    from .spec import ExpertShard, Shard

    shard = spec.shard_of(name, tuple(value.shape), cfg)
    if shard is None:
        return value
    if isinstance(shard, ExpertShard):
        value = value[shard.first : shard.first + shard.count]
        if shard.inner is None:
            return value
        shard = Shard(shard.inner.dim + 1, shard.inner.start, shard.inner.stop, shard.inner.halves)
    if not shard.halves:
        return value.narrow(shard.dim, shard.start, shard.stop - shard.start)
    half = value.shape[shard.dim] // 2
    width = shard.stop - shard.start
    return torch.cat([value.narrow(shard.dim, shard.start, width),
                      value.narrow(shard.dim, half + shard.start, width)], dim=shard.dim)


__all__ = ["ParallelMoE", "build_rank_model", "pack_like_plan", "shard_tensor"]
