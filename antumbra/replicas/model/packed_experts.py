"""Routed experts kept in the release's MXFP4 format on the device.

The checkpoint stores each routed expert's w1 / w3 / w2 as e2m1 codes (two a byte, low
nibble first) with one UE8M0 scale per 32 inputs. Keeping them packed takes a quarter
of bf16's bytes, and the MoE kernel dequantises tiles in registers, so a decode step
reads ~4.25 bits per weight. Packing weights that came from an MXFP4 checkpoint is
lossless: every dequantised group is a power of two times e2m1 codes, and the smallest
scale that covers the group's max represents all of them again exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from antumbra.kernels.common.interpreter import interpreting
from antumbra.kernels.moe_mxfp4.grouped import moe_mxfp4_grouped
from antumbra.kernels.moe_mxfp4.reference import moe_mxfp4_reference
from antumbra.kernels.moe_mxfp4.triton import moe_mxfp4

from .moe import Experts
from .numerics import EXACT, Numerics
from .quant import quant_mxfp4, unpack_mxfp4

# Prefill-sized steps (at least this many tokens, on CUDA, exact numerics) decode the experts once and
# run grouped GEMMs (`moe_mxfp4_grouped`) when the decoded scratch stays within GROUPED_SCRATCH_BYTES;
# below it, or for models whose experts would not fit (V4-Flash's 256 experts: 12.9 GB), the fused
# kernel, which reads each weight once per token tile and needs no scratch.
GROUPED_MIN_TOKENS = 1024
GROUPED_SCRATCH_BYTES = 2 << 30
# Experts quantised together when packing a dense layer: float32 temporaries of a few experts.
PACK_EXPERTS_PER_BLOCK = 8


class PackedExperts(nn.Module):
    """Same call as `Experts` (x [T, D], weights / indices [T, k] -> [T, D]) on packed weights.

    Buffers: w1 / w3 [E, I, D/2] int8 with scales [E, I, D/32] e8m0; w2 [E, D, I/2] with [E, D, I/32].
    """

    w1: torch.Tensor
    w1_scale: torch.Tensor
    w3: torch.Tensor
    w3_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    numerics: Numerics = EXACT  # set model-wide by DeepseekV4.set_numerics
    # Every path here reads the routing weights in float32: the fused router hands them over so.
    routing_weights_dtype = torch.float32

    def __init__(self, limit: float, packed: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.limit = limit
        for name, tensor in packed.items():
            self.register_buffer(name, tensor.contiguous())

    @staticmethod
    def from_experts(experts: Experts, experts_per_block: int = PACK_EXPERTS_PER_BLOCK) -> PackedExperts:
        """Quantise a dense `Experts` (exact when its weights came from MXFP4), `experts_per_block`
        experts at a time: quantising works in float32, so a whole layer at once (V4-Flash: 256
        experts) would need several times the layer's bf16 bytes beside it."""
        gate, up = experts.gate_up_proj.detach().chunk(2, dim=1)  # [E, I, D] each
        packed: dict[str, torch.Tensor] = {}
        for name, weight in (("w1", gate), ("w3", up), ("w2", experts.down_proj.detach())):
            codes, scale = _quant_mxfp4_by_experts(weight, experts_per_block)
            packed[name], packed[f"{name}_scale"] = codes, scale
        return PackedExperts(experts.limit, packed)

    def dense_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (gate_up_proj [E, 2I, D], down_proj [E, D, I]) float32, the dequantised weights."""
        gate = unpack_mxfp4(self.w1, self.w1_scale)
        up = unpack_mxfp4(self.w3, self.w3_scale)
        return torch.cat([gate, up], dim=1), unpack_mxfp4(self.w2, self.w2_scale)

    def forward(
        self, x_act: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, fixed_shape: bool = False,
        addend: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x_act: the input through `numerics.act`. Release numerics (as `Experts`) also round each
        pair's weighted down-projection input. Every path here is sized by the batch alone, so a
        fixed-shape step (`fixed_shape`) takes the same one. addend as `Experts.forward`; the
        kernels' path adds it where it sums a token's pairs (one launch for both)."""
        release = self.numerics.act_fp8
        args = (
            x_act.contiguous(), weights, indices, self.w1, self.w1_scale, self.w3,
            self.w3_scale, self.w2, self.w2_scale, self.limit,
        )
        if x_act.device.type == "cuda" and not release and self._grouped_fits(x_act):
            routed = moe_mxfp4_grouped(*args)
        elif x_act.device.type == "cuda" or interpreting():
            return moe_mxfp4(*args, act_fp8=release, addend=addend)
        else:
            routed = moe_mxfp4_reference(*args, down_input=self.numerics.act if release else None)
        return routed if addend is None else routed + addend

    def _grouped_fits(self, x: torch.Tensor) -> bool:
        experts, inter, half = self.w1.shape
        scratch = 3 * experts * inter * 2 * half * x.element_size()
        return x.shape[0] >= GROUPED_MIN_TOKENS and scratch <= GROUPED_SCRATCH_BYTES


def _quant_mxfp4_by_experts(
    weight: torch.Tensor, experts_per_block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quant_mxfp4` of weight [E, out, in] into preallocated outputs, a block of experts at a time
    (the same codes and scales: each group of 32 inputs is quantised on its own)."""
    if experts_per_block < 1:
        raise ValueError(f"experts_per_block must be at least 1, got {experts_per_block}")
    num_experts = weight.shape[0]
    codes = scale = None
    for lo in range(0, num_experts, experts_per_block):
        block_codes, block_scale = quant_mxfp4(weight[lo : lo + experts_per_block])
        if codes is None or scale is None:
            codes = block_codes.new_empty((num_experts, *block_codes.shape[1:]))
            scale = block_scale.new_empty((num_experts, *block_scale.shape[1:]))
        codes[lo : lo + experts_per_block] = block_codes
        scale[lo : lo + experts_per_block] = block_scale
    assert codes is not None and scale is not None, "an Experts module has at least one expert"
    return codes, scale


def pack_experts(model: nn.Module) -> int:
    """Replace every dense `Experts` in `model` by `PackedExperts`; -> how many were packed."""
    count = 0
    for module in list(model.modules()):
        experts = getattr(module, "experts", None)
        if isinstance(experts, Experts):
            module.experts = PackedExperts.from_experts(experts)
            count += 1
    return count
