"""Rotary embedding of the trailing channels, in plain PyTorch: the definition the kernel reproduces.

For x [T, M, D] and cos, sin [T, R/2] (R = rope width, R <= D), the trailing R channels are
rotated pairwise, (x_{2i}, x_{2i+1}) of the rope slice ->
    (x_{2i} cos_i - x_{2i+1} sin_i,  x_{2i+1} cos_i + x_{2i} sin_i)
in float32, cast back to x's dtype once; the first D - R channels pass through unchanged.
`inverse=True` rotates by -angle (de-rotation of an attention output). This is the model's
`apply_rope`, restated here so the kernels stay free of model imports.

With `norm_eps` set, each row of D channels is first RMS-normalised in float32,
x / sqrt(mean(x^2) + eps), times `norm_weight` when given, and cast to x's dtype (the model's
q norm and kv norm, which precede the rotation).
"""

from __future__ import annotations

import torch


def rope_reference(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    inverse: bool = False,
    norm_eps: float | None = None,
    norm_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [T, M, D] float; cos, sin: [T, R/2] float32; norm_weight: [D] float32 or None
    -> [T, M, D] x.dtype."""
    if norm_eps is not None:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + norm_eps)
        if norm_weight is not None:
            x32 = x32 * norm_weight.float()
        x = x32.to(x.dtype)
    half = cos.shape[-1]
    rope_dim = 2 * half
    if inverse:
        sin = -sin
    cos, sin = cos[:, None, :], sin[:, None, :]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


def cos_sin_reference(
    positions: torch.Tensor, inv_freq: torch.Tensor, factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] integer; inv_freq [R/2] float32 -> cos, sin [..., R/2] float32 of each
    position's angles `position * inv_freq`, times `factor` (YaRN's attention factor)."""
    angles = positions.to(torch.float32)[..., None] * inv_freq
    return angles.cos() * factor, angles.sin() * factor
