"""The DeepSeek-V4 architecture over paged pools.

Parameter names follow the in-memory names of the reference implementation
(`model.layers.L.self_attn.q_a_proj.weight`, ...), so a state dict in that naming
loads directly. A forward step takes a `ForwardBatch` of T flattened tokens from
any mix of prefill chunks and decodes and returns logits for the rows it asks for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from antumbra.cachestore.pools import KVPools
from antumbra.config import CSA, SLIDING, ModelConfig
from antumbra.kernels.mhc.triton import mhc_post, mhc_pre

from .attention import Attention
from .compressor import WindowCompressor
from .forward_batch import ForwardBatch, build_step_index
from .hyper_connections import HyperConnection, HyperHead
from .moe import Experts, MoE, SharedExpert
from .norms import RMSNorm
from .numerics import EXACT, Numerics
from .packed_experts import PackedExperts
from .rope import RotaryTable


class DecoderLayer(nn.Module):
    use_kernels: bool = False  # set model-wide by DeepseekV4.set_kernels

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MoE(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def forward(self, streams, input_ids, rope_cos_sin, rope, index, pools, replay=None):
        """streams: [T, n, D] -> ([T, n, D], routed expert ids [T, k]); replay: [T, k] or None."""
        collapsed, post, comb = self._hc_pre(self.attn_hc, streams)
        attn_out = self.self_attn(self.input_layernorm(collapsed), rope_cos_sin, rope, index, pools)
        streams = self._hc_post(streams, attn_out, post, comb)
        collapsed, post, comb = self._hc_pre(self.ffn_hc, streams)
        mlp_out, experts = self.mlp(self.post_attention_layernorm(collapsed), input_ids, replay)
        return self._hc_post(streams, mlp_out, post, comb), experts

    def _hc_pre(self, hc: HyperConnection, streams: torch.Tensor):
        if self.use_kernels:
            return mhc_pre(streams.contiguous(), hc.fn, hc.base, hc.scale, hc.iters, hc.hc_eps, hc.norm_eps)
        return hc.pre(streams)

    def _hc_post(self, streams, block_out, post, comb) -> torch.Tensor:
        if self.use_kernels:
            return mhc_post(streams.contiguous(), block_out.contiguous(), post, comb)
        return HyperConnection.post(streams, block_out, post, comb)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg)


@dataclass(frozen=True)
class StepOutput:
    logits: torch.Tensor  # [N, V] float32, rows = batch.logits_indices
    routed_experts: torch.Tensor  # [T, L, k] int64 routed expert ids per token and layer
    hidden: torch.Tensor  # [N, D] the final normed hidden state lm_head reads, rows as logits


# Modules whose forward depends on the numerics mode.
_QUANTISING = (Attention, WindowCompressor, Experts, SharedExpert, PackedExperts)


class DeepseekV4(nn.Module):
    def __init__(self, cfg: ModelConfig, numerics: Numerics = EXACT) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._ropes: dict[str, RotaryTable] = {}
        self.set_numerics(numerics)

    def set_numerics(self, numerics: Numerics) -> None:
        """Switch every layer to `numerics` (see `numerics.py`); pools filled under another mode
        hold values of that mode, so switch before serving, not between steps of live requests."""
        width = self.config.index_head_dim
        if numerics.indexer_fp4 and CSA in self.config.layer_types and width & (width - 1):
            raise ValueError(
                "release numerics rotate indexer heads, which needs a power-of-two index_head_dim, "
                f"not {width}"
            )
        self.numerics = numerics
        for module in self.modules():
            if isinstance(module, _QUANTISING):
                module.numerics = numerics

    def set_kernels(self, enabled: bool) -> None:
        """Run the general (prefill and mixed) step through the Triton kernels: mHC, the fused
        compressor, the indexer's scores + top-k and hybrid attention. They implement exact
        numerics, so release numerics keep the PyTorch path."""
        if enabled and self.numerics != EXACT:
            raise ValueError("the kernels implement exact numerics; release numerics run the PyTorch path")
        for module in self.modules():
            if isinstance(module, (DecoderLayer, Attention, WindowCompressor)):
                module.use_kernels = enabled

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, D] final normed states in the model dtype -> [N, V] float32 logits.

        The head's product accumulates in float32 and stays float32, as the reference implementation
        runs its head: rounded to bf16, logits near 20 move in steps of 0.125, coarser than the
        differences between two correct decode paths, and every logprob would carry that step."""
        weight = self.lm_head.weight  # [V, D]
        if hidden.is_cuda and hidden.dtype == weight.dtype != torch.float32:
            return torch.mm(hidden, weight.t(), out_dtype=torch.float32)  # cuBLAS: bf16 in, float32 out
        return nn.functional.linear(hidden.float(), weight.float())

    def rope_tables(self) -> dict[str, RotaryTable]:
        device = self.lm_head.weight.device
        if not self._ropes or self._ropes["main"].inv_freq.device != device:
            self._ropes = {
                "main": RotaryTable(self.config.main_rope, device),
                "compress": RotaryTable(self.config.compress_rope, device),
            }
        return self._ropes

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, pools: KVPools) -> StepOutput:
        cfg = self.config
        rates = {cfg.compress_rate(i) for i in range(cfg.num_layers)} - {0}
        index = build_step_index(batch, pools, cfg.sliding_window, rates)
        ropes = self.rope_tables()
        cos_sin = {name: table.cos_sin(batch.positions) for name, table in ropes.items()}

        hidden = self.model.embed_tokens(batch.input_ids)
        streams = hidden.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()  # [T, n, D]
        routed = []
        replay = batch.routed_experts
        for i, layer in enumerate(self.model.layers):
            kind = "main" if cfg.layer_types[i] == SLIDING else "compress"
            streams, experts = layer(streams, batch.input_ids, cos_sin[kind], ropes["compress"], index, pools,
                                     None if replay is None else replay[:, i])
            routed.append(experts)
        wanted = streams[batch.logits_indices]
        hidden = self.model.norm(self.model.hc_head(wanted))
        logits = self.logits(hidden)
        return StepOutput(logits=logits, routed_experts=torch.stack(routed, dim=1), hidden=hidden)
