"""The compressor's window-closing step in plain PyTorch: the definition the fused kernel reproduces.

For every event e (a window w of rate m that closes this step) with channels d and rope_dim r:

    slots   = [previous window's Ca half (m slots) | this window's Cb half (m slots)]   overlap (c = 2)
            = [this window (m slots)]                                                 no overlap (c = 1)
    weights = softmax over the slots, per channel, of gate + position_bias
    entry   = RMSNorm_weight( sum_slots weights * kv )
    entry[-r:] = interleaved RoPE at the window's first position (pairs 2i, 2i+1)
    out[out_rows[e]] = entry

Window −1 (the first window of a sequence, `has_prev = False`) contributes kv = 0, gate = −inf.
This is `WindowCompressor.compress` of the model, except that everything runs in float32 and is
rounded once when stored: the model rounds the weighted sum and the normed entry to the activation
dtype on the way (identical in float32, within one bf16 rounding step otherwise).
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the trailing `2 * cos.shape[-1]` channels of `x [E, d]` pairwise (2i, 2i+1), float32.

    cos, sin: [E, rope_dim // 2] float32. Same as the model's `apply_rope` for a 2-D input.
    """
    rope_dim = 2 * cos.shape[-1]
    nope, rot = x[..., :-rope_dim], x[..., -rope_dim:].float()
    even, odd = rot[..., 0::2], rot[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


def compress_reference(
    state_kv: Tensor,
    state_gate: Tensor,
    src_rows: Tensor,
    prev_rows: Tensor | None,
    has_prev: Tensor | None,
    position_bias: Tensor,
    norm_weight: Tensor,
    eps: float,
    cos: Tensor,
    sin: Tensor,
    out: Tensor,
    out_rows: Tensor,
) -> Tensor:
    """Close E windows and write their entries into `out` (in place; also returned).

    state_kv, state_gate: [R, c*d] float32 compression-state pools (c = 2 with overlap, else 1).
    src_rows: [E, m] int state rows of each closing window's tokens, in position order.
    prev_rows: [E, m] int state rows of the previous window (overlap only, else None).
    has_prev: [E] bool, False for window 0 (overlap only, else None).
    position_bias: [m, c*d] float32 (`ape`).  norm_weight: [d] float32.
    cos, sin: [E, rope_dim // 2] float32 at each window's first position.
    out: [Rc, d] compressed pool (any float dtype); out_rows: [E] int pool row of each entry.
    Runs without host synchronisation, so it can be captured in a CUDA graph.
    """
    d = out.shape[1]
    overlap = state_kv.shape[1] // d
    ape = position_bias.float()
    kv = state_kv[src_rows]  # [E, m, c*d]
    gate = state_gate[src_rows] + ape
    if overlap == 2:
        assert prev_rows is not None and has_prev is not None, "overlap needs prev_rows and has_prev"
        ok = has_prev[:, None, None]
        prev_kv = torch.where(ok, state_kv[prev_rows][..., :d], 0.0)
        prev_gate = torch.where(ok, state_gate[prev_rows][..., :d] + ape[:, :d], float("-inf"))
        kv = torch.cat([prev_kv, kv[..., d:]], dim=1)  # [E, 2m, d]
        gate = torch.cat([prev_gate, gate[..., d:]], dim=1)
    weights = torch.softmax(gate, dim=1)
    entry = (kv * weights).sum(dim=1)  # [E, d] float32
    entry = entry * torch.rsqrt(entry.square().mean(-1, keepdim=True) + eps) * norm_weight.float()
    out[out_rows] = rope_interleaved(entry, cos, sin).to(out.dtype)
    return out


def write_state_reference(
    kv: torch.Tensor, gate: torch.Tensor, rows: torch.Tensor, state_kv: torch.Tensor, state_gate: torch.Tensor
) -> None:
    """A step's compressor projections into the compression-state rows of their tokens: kv, gate
    [T, W] (any float dtype), rows [T] -> state_kv[rows], state_gate[rows] ([R, W] float32), exact."""
    state_kv[rows] = kv.float()
    state_gate[rows] = gate.float()
