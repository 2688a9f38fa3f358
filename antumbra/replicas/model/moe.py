"""Mixture of experts: hash-routed or score-routed top-k experts plus one shared expert.

Routing weights are the scoring function's values at the chosen experts,
normalised to sum to one and multiplied by `routed_scaling_factor`. Score routing
picks experts by `score + correction_bias`; hash routing by `tid2eid[token_id]`.
Every expert (shared included) is SwiGLU with the gate clamped above and the up
projection clamped on both sides at `swiglu_limit`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from antumbra.config import HASH_MOE, ModelConfig
from antumbra.kernels.gemv import gemv, takes_gemv
from antumbra.kernels.moe_router import DTYPES as ROUTER_DTYPES
from antumbra.kernels.moe_router import SCORINGS as ROUTER_SCORINGS
from antumbra.kernels.moe_router import route as fused_route
from antumbra.kernels.swiglu import DTYPES as FUSED_SWIGLU_DTYPES
from antumbra.kernels.swiglu import swiglu as fused_swiglu

from .fp8_linear import project_pair
from .numerics import EXACT, Numerics


def score_fn(name: str, logits: torch.Tensor) -> torch.Tensor:
    if name == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if name == "sigmoid":
        return torch.sigmoid(logits)
    if name == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"unsupported scoring_func {name!r}")


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


# Decode-sized batches of small expert sets run every expert densely (see Experts.dense).
DENSE_MAX_TOKENS = 16
DENSE_MAX_EXPERTS = 64


class Router(nn.Module):
    """Gate of one MoE layer; hash layers carry `tid2eid`, score layers a correction bias."""

    tid2eid: torch.Tensor  # [vocab, k] int64 expert ids of each token (hash layers)
    e_score_correction_bias: torch.Tensor  # [E] float32 (score layers)

    def __init__(self, cfg: ModelConfig, is_hash: bool) -> None:
        super().__init__()
        self.is_hash = is_hash
        self.top_k = cfg.num_experts_per_tok
        self.scoring = cfg.scoring_func
        self.scaling = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor, replay: torch.Tensor | None = None,
        weights_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D], input_ids: [T] -> (weights [T, k], expert ids [T, k] int64). The weights' values
        are in the logits' dtype; the fused path holds them in `weights_dtype` when given (float32:
        what the MXFP4 experts read), the chain in the logits' dtype.

        `replay` [T, k] int64 (routing replay, R3): use these experts instead of choosing (rows of
        -1 choose freely); their weights are still this router's scores at them, so a replayed
        forward has the current parameters' weights with the rollout's discrete choices."""
        logits = gemv(x, self.weight) if takes_gemv(x, self.weight) else F.linear(x, self.weight)
        if logits.is_cuda and self.scoring in ROUTER_SCORINGS and logits.dtype in ROUTER_DTYPES and not (
            torch.is_grad_enabled() and logits.requires_grad
        ):
            # One launch for what follows the projection: at decode sizes the chain's nine launches a
            # layer cost more than their work. CUDA only, as the fused SwiGLU below (the interpreter's
            # launch state is one per process). The kernel has no backward (the MTP distillation).
            hashed = dict(token_ids=input_ids, tid2eid=self.tid2eid) if self.is_hash else {}
            bias = None if self.is_hash else self.e_score_correction_bias
            return fused_route(logits, self.top_k, self.scaling, self.scoring, bias=bias, replay=replay,
                               weights_dtype=weights_dtype, **hashed)
        scores = score_fn(self.scoring, logits)
        if self.is_hash:
            indices = self.tid2eid[input_ids].long()
        else:
            biased = scores + self.e_score_correction_bias
            indices = torch.topk(biased, self.top_k, dim=-1, sorted=False).indices
        if replay is not None:
            indices = torch.where(replay >= 0, replay.long(), indices)
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, indices


