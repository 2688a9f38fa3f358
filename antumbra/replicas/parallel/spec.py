"""Which part of the model each rank of a tensor x expert parallel replica holds.

A replica of `T x E` ranks numbers them `rank = e * T + t`: `t` is the rank's place in its
tensor-parallel group (the T ranks sharing `e`), `e` its place in the expert-parallel
dimension. What rank (t, e) holds:

* attention: heads `[t*H/T, (t+1)*H/T)` of `q_b_proj` (rows), their sinks, and output groups
  `[t*G/T, (t+1)*G/T)` of the grouped output LoRA (`o_a_proj` rows, `o_b_proj` columns), so a
  group's heads and its LoRA live on one rank and the only collective is one all-reduce of
  the `o_b_proj` partial sums over the T ranks of its group;
* replicated on every rank: `q_a_proj` / `q_a_norm` (the query LoRA residual that the
  indexer also reads), `kv_proj` / `kv_norm` (V4's K = V latent is one 512-wide head shared
  by every query head: it cannot be split by heads, and computing it on every rank costs one
  [D, 512] matmul, less than gathering it), the compressors and the lightning indexer (their
  outputs are KV pool rows and the top-k that every head of every rank reads; SGLang computes
  them replicated for the same reason), embeddings, norms, mHC, the router, the shared expert
  and `lm_head`;
* routed experts: experts `[e*N/E, (e+1)*N/E)`, each with intermediate rows
  `[t*I/T, (t+1)*I/T)` (`gate_up_proj` rows of both halves, `down_proj` columns), so the routed
  weights are split over all T*E ranks; the MoE output is one all-reduce over all ranks.

Hence the KV pools: every rank holds every row of every pool (the latent is per token, not per
head), written identically by each rank; only the weights are sharded.
"""

from __future__ import annotations

from dataclasses import dataclass

from antumbra.config import ModelConfig

from ..plan import PlanError

# Checkpoint names (in-memory, per layer) and the dimension each is split along.
_HEAD_ROWS = ("self_attn.q_b_proj.weight",)  # [H*d, q_lora]: rows by head
_GROUP_ROWS = ("self_attn.o_a_proj.weight",)  # [G*r, H*d/G]: rows by group
_GROUP_COLS = ("self_attn.o_b_proj.weight",)  # [D, G*r]: columns by group


@dataclass(frozen=True)
class Shard:
    """The slice `[start, stop)` of dimension `dim` of a tensor a rank holds; for merged
    `gate_up_proj` (`halves=True`) the slice is taken in each half of `dim` and concatenated."""

    dim: int
    start: int
    stop: int
    halves: bool = False


@dataclass(frozen=True)
class ExpertShard:
    """Experts `[first, first + count)` of a merged `[N, ., .]` tensor, and within each the
    intermediate slice `inner` (None: whole)."""

    first: int
    count: int
    inner: Shard | None


@dataclass(frozen=True)
class ShardSpec:
    tp_size: int = 1
    ep_size: int = 1
    rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tp_size * self.ep_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def ep_rank(self) -> int:
        return self.rank // self.tp_size

    def tp_group(self) -> tuple[int, ...]:
        """The world ranks of this rank's tensor-parallel group."""
        base = self.ep_rank * self.tp_size
        return tuple(range(base, base + self.tp_size))

    def for_rank(self, rank: int) -> ShardSpec:
        return ShardSpec(self.tp_size, self.ep_size, rank)

    def check(self, cfg: ModelConfig) -> None:
        """Raise PlanError unless the model's heads, groups, experts and intermediate divide."""
        t, e = self.tp_size, self.ep_size
        problems = []
        if cfg.num_heads % t:
            problems.append(f"num_attention_heads={cfg.num_heads}")
        if cfg.o_groups % t:
            problems.append(f"o_groups={cfg.o_groups}")
        if cfg.moe_intermediate_size % t:
            problems.append(f"moe_intermediate_size={cfg.moe_intermediate_size}")
        if problems:
            raise PlanError(f"tensor_parallel_size={t} does not divide {', '.join(problems)}")
        if cfg.num_experts % e:
            raise PlanError(f"expert_parallel_size={e} does not divide n_routed_experts={cfg.num_experts}")

    # ---------------------------------------------------------------- sizes of the local model
    def heads(self, cfg: ModelConfig) -> int:
        return cfg.num_heads // self.tp_size

    def groups(self, cfg: ModelConfig) -> int:
        return cfg.o_groups // self.tp_size

    def experts(self, cfg: ModelConfig) -> range:
        n = cfg.num_experts // self.ep_size
        return range(self.ep_rank * n, (self.ep_rank + 1) * n)

    def intermediate(self, cfg: ModelConfig) -> int:
        return cfg.moe_intermediate_size // self.tp_size

    # ---------------------------------------------------------------- what a tensor's shard is
    def shard_of(self, name: str, shape: tuple[int, ...], cfg: ModelConfig) -> Shard | ExpertShard | None:
        """The part of tensor `name` (full `shape`) this rank holds; None: all of it (replicated)."""
        t = self.tp_rank
        if self.world_size == 1 or ".layers." not in name:
            return None
        local = name.split(".", 3)[-1]  # "self_attn.q_b_proj.weight" of "model.layers.3.self_attn..."
        if local in _HEAD_ROWS:
            n = shape[0] // self.tp_size
            return Shard(0, t * n, (t + 1) * n)
        if local in _GROUP_ROWS:
            n = shape[0] // self.tp_size
            return Shard(0, t * n, (t + 1) * n)
        if local in _GROUP_COLS:
            n = shape[1] // self.tp_size
            return Shard(1, t * n, (t + 1) * n)
        if local == "self_attn.sinks":
            n = shape[0] // self.tp_size
            return Shard(0, t * n, (t + 1) * n)
        experts = self.experts(cfg)
        inner_size = self.intermediate(cfg)
        if local == "mlp.experts.gate_up_proj":  # [N, 2I, D]
            inner = None if self.tp_size == 1 else Shard(0, t * inner_size, (t + 1) * inner_size, halves=True)
            return ExpertShard(experts.start, len(experts), inner)
        if local == "mlp.experts.down_proj":  # [N, D, I]
            inner = None if self.tp_size == 1 else Shard(1, t * inner_size, (t + 1) * inner_size)
            return ExpertShard(experts.start, len(experts), inner)
        return None

    def local_shape(self, name: str, shape: tuple[int, ...], cfg: ModelConfig) -> tuple[int, ...]:
        """The shape of this rank's part of `name`."""
        shard = self.shard_of(name, shape, cfg)
        out = list(shape)
        if isinstance(shard, ExpertShard):
            out[0] = shard.count
            shard = shard.inner
            if shard is not None:
                shard = Shard(shard.dim + 1, shard.start, shard.stop, shard.halves)
        if isinstance(shard, Shard):
            out[shard.dim] = (shard.stop - shard.start) * (2 if shard.halves else 1)
        return tuple(out)


__all__ = ["ExpertShard", "Shard", "ShardSpec"]
