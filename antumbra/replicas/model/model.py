"""The DeepSeek-V4 architecture over paged pools.

Parameter names follow the in-memory names of the reference implementation
(`model.layers.L.self_attn.q_a_proj.weight`, ...), so a state dict in that naming
loads directly. A forward step takes a `ForwardBatch` of T flattened tokens from
any mix of prefill chunks and decodes and returns logits for the rows it asks for.

The layers are written once: `run_layers` runs them over a `LayerStep` (step.py), which the general
step builds here from host facts and the fixed-shape decode step (fast_decode.py) on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from antumbra.cachestore.pools import KVPools
from antumbra.config import CSA, ModelConfig
from antumbra.kernels.mhc.triton import mhc_post, mhc_pre

from .attention import Attention
from .compressor import WindowCompressor
from .decode_index import DecodeIndex
from .forward_batch import ForwardBatch, StepIndex, build_step_index
from .hyper_connections import HyperConnection, HyperHead
from .moe import Experts, MoE, SharedExpert
from .norms import RMSNorm
from .numerics import EXACT, Numerics
from .packed_experts import PackedExperts
from .rope import RotaryTable
from .step import LayerStep, normed


def head_product(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [N, D] in the model dtype, weight [V, D] rows of an LM head -> [N, V] float32.

    The head's product accumulates in float32 and stays float32, as the reference implementation
    runs its head: rounded to bf16, logits near 20 move in steps of 0.125, coarser than the
    differences between two correct decode paths, and every logprob would carry that step."""
    # `mm` with an output dtype has no backward: a hidden state that carries gradients (the MTP
    # distillation's block output) takes the float32 product below.
    if hidden.is_cuda and hidden.dtype == weight.dtype != torch.float32 and not hidden.requires_grad:
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)  # cuBLAS: bf16 in, float32 out
    return nn.functional.linear(hidden.float(), weight.float())


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MoE(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def forward(
        self, streams: torch.Tensor, input_ids: torch.Tensor, step: LayerStep,
        replay: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """streams: [T, n, D] -> ([T, n, D], routed expert ids [T, k]); replay: [T, k] or None."""
        numerics = self.self_attn.numerics
        collapsed, post, comb = _hc_pre(self.attn_hc, streams, step.kernels)
        x, x_act = normed(self.input_layernorm, collapsed, numerics, step.kernels)
        streams = _hc_post(streams, self.self_attn(x, x_act, step), post, comb, step.kernels)
        collapsed, post, comb = _hc_pre(self.ffn_hc, streams, step.kernels)
        x, x_act = normed(self.post_attention_layernorm, collapsed, numerics, step.kernels)
        mlp_out, experts = self.mlp(x, x_act, input_ids, step.fixed_shape, replay)
        return _hc_post(streams, mlp_out, post, comb, step.kernels), experts


def _hc_pre(hc: HyperConnection, streams: torch.Tensor, kernels: bool):
    if kernels:
        return mhc_pre(streams.contiguous(), hc.fn, hc.base, hc.scale, hc.iters, hc.hc_eps, hc.norm_eps)
    return hc.pre(streams)


def _hc_post(streams, block_out, post, comb, kernels: bool) -> torch.Tensor:
    if kernels:
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
    # [M, n, D] the last layer's residual streams (before hc_head) at rows batch.stream_indices: what
    # the MTP draft block reads; None when the batch asks for none
    streams: torch.Tensor | None = None


# Modules whose forward depends on the numerics mode.
_QUANTISING = (Attention, WindowCompressor, Experts, SharedExpert, PackedExperts)


class DeepseekV4(nn.Module):
    def __init__(self, cfg: ModelConfig, numerics: Numerics = EXACT) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._ropes: dict[str, RotaryTable] = {}
        self.use_kernels = False  # the general step's Triton kernels (`set_kernels`, from the plan)
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
        compressor, the indexer's scores + top-k and hybrid attention (the fixed-shape decode step
        always does). They implement exact numerics, so release numerics keep the PyTorch path."""
        if enabled and self.numerics != EXACT:
            raise ValueError("the kernels implement exact numerics; release numerics run the PyTorch path")
        self.use_kernels = enabled

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, D] final normed states in the model dtype -> [N, V] float32 logits."""
        return head_product(hidden, self.lm_head.weight)

    def rope_tables(self) -> dict[str, RotaryTable]:
        device = self.lm_head.weight.device
        if not self._ropes or self._ropes["main"].inv_freq.device != device:
            self._ropes = {
                "main": RotaryTable(self.config.main_rope, device),
                "compress": RotaryTable(self.config.compress_rope, device),
            }
        return self._ropes

    def general_step(self, batch: ForwardBatch, pools: KVPools) -> LayerStep:
        """What the layers read for a general step of `batch` (its index built from host facts)."""
        cfg = self.config
        rates = {cfg.compress_rate(i) for i in range(cfg.num_layers)} - {0}
        index = build_step_index(batch, pools, cfg.sliding_window, rates)
        return self.layer_step(index, pools, batch.positions, self.use_kernels)

    def layer_step(
        self, index: StepIndex | DecodeIndex, pools: KVPools, positions: torch.Tensor, kernels: bool,
        side: torch.cuda.Stream | None = None,
    ) -> LayerStep:
        """The `LayerStep` of a built index at `positions` [T]."""
        ropes = self.rope_tables()
        cos_sin = {name: table.cos_sin(positions) for name, table in ropes.items()}
        return LayerStep(index, pools, cos_sin, ropes["compress"], kernels, side)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> the residual streams [T, n, D] the first layer reads."""
        # One gather into the n copies (an expanded view of the ids), not a gather and a copy.
        return self.model.embed_tokens(input_ids[:, None].expand(-1, self.config.hc_mult))

    def run_layers(
        self, input_ids: torch.Tensor, step: LayerStep, replay: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Every layer over the step -> (streams [T, n, D], routed expert ids [T, k] per layer);
        replay: [T, L, k] experts to use (routing replay) or None."""
        streams = self.embed(input_ids)
        routed = []
        for i, layer in enumerate(self.model.layers):
            streams, experts = layer(streams, input_ids, step, None if replay is None else replay[:, i])
            routed.append(experts)
        if not step.fixed_shape:
            # The HiSparse host-tier writes this step queued land before anything after the step.
            step.pools.order_host_writes()
        return streams, routed

    def head(self, streams: torch.Tensor) -> torch.Tensor:
        """streams: [N, n, D] -> the final normed hidden states [N, D] lm_head reads."""
        return self.model.norm(self.model.hc_head(streams))

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, pools: KVPools) -> StepOutput:
        step = self.general_step(batch, pools)
        streams, routed = self.run_layers(batch.input_ids, step, batch.routed_experts)
        hidden = self.head(streams[batch.logits_indices])
        kept = streams[batch.stream_indices] if batch.stream_indices is not None else None
        return StepOutput(self.logits(hidden), routed_experts=torch.stack(routed, dim=1), hidden=hidden,
                          streams=kept)
