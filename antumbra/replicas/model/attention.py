"""Hybrid attention of one layer: a sliding window plus compressed entries, one softmax.

For a query at position p the keys are the window rows p-W+1..p (SWA pool) and,
per layer type, no compressed entries (sliding), the indexer's top-k of the C_m
entries (CSA) or all causal C_m entries (HCA). K = V (one latent head shared by
all query heads); a per-head sink logit joins the softmax and is dropped after.
The RoPE slice of the output is de-rotated at the query position, then the
grouped low-rank output projection mixes heads.
"""

from __future__ import annotations

import torch
from torch import nn

from antumbra.cachestore.pools import KVPools
from antumbra.config import CSA, HCA, SLIDING, ModelConfig

from .compressor import Indexer, WindowCompressor
from .forward_batch import StepIndex
from .norms import RMSNorm, unweighted_rms_norm
from .rope import RotaryTable, apply_rope


class Compressor(WindowCompressor):
    """The main compressor of a CSA / HCA layer; CSA layers also own the indexer."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        kind = cfg.layer_types[layer]
        rate = cfg.compress_rates[kind]
        super().__init__(cfg.hidden_size, cfg.head_dim, rate, 2 if kind == CSA else 1, cfg.rms_norm_eps)
        if kind == CSA:
            self.indexer = Indexer(
                cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, rate, cfg.index_topk,
                cfg.rms_norm_eps,
            )


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.kind = cfg.layer_types[layer]
        self.rate = cfg.compress_rate(layer)
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.o_groups = cfg.o_groups
        self.eps = cfg.rms_norm_eps
        h, d = cfg.num_heads, cfg.head_dim
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * d, bias=False)
        self.kv_proj = nn.Linear(cfg.hidden_size, d, bias=False)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.o_a_proj = nn.Linear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        if self.kind != SLIDING:
            self.compressor = Compressor(cfg, layer)

    def forward(
        self,
        x: torch.Tensor,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor],
        rope: RotaryTable,
        index: StepIndex,
        pools: KVPools,
    ) -> torch.Tensor:
        """x: [T, D] normed block input -> [T, D]."""
        t = x.shape[0]
        cos, sin = rope_cos_sin
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_residual).view(t, self.num_heads, self.head_dim)
        q = apply_rope(unweighted_rms_norm(q, self.eps), cos, sin)
        kv = apply_rope(self.kv_norm(self.kv_proj(x)), cos, sin)  # [T, d]
        swa = pools.swa_kv[self.layer]
        swa[index.new_swa_rows] = kv.to(swa.dtype)

        keys = swa[index.window.rows]  # [T, W, d]
        valid = index.window.valid
        if self.kind != SLIDING:
            comp_keys, comp_valid = self._compressed_keys(x, q_residual, cos, sin, rope, index, pools)
            keys = torch.cat([keys, comp_keys], dim=1)
            valid = torch.cat([valid, comp_valid], dim=1)
        out = self._attend(q, keys.to(q.dtype), valid)
        out = apply_rope(out, cos, -sin)
        return self._project_out(out)

    def _compressed_keys(self, x, q_residual, cos, sin, rope, index, pools):
        comp = self.compressor
        cidx = index.compressed[self.rate]
        pool = pools.compressors[self.layer]
        comp.write_state(x, index.new_swa_rows, pool)
        comp.compress(cidx, pool, rope, x.dtype)
        if self.kind == HCA:
            rows, valid = cidx.entry_rows, cidx.entry_valid
        else:
            ipool = pools.indexers[self.layer]
            comp.indexer.write_state(x, index.new_swa_rows, ipool)
            comp.indexer.compress(cidx, ipool, rope, x.dtype)
            rows, valid = comp.indexer.select(x, q_residual, cos, sin, cidx, ipool, index.spans)
        return pool.rows[rows], valid

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """q: [T, H, d], keys (= values): [T, K, d], valid: [T, K] -> [T, H, d]."""
        logits = torch.einsum("thd,tkd->thk", q, keys) * self.head_dim**-0.5
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        sinks = self.sinks.to(logits.dtype)[None, :, None].expand(q.shape[0], -1, 1)
        combined = torch.cat([logits, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1)[..., :-1]
        return torch.einsum("thk,tkd->thd", probs.to(keys.dtype), keys)

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:
        """Grouped low-rank projection: per-group [H*d/g -> r], then [g*r -> D]."""
        t = out.shape[0]
        grouped = out.reshape(t, self.o_groups, -1)  # [T, g, H*d/g]
        w = self.o_a_proj.weight.view(self.o_groups, -1, grouped.shape[-1])  # [g, r, H*d/g]
        mixed = torch.einsum("tgi,gri->tgr", grouped, w).reshape(t, -1)
        return self.o_b_proj(mixed)
