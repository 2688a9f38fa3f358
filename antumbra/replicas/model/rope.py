"""Interleaved partial RoPE: the trailing `rope_dim` channels of a head, pairs (2i, 2i+1).

Two tables exist per model: `main` (sliding-only layers) and `compress` (CSA / HCA
layers, their compressors and the indexer), the latter optionally YaRN-scaled.
"""

from __future__ import annotations

import math

import torch

from antumbra.config import RopeConfig
from antumbra.kernels.rope import cos_sin as fused_cos_sin


def inverse_frequencies(rope: RopeConfig) -> torch.Tensor:
    """`[rope_dim // 2]` float32 angular frequencies, YaRN-blended when configured."""
    dim = rope.rope_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    pos_freqs = rope.theta**exponents
    extrapolated = 1.0 / pos_freqs
    if rope.yarn_factor is None:
        return extrapolated
    interpolated = 1.0 / (rope.yarn_factor * pos_freqs)
    low, high = _yarn_correction_range(rope, dim)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep_extrapolated = 1 - ramp
    return interpolated * (1 - keep_extrapolated) + extrapolated * keep_extrapolated


def _yarn_correction_range(rope: RopeConfig, dim: int) -> tuple[float, float]:
    def correction_dim(num_rotations: float) -> float:
        ratio = rope.yarn_original_max_position / (num_rotations * 2 * math.pi)
        return (dim * math.log(ratio)) / (2 * math.log(rope.theta))

    low = math.floor(correction_dim(rope.yarn_beta_fast))
    high = math.ceil(correction_dim(rope.yarn_beta_slow))
    return max(low, 0), min(high, dim - 1)


class RotaryTable:
    """cos / sin of one rope table at arbitrary positions, on one device."""

    def __init__(self, rope: RopeConfig, device: torch.device | str) -> None:
        self.rope_dim = rope.rope_dim
        self.attention_factor = rope.attention_factor
        self.inv_freq = inverse_frequencies(rope).to(device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [...] int64 -> cos, sin: [..., rope_dim // 2] float32."""
        if positions.is_cuda:  # one launch for the chain's six, bit for bit (a decode step makes four)
            return fused_cos_sin(positions, self.inv_freq, self.attention_factor)
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing `2 * cos.shape[-1]` channels of `x` pairwise.

    x: [T, ..., D]; cos, sin: [T, rope_dim // 2] float32, broadcast over the middle
    dims. The rotation runs in fp32 and casts back once, like the reference model.
    Pass `-sin` to de-rotate.
    """
    rope_dim = 2 * cos.shape[-1]
    extra_dims = x.dim() - cos.dim()
    shape = (cos.shape[0],) + (1,) * extra_dims + (cos.shape[-1],)
    cos = cos.reshape(shape)
    sin = sin.reshape(shape)
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)
