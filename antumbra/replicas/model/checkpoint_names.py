"""Official (release) checkpoint names and the transformers in-memory names they load as.

Release checkpoints name tensors as DeepSeek's own code does (`layers.0.attn.wq_a.weight`, one
matrix per routed expert); the model is keyed like `transformers.DeepseekV4ForCausalLM`, whose
routed experts are merged (`mlp.experts.gate_up_proj [E, 2I, D]`, `down_proj [E, D, I]`).
`release_format` writes with the same tables, so both directions agree by construction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GLOBAL_RENAMES: dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}


def _layer_renames() -> dict[str, str]:
    """Per-layer renames, keyed by the name after `layers.L.` (official) → after `model.layers.L.`."""
    renames = {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn.attn_sink": "self_attn.sinks",
        "attn.wq_a.weight": "self_attn.q_a_proj.weight",
        "attn.q_norm.weight": "self_attn.q_a_norm.weight",
        "attn.wq_b.weight": "self_attn.q_b_proj.weight",
        "attn.wkv.weight": "self_attn.kv_proj.weight",
        "attn.norm.weight": "self_attn.kv_norm.weight",
        "attn.wo_a.weight": "self_attn.o_a_proj.weight",
        "attn.wo_b.weight": "self_attn.o_b_proj.weight",
        "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
        "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
        "ffn.gate.weight": "mlp.gate.weight",
        "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
        "ffn.gate.tid2eid": "mlp.gate.tid2eid",
        "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
        "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
        "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    }
    for branch in ("attn", "ffn"):
        for part in ("fn", "base", "scale"):
            renames[f"hc_{branch}_{part}"] = f"{branch}_hc.{part}"
    for official, hf in (("attn.compressor", "self_attn.compressor"),
                         ("attn.indexer.compressor", "self_attn.compressor.indexer")):
        renames[f"{official}.wkv.weight"] = f"{hf}.kv_proj.weight"
        renames[f"{official}.wgate.weight"] = f"{hf}.gate_proj.weight"
        renames[f"{official}.norm.weight"] = f"{hf}.kv_norm.weight"
        renames[f"{official}.ape"] = f"{hf}.position_bias"
    return renames


LAYER_RENAMES: dict[str, str] = _layer_renames()

# Routed-expert pieces: w1 (gate) and w3 (up) stack into gate_up_proj, w2 (down) is down_proj.
EXPERT_TARGETS = {"w1": "gate_up_proj", "w2": "down_proj", "w3": "gate_up_proj"}
_EXPERT_RE = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.w([123])\.weight$")
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_MTP_RE = re.compile(r"^(model\.)?mtp\.")


def is_mtp_name(name: str) -> bool:
    return _MTP_RE.match(name) is not None


def official_to_hf(name: str) -> str | None:
    """Official release name (no prefix, not an expert piece) → in-memory name, or None if unknown."""
    if name in GLOBAL_RENAMES:
        return GLOBAL_RENAMES[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in LAYER_RENAMES:
        return f"model.layers.{m.group(1)}.{LAYER_RENAMES[m.group(2)]}"
    return None


@dataclass(frozen=True)
class ExpertSlot:
    """Where one per-expert matrix goes inside a merged expert tensor."""

    layer: int
    expert: int
    proj: str  # "w1" | "w2" | "w3"

    @property
    def target(self) -> str:
        return f"model.layers.{self.layer}.mlp.experts.{EXPERT_TARGETS[self.proj]}"

    def rows(self, merged_shape: tuple[int, ...]) -> slice:
        """Row range of this piece in the merged `[E, rows, cols]` tensor."""
        if self.proj == "w2":
            return slice(0, merged_shape[1])
        half = merged_shape[1] // 2
        return slice(0, half) if self.proj == "w1" else slice(half, 2 * half)

    def piece_shape(self, merged_shape: tuple[int, ...]) -> tuple[int, int]:
        r = self.rows(merged_shape)
        return (r.stop - r.start, merged_shape[2])


def classify(name: str) -> str | ExpertSlot:
    """Checkpoint weight name (not a scale, not mtp) → in-memory name or expert slot."""
    bare = name.removeprefix("model.")
    m = _EXPERT_RE.match(bare)
    if m:
        return ExpertSlot(int(m.group(1)), int(m.group(2)), f"w{m.group(3)}")
    hf = official_to_hf(bare)
    if hf is not None:
        return hf
    return bare if bare.startswith("lm_head.") else f"model.{bare}"
