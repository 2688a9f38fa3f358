"""Hybrid sparse attention of one layer, in plain PyTorch: the definition the kernel reproduces.

Each query row n (a decode request, or one prefill token) attends, with all H heads of
its query, to two gathered key sets of the layer's single latent KV head (K = V):

  * window keys   kv_pool[window_rows[n, j]]   (SWA rows, -1 = no key), and
  * extra keys    extra_pool[extra_rows[n, j]] (compressed rows: the indexer's top-k C4
                  entries, or every causal C128 entry; -1 = no key),

through ONE softmax whose columns are both key sets plus a per-head sink logit:

    p = softmax([q.k * scale for window keys, q.k * scale for extra keys, sink_h])
    out[n, h] = sum_j p_j * key_j          (the sink column is dropped after)

The sink is raw (not multiplied by `scale`). This is `Attention._attend` of the model
with the key blocks gathered from the pools instead of passed in.
"""

from __future__ import annotations

import torch


def hybrid_attention_reference(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    window_rows: torch.Tensor,
    extra_pool: torch.Tensor | None,
    extra_rows: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float | None = None,
    *,
    upcast: bool = True,
) -> torch.Tensor:
    """q: [N, H, d]; kv_pool: [R, d]; window_rows: [N, W] int (-1 = no key);
    extra_pool: [Rc, d] or None; extra_rows: [N, K] int (-1 = no key) or None;
    sinks: [H] fp32 -> out: [N, H, d] in q's dtype, on q's device.

    `upcast=True` computes in float32 (the definition tests compare against);
    `upcast=False` computes in q's dtype like the model's eager path (the chain a
    fused kernel is timed against). A row with no valid key at all attends only to
    the sink and returns zeros.
    """
    compute = torch.float32 if upcast else q.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_c = q.to(compute)
    blocks = [(kv_pool, window_rows)]
    if extra_rows is not None and extra_rows.shape[1] > 0:
        assert extra_pool is not None
        blocks.append((extra_pool, extra_rows))

    logits, values = [], []
    for pool, rows in blocks:
        valid = rows >= 0  # [N, K_i]
        keys = pool[rows.clamp(min=0).long()].to(compute)  # [N, K_i, d]: gathered rows, K = V
        logit = torch.einsum("nhd,nkd->nhk", q_c, keys) * scale
        logits.append(logit.masked_fill(~valid[:, None, :], float("-inf")))
        values.append(keys)
    sink = sinks.to(compute)[None, :, None].expand(q.shape[0], -1, 1)  # [N, H, 1]
    probs = torch.softmax(torch.cat([*logits, sink], dim=-1), dim=-1)  # [N, H, sum K_i + 1]

    out = torch.zeros_like(q_c)
    start = 0
    for keys in values:
        width = keys.shape[1]
        out = out + torch.einsum("nhk,nkd->nhd", probs[..., start : start + width], keys)
        start += width
    return out.to(q.dtype)
