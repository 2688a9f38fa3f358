"""The fewest bytes one decode step must read: the weights a step touches, in the formats the
engine holds them, and the keys its rows attend to."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def decode_floor_bytes(engine: Any, batch: int, ctx: int,
                       experts_touched: Sequence[float] | None = None) -> dict[str, Any]:
    """Every weight a token touches once (the embedding's rows; the routed experts, packed, hit
    `experts_touched[layer]` times per layer when given, else at most `min(E, batch * k)` times),
    plus the keys each row attends to and the indexer keys it scores."""
    from antumbra.replicas.model.packed_experts import PackedExperts

    cfg = engine.model_config
    weights = 0
    experts_by_layer = [0.0] * cfg.num_layers
    for name, t in engine.model.state_dict().items():
        size = t.numel() * t.element_size()
        if name == "model.embed_tokens.weight":
            weights += batch * t.shape[1] * t.element_size()
        elif ".experts." in name:
            experts_by_layer[int(name.split(".")[2])] += size
        else:
            weights += size
    packed = all(isinstance(layer.mlp.experts, PackedExperts) for layer in engine.model.model.layers)
    if experts_touched is None:
        experts_touched = [min(cfg.num_experts, batch * cfg.num_experts_per_tok)] * cfg.num_layers
    expert_bytes = sum(size * hit / cfg.num_experts
                       for size, hit in zip(experts_by_layer, experts_touched, strict=True))
    weights += int(expert_bytes)
    elt = 2
    kv = 0
    for kind in cfg.layer_types:
        rows = cfg.sliding_window
        if kind == "compressed_sparse_attention":
            rows += cfg.index_topk
            kv += (ctx // 4) * cfg.index_head_dim * elt  # indexer keys scored
        elif kind == "heavily_compressed_attention":
            rows += ctx // 128
        kv += rows * cfg.head_dim * elt
    return {"weight_bytes": float(weights), "expert_bytes": float(expert_bytes),
            "kv_bytes": float(batch * kv), "experts_packed": packed,
            "total_bytes": float(weights + batch * kv)}
