"""Small random DeepSeek-V4 checkpoints in the layout `save_pretrained` writes.

The oracle for the engine is `transformers.DeepseekV4ForCausalLM` in fp32, so the
tiny checkpoints are made by that class itself. Every persistent tensor is
re-drawn: transformers initialises sinks, compressor position biases, mHC bases,
correction biases and `tid2eid` to zeros (or ones), which would hide any code
path that ignores them. Linear weights get std 1/sqrt(fan_in) so activations
stay O(1) through the layers, and `lm_head` is scaled by `logit_spread` so that
greedy choices are not near-ties.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from antumbra.config import CSA, HASH_MOE, HCA, LAYER_TYPES, SCORE_MOE, SLIDING
from antumbra.replicas.chat.v4_tokens import BOS_TOKEN_ID, EOS_TOKEN_ID, V4_VOCAB_SIZE
from antumbra.replicas.model.tokenizer import save_tokenizer

PAD_TOKEN_ID = EOS_TOKEN_ID  # V4 pads with eos
# Padded lm_head rows (ids the tokenizer never produces) keep their direction but lose their magnitude.
_PADDED_ROW_SCALE = 1e-3


def _default_compress_rates() -> dict[str, int]:
    return {CSA: 4, HCA: 128}


@dataclass(frozen=True)
class TinyModelSpec:
    """Sizes of a tiny checkpoint; the defaults exercise every layer and MoE kind at the real rates."""

    vocab_size: int = V4_VOCAB_SIZE  # the real V4 vocabulary, so checkpoints carry its tokenizer.json
    hidden_size: int = 64
    layer_types: tuple[str, ...] = (SLIDING, CSA, HCA, CSA)
    # None: the first layer hash-routed, the rest score-routed.
    mlp_layer_types: tuple[str, ...] | None = None
    num_heads: int = 4
    head_dim: int = 32
    rope_dim: int = 8
    q_lora_rank: int = 32
    o_groups: int = 2
    o_lora_rank: int = 16
    sliding_window: int = 128
    compress_rates: dict[str, int] = field(default_factory=_default_compress_rates, hash=False)
    index_n_heads: int = 16  # fewer heads leave many indexer scores tied at 0, and top-k ties flip
    index_head_dim: int = 16
    index_topk: int = 8
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    hc_mult: int = 4
    # V4 runs 20 Sinkhorn iterations. Every count runs the same loop, and each iteration costs the
    # interpreted mHC kernel a pass per token and layer, so tiny models run 4.
    hc_sinkhorn_iters: int = 4
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn_compress_rope: bool = True
    yarn_factor: float = 16.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_original_max_position: int = 65536
    max_position_embeddings: int = 65536
    seed: int = 0
    logit_spread: float = 4.0
    # Ids >= this get near-zero lm_head rows, as padded rows of real checkpoints do, so the
    # model rarely emits them. None: every id is used (V4's tokenizer fills its 129,280 ids).
    used_vocab_size: int | None = None
    bos_token_id: int = BOS_TOKEN_ID
    eos_token_id: int = EOS_TOKEN_ID
    # MTP draft blocks (`num_nextn_predict_layers`), written in the release's names and formats; their
    # weights come from a generator of their own, so the target's are the same with or without them.
    num_mtp_layers: int = 1

    def __post_init__(self) -> None:
        if self.mlp_layer_types is None:
            default = (HASH_MOE,) + (SCORE_MOE,) * (len(self.layer_types) - 1)
            object.__setattr__(self, "mlp_layer_types", default[: len(self.layer_types)])
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types or ()))
        unknown = [t for t in self.layer_types if t not in LAYER_TYPES]
        if unknown:
            raise ValueError(f"unknown layer types {unknown}; expected one of {LAYER_TYPES}")
        if len(self.mlp_layer_types or ()) != len(self.layer_types):
            raise ValueError("mlp_layer_types must have one entry per layer")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise ValueError(f"rope_dim must be even and in (0, head_dim], got {self.rope_dim}")
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise ValueError("num_heads * head_dim must divide evenly into o_groups")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError("num_experts_per_tok cannot exceed n_routed_experts")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def padded_vocab_start(self) -> int:
        used = self.vocab_size if self.used_vocab_size is None else self.used_vocab_size
        return min(used, self.vocab_size)

    def with_layers(self, layer_types: tuple[str, ...]) -> TinyModelSpec:
        """The same spec with another layer schedule (and the default MoE schedule for it)."""
        return replace(self, layer_types=tuple(layer_types), mlp_layer_types=None)


def build_config(spec: TinyModelSpec) -> Any:
    """The `transformers.DeepseekV4Config` of `spec`."""
    from transformers import DeepseekV4Config

    rope_scaling: dict[str, Any] = {}
    if spec.yarn_compress_rope:
        # DeepseekV4Config applies this to the "compress" rope only, the way the release ships it.
        rope_scaling = {
            "rope_type": "yarn",
            "factor": spec.yarn_factor,
            "beta_fast": spec.yarn_beta_fast,
            "beta_slow": spec.yarn_beta_slow,
            "original_max_position_embeddings": spec.yarn_original_max_position,
        }
    return DeepseekV4Config(  # type: ignore[call-arg]
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        layer_types=list(spec.layer_types),
        mlp_layer_types=list(spec.mlp_layer_types or ()),
        compress_rates=dict(spec.compress_rates),
        num_attention_heads=spec.num_heads,
        num_key_value_heads=1,
        head_dim=spec.head_dim,
        partial_rotary_factor=spec.rope_dim / spec.head_dim,
        q_lora_rank=spec.q_lora_rank,
        o_groups=spec.o_groups,
        o_lora_rank=spec.o_lora_rank,
        sliding_window=spec.sliding_window,
        index_n_heads=spec.index_n_heads,
        index_head_dim=spec.index_head_dim,
        index_topk=spec.index_topk,
        n_routed_experts=spec.n_routed_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size,
        hc_mult=spec.hc_mult,
        hc_sinkhorn_iters=spec.hc_sinkhorn_iters,
        rope_theta=spec.rope_theta,
        compress_rope_theta=spec.compress_rope_theta,
        rope_scaling=rope_scaling or None,
        max_position_embeddings=spec.max_position_embeddings,
        # transformers never builds the MTP block: save_pretrained writes no MTP weights, and
        # `make_tiny_checkpoint` adds them (`mtp_tensors`).
        num_nextn_predict_layers=spec.num_mtp_layers,
        bos_token_id=spec.bos_token_id,
        eos_token_id=spec.eos_token_id,
        tie_word_embeddings=False,
    )


# ---------------------------------------------------------------- random weights

Init = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


def _normal(t: torch.Tensor, gen: torch.Generator, std: float, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(t.shape, generator=gen, dtype=torch.float32) * std + mean


def _fan_in(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    # Last dim is the input of every linear here: [out, in] and the fused experts' [E, out, in].
    return _normal(t, gen, 1.0 / math.sqrt(t.shape[-1]))


def _norm_weight(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return _normal(t, gen, 0.1, mean=1.0)


def _positive_scale(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return 0.5 + torch.rand(t.shape, generator=gen, dtype=torch.float32)


def _distinct_expert_ids(t: torch.Tensor, gen: torch.Generator, num_experts: int) -> torch.Tensor:
    """One row per token id: `top_k` different experts, drawn independently per token."""
    vocab, top_k = t.shape
    order = torch.rand((vocab, num_experts), generator=gen).argsort(dim=1)
    return order[:, :top_k].to(t.dtype)


def _initializer(name: str, spec: TinyModelSpec) -> Init:
    """How the tensor named `name` (HF state-dict name) is drawn; unknown names are an error."""
    leaf = name.rsplit(".", 1)[-1]
    if name == "model.embed_tokens.weight":
        return lambda t, g: _normal(t, g, 1.0)
    if name == "lm_head.weight":
        return lambda t, g: _lm_head(t, g, spec)
    if name.endswith("norm.weight"):
        return _norm_weight
    if leaf == "sinks":
        return lambda t, g: _normal(t, g, 1.0)
    if leaf == "position_bias":
        return lambda t, g: _normal(t, g, 0.5)
    if leaf in ("base", "hc_base"):
        return lambda t, g: _normal(t, g, 0.5)
    if leaf in ("scale", "hc_scale"):
        return _positive_scale
    if leaf in ("fn", "hc_fn"):
        return _fan_in
    if leaf == "e_score_correction_bias":
        # Comparable to the spread of sqrt-softplus scores, so it changes some top-k picks.
        return lambda t, g: _normal(t, g, 0.1)
    if leaf == "tid2eid":
        return lambda t, g: _distinct_expert_ids(t, g, spec.n_routed_experts)
    if leaf in ("weight", "gate_up_proj", "down_proj"):
        return _fan_in
    raise KeyError(f"no initializer for tensor {name!r}")


def _lm_head(t: torch.Tensor, gen: torch.Generator, spec: TinyModelSpec) -> torch.Tensor:
    w = _normal(t, gen, spec.logit_spread / math.sqrt(t.shape[-1]))
    w[spec.padded_vocab_start :] *= _PADDED_ROW_SCALE
    return w


@torch.no_grad()
def randomize_weights(model: torch.nn.Module, spec: TinyModelSpec) -> None:
    """Redraw every persistent parameter and buffer of `model` from `spec.seed`.

    Rotary inverse frequencies are non-persistent and derived from the config, so
    they are left alone (they are not in the state dict either).
    """
    gen = torch.Generator().manual_seed(spec.seed)
    # state_dict order is the module construction order: deterministic for a config.
    for name, tensor in model.state_dict(keep_vars=True).items():
        drawn = _initializer(name, spec)(tensor, gen)
        tensor.copy_(drawn.to(tensor.dtype))


def build_model(spec: TinyModelSpec) -> Any:
    """A random fp32 `DeepseekV4ForCausalLM` for `spec`, in eval mode."""
    from transformers import DeepseekV4ForCausalLM

    config = build_config(spec)
    # transformers' own init draws from the global RNG; keep the caller's stream untouched.
    with torch.random.fork_rng(devices=[]):
        model = DeepseekV4ForCausalLM(config).float()
    randomize_weights(model, spec)
    model.generation_config.bos_token_id = spec.bos_token_id
    model.generation_config.eos_token_id = spec.eos_token_id
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model.eval()


# The MTP blocks' generator is seeded apart from the target's, so adding them changes no target weight.
_MTP_SEED_OFFSET = 0x4D5450


@torch.no_grad()
def mtp_tensors(spec: TinyModelSpec) -> dict[str, torch.Tensor]:
    """Random MTP blocks of `spec` as the release stores them (`mtp.{i}.*`, FP8 linears, MXFP4
    experts), drawn after and apart from the target's weights."""
    from antumbra.config import ModelConfig
    from antumbra.replicas.model.mtp import MTPBlock
    from antumbra.replicas.model.mtp_names import release_tensors

    if spec.num_mtp_layers and (spec.hidden_size % 32 or spec.moe_intermediate_size % 32):
        raise ValueError(
            f"an MTP block is stored in the release's formats, whose MXFP4 experts need hidden_size "
            f"({spec.hidden_size}) and moe_intermediate_size ({spec.moe_intermediate_size}) in multiples "
            f"of 32: give this spec num_mtp_layers=0"
        )
    cfg = ModelConfig.from_hf(build_config(spec))
    gen = torch.Generator().manual_seed(spec.seed + _MTP_SEED_OFFSET)
    out: dict[str, torch.Tensor] = {}
    for index in range(spec.num_mtp_layers):
        block = MTPBlock(cfg)
        state = block.state_dict()
        for name, tensor in state.items():
            tensor.copy_(_initializer(name, spec)(tensor, gen).to(tensor.dtype))
        out.update(release_tensors(index, state))
    return out


MTP_FILE = "mtp.safetensors"


def make_tiny_checkpoint(
    out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec(), *, with_tokenizer: bool = True
) -> Path:
    """Write a random tiny checkpoint (config, generation config, safetensors, tokenizer) to `out_dir`."""
    from transformers.utils import logging as hf_logging

    if with_tokenizer and spec.vocab_size < V4_VOCAB_SIZE:
        raise ValueError(f"vocab_size {spec.vocab_size} is smaller than the V4 tokenizer's {V4_VOCAB_SIZE}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(spec)
    bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if bar_was_enabled:
            hf_logging.enable_progress_bar()
    if spec.num_mtp_layers:
        from safetensors.torch import save_file

        save_file(mtp_tensors(spec), str(out / MTP_FILE), metadata={"format": "pt"})
    if with_tokenizer:
        save_tokenizer(out, model_max_length=spec.max_position_embeddings)
    return out
