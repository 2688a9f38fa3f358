"""Dense linears kept in the release's FP8 block format on the device.

The release stores q_a / q_b / kv / o_b, the indexer's q_b and the shared experts as
`float8_e4m3fn` weights with one UE8M0 scale per 128 x 128 block. Keeping them so halves
the bytes a decode step reads for them, and the kernel dequantises tiles in registers.
Packing weights that came from such a checkpoint is lossless: each block is a power of two
times e4m3 values, and the smallest power-of-two scale covering the block's max represents
every one of them again exactly. o_a stays in the model dtype: the model reads it as a
grouped einsum over a view of its weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from antumbra.kernels.common.interpreter import interpreting
from antumbra.kernels.fp8_linear import fp8_linear, fp8_linear_pair

from .quant import dequant_fp8_block, quant_fp8_block

# Linears the release stores in FP8, by owning module (HF in-memory names). The indexer's own
# compressor projections share names with attention's but are bf16 in the release.
FP8_LINEARS = {
    "self_attn": ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj"),
    "indexer": ("q_b_proj",),
    "shared_experts": ("gate_proj", "up_proj", "down_proj"),
}


class Fp8Linear(nn.Module):
    """Same call as a bias-free `nn.Linear` (x [..., K] -> [..., N] in x.dtype) on an FP8-block weight.

    Buffers: weight [N, K] float8_e4m3fn; weight_scale [ceil(N/128), ceil(K/128)] float8_e8m0fnu.
    """

    weight: torch.Tensor
    weight_scale: torch.Tensor

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", weight_scale.contiguous())

    @staticmethod
    def from_linear(linear: nn.Linear) -> Fp8Linear:
        weight, scale = quant_fp8_block(linear.weight.detach())
        return Fp8Linear(weight, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda" or interpreting():
            return fp8_linear(x, self.weight, self.weight_scale)
        return F.linear(x.float(), dequant_fp8_block(self.weight, self.weight_scale)).to(x.dtype)


def project_pair(first: nn.Module, second: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first(x), second(x)) for two linears that read the same input: one kernel call where both
    are `Fp8Linear` on a GPU (one launch at a single token), else each its own."""
    if isinstance(first, Fp8Linear) and isinstance(second, Fp8Linear) and x.device.type == "cuda":
        return fp8_linear_pair(x, (first.weight, first.weight_scale), (second.weight, second.weight_scale))
    return first(x), second(x)


def pack_fp8_linears(model: nn.Module) -> int:
    """Replace the release's FP8 linears of attention, indexer and shared experts by `Fp8Linear`.
    -> how many linears were packed."""
    count = 0
    for name, module in list(model.named_modules()):
        for child_name in FP8_LINEARS.get(name.rsplit(".", 1)[-1], ()):
            child = getattr(module, child_name, None)
            if isinstance(child, nn.Linear):
                setattr(module, child_name, Fp8Linear.from_linear(child))
                count += 1
    return count
