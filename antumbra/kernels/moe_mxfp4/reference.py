"""Routed MoE experts with MXFP4 weights in plain PyTorch: the definition the grouped kernel reproduces.

Weights are the release layout stacked over experts:
    w1, w3: [E, I, D/2] packed e2m1 (int8 / uint8), scales [E, I, D/32] UE8M0 (float8_e8m0fnu or uint8)
    w2:     [E, D, I/2] packed e2m1,                 scales [E, D, I/32]
Two e2m1 codes per byte, the low nibble is element 2j; one power-of-two scale 2^(s-127) per 32 inputs.

For each token t and each of its k routed experts e with routing weight r:
    h = silu(min(x_t @ w1_e^T, L)) * clamp(x_t @ w3_e^T, -L, L)
    out_t += r * (h @ w2_e^T)
which is the model's `Experts.forward` (SwiGLU with `swiglu_limit` L) on dequantised weights.
The model's layering keeps kernels free of model imports, so the MXFP4 decode is restated here;
the tests check it against `replicas.model.quant.unpack_mxfp4`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

MXFP4_BLOCK = 32
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequant_mxfp4(packed: Tensor, scale: Tensor) -> Tensor:
    """packed: [..., out, in/2] int8 / uint8; scale: [..., out, in/32] float8_e8m0fnu / uint8.

    -> float32 [..., out, in].
    """
    codes = packed.contiguous().view(torch.uint8)
    table = torch.tensor(_E2M1, dtype=torch.float32, device=packed.device)
    values = torch.stack([table[(codes & 0xF).long()], table[(codes >> 4).long()]], dim=-1).flatten(-2)
    exponents = scale.contiguous().view(torch.uint8).to(torch.int32) - 127
    factors = torch.ldexp(torch.ones_like(exponents, dtype=torch.float32), exponents)
    *lead, out, cols = values.shape
    grouped = values.view(*lead, out, cols // MXFP4_BLOCK, MXFP4_BLOCK) * factors.unsqueeze(-1)
    return grouped.view(*lead, out, cols)


def swiglu(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def moe_mxfp4_reference(
    x: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w1: Tensor,
    w1_scale: Tensor,
    w3: Tensor,
    w3_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    swiglu_limit: float,
    down_input: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """x: [T, D]; topk_weights: [T, k] float; topk_ids: [T, k] int -> [T, D] x.dtype.

    Dequantises only the experts that are hit (to x.dtype: MXFP4 values are exact in bf16 and fp16
    for normal scales) and runs the model's expert loop in x.dtype, weighting after w2 as the model
    does. Call it with float32 x for a float32 reference.
    down_input: release numerics: weight each pair's SwiGLU output before w2 and pass it through this
    (the FP8 round trip) first, as the release kernels do.
    """
    out = torch.zeros_like(x)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // topk_ids.shape[1]
    weight_of = topk_weights.reshape(-1)[order]
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    start = 0
    for expert, count in zip(experts.tolist(), counts.tolist(), strict=True):
        rows = token_of[start : start + count]
        gate = F.linear(x[rows], dequant_mxfp4(w1[expert], w1_scale[expert]).to(x.dtype))
        up = F.linear(x[rows], dequant_mxfp4(w3[expert], w3_scale[expert]).to(x.dtype))
        hidden, weight = swiglu(gate, up, swiglu_limit), weight_of[start : start + count, None]
        w2_dense = dequant_mxfp4(w2[expert], w2_scale[expert]).to(x.dtype)
        if down_input is not None:
            y = F.linear(down_input((hidden * weight).to(x.dtype)), w2_dense)
        else:
            y = F.linear(hidden, w2_dense) * weight
        out.index_add_(0, rows, y.to(out.dtype))
        start += count
    return out


def sum_slots_reference(y: Tensor, top_k: int, addend: Tensor) -> Tensor:
    """y: [T * k, D] each (token, slot) pair's output, a token's k rows adjacent; addend: [T, D]
    -> [T, D] y.dtype: the k outputs summed in float32 in slot order and rounded, then the addend
    added (in float32, rounded again), as `y.view(T, k, D).sum(1) + addend` computes them."""
    rows = y.view(-1, top_k, y.shape[-1]).float()
    total = rows[:, 0].clone()
    for slot in range(1, top_k):
        total += rows[:, slot]
    return (total.to(y.dtype).float() + addend.float()).to(y.dtype)