class Experts(nn.Module):
    """Routed experts, fused as `gate_up_proj [E, 2I, D]` (gate rows, then up rows) and
    `down_proj [E, D, I]`."""

    numerics: Numerics = EXACT  # set model-wide by DeepseekV4.set_numerics
    # The dtype the router hands the weights over in (None: its logits'); `PackedExperts`: float32.
    routing_weights_dtype: torch.dtype | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, i, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.limit = cfg.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.zeros(e, d, i))

    def forward(
        self, x_act: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, fixed_shape: bool = False,
        addend: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x_act: [T, D] the input through `numerics.act`; weights, indices: [T, k] -> [T, D].
        fixed_shape: the step may not wait for the host, which the grouped path does (it sizes its
        loop from the routing), so every expert runs densely. addend: [T, D] (the shared expert's
        output) added to the routed sum after its rounding, `forward(...) + addend`."""
        num_experts = self.gate_up_proj.shape[0]
        # Release numerics quantise each routed pair's down-projection input, which the grouped path
        # does for any batch, the dense one only as the fixed-shape step needs it.
        small = x_act.shape[0] <= DENSE_MAX_TOKENS and num_experts <= DENSE_MAX_EXPERTS
        if fixed_shape or (small and not self.numerics.act_fp8):
            routed = self.dense(x_act, weights, indices)
        else:
            routed = self._grouped(x_act, weights, indices)
        return routed if addend is None else routed + addend

    def dense(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, then keep the routed pairs: a few batched matmuls
        instead of a loop over experts, cheaper when the batch is a handful of tokens, and sized by
        the batch alone. x: the input through `numerics.act`; in release numerics each routed pair's
        weighted down-projection input is quantised as `_grouped` does (the other pairs' rows are
        zeros, which the round trip keeps)."""
        tokens = torch.arange(x.shape[0], device=x.device)[:, None]
        gate, up = torch.einsum("td,eid->eti", x, self.gate_up_proj).chunk(2, dim=-1)
        hidden = swiglu(gate, up, self.limit)  # [E, T, I]
        if self.numerics.act_fp8:
            dense_w = torch.zeros(hidden.shape[:2], dtype=weights.dtype, device=x.device)
            dense_w[indices, tokens] = weights  # [E, T]: a token's k experts are distinct
            down_in = self.numerics.act((hidden * dense_w[..., None]).to(x.dtype))
            y = torch.einsum("eti,edi->etd", down_in, self.down_proj)
            return y[indices, tokens].sum(dim=1).to(x.dtype)
        y = torch.einsum("eti,edi->etd", hidden, self.down_proj)  # [E, T, D]
        picked = y[indices, tokens]  # [T, k, D]
        return (picked * weights[..., None]).sum(dim=1).to(x.dtype)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Tokens grouped by expert; loops over the experts actually hit."""
        out = torch.zeros_like(x)
        flat_experts = indices.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.gate_up_proj.shape[0]).tolist()
        token_of = order // indices.shape[1]
        weight_of = weights.reshape(-1)[order]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = token_of[start : start + count]
            gate, up = F.linear(x[rows], self.gate_up_proj[expert]).chunk(2, dim=-1)
            hidden, weight = swiglu(gate, up, self.limit), weight_of[start : start + count, None]
            if self.numerics.act_fp8:
                # The release kernels weight the down projection's input, then quantise it.
                y = F.linear(self.numerics.act(hidden * weight), self.down_proj[expert])
            else:
                y = F.linear(hidden, self.down_proj[expert]) * weight
            out.index_add_(0, rows, y.to(out.dtype))
            start += count
        return out


class SharedExpert(nn.Module):
    numerics: Numerics = EXACT  # set model-wide by DeepseekV4.set_numerics

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.limit = cfg.swiglu_limit
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    def forward(self, x_act: torch.Tensor) -> torch.Tensor:
        """x_act: [..., D] the input through `numerics.act` -> [..., D]."""
        gate, up = project_pair(self.gate_proj, self.up_proj, x_act)  # [..., I] each
        # The fused kernel has no backward: under autograd (MTP distillation) the chain below.
        if x_act.is_cuda and gate.dtype in FUSED_SWIGLU_DTYPES and not gate.requires_grad:
            # One launch for the clamps, silu, the product and the round trip (bitwise the chain
            # below): the decode graph would otherwise pay five launches a layer for them. CUDA only:
            # on the CPU the chain is as fast, and the interpreter's launch state is one per process,
            # which the context-parallel ranks (threads of one process) would share.
            rows = (-1, gate.shape[-1])
            hidden = fused_swiglu(gate.reshape(rows).contiguous(), up.reshape(rows).contiguous(), self.limit,
                                  self.numerics.act_fp8).view(gate.shape)
        else:
            hidden = self.numerics.act(swiglu(gate, up, self.limit))
        return self.down_proj(hidden)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.gate = Router(cfg, is_hash=cfg.mlp_layer_types[layer] == HASH_MOE)
        self.experts = Experts(cfg)
        self.shared_experts = SharedExpert(cfg)

    def forward(
        self, x: torch.Tensor, x_act: torch.Tensor, input_ids: torch.Tensor, fixed_shape: bool = False,
        replay: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] the normed input (the router reads it), x_act: its `numerics.act` (the experts
        read it, routed and shared one rounded input) -> (output [T, D], routed expert ids [T, k]);
        fixed_shape as `Experts.forward`, `replay` as `Router.forward`."""
        weights, indices = self.gate(x, input_ids, replay, self.experts.routing_weights_dtype)
        shared = self.shared_experts(x_act)
        return self.experts(x_act, weights, indices, fixed_shape, addend=shared), indices
