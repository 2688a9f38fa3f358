"""Packing dense experts into MXFP4 a block of experts at a time: the same codes as the whole layer
at once, and on a GPU, float32 temporaries of a block only (what lets a 256-expert layer pack)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from antumbra.replicas.model.moe import Experts
from antumbra.replicas.model.packed_experts import PACK_EXPERTS_PER_BLOCK, PackedExperts
from antumbra.replicas.model.tiny import TinyModelSpec, build_model


def _experts(num_experts: int, inter: int, hidden: int, device: str, dtype: torch.dtype) -> Experts:
    cfg = dataclasses.replace(build_model(TinyModelSpec(seed=1)).config, num_experts=num_experts,
                              moe_intermediate_size=inter, hidden_size=hidden)
    experts = Experts(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) * 0.05)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) * 0.05)
    return experts.to(device=device, dtype=dtype)


def _buffers(packed: PackedExperts) -> dict[str, torch.Tensor]:
    return {name: b.view(torch.uint8) for name, b in packed.named_buffers()}


@pytest.mark.parametrize("per_block", [1, 2, 3, 7])
def test_packing_by_blocks_of_experts_gives_the_whole_layers_codes(per_block: int) -> None:
    experts = _experts(7, 64, 96, "cpu", torch.float32)
    whole = _buffers(PackedExperts.from_experts(experts, experts_per_block=7))
    blocked = _buffers(PackedExperts.from_experts(experts, experts_per_block=per_block))
    assert whole.keys() == blocked.keys() == {"w1", "w1_scale", "w3", "w3_scale", "w2", "w2_scale"}
    assert all(torch.equal(whole[k], blocked[k]) for k in whole)


def test_a_block_of_no_experts_is_refused() -> None:
    with pytest.raises(ValueError, match="experts_per_block"):
        PackedExperts.from_experts(_experts(2, 64, 96, "cpu", torch.float32), experts_per_block=0)


def _packing_peak_bytes(experts: Experts, experts_per_block: int) -> int:
    """Device memory the packing needs beyond the dense layer, at its peak."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    packed = PackedExperts.from_experts(experts, experts_per_block=experts_per_block)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del packed
    return peak


@pytest.mark.gpu
def test_packing_a_many_expert_layer_needs_a_blocks_float32_not_the_layers() -> None:
    num_experts = 64
    experts = _experts(num_experts, 512, 1024, "cuda", torch.bfloat16)
    whole = _packing_peak_bytes(experts, num_experts)
    blocked = _packing_peak_bytes(experts, PACK_EXPERTS_PER_BLOCK)
    packed_bytes = num_experts * 3 * 512 * 1024 * 17 // 32  # codes (half a byte) and scales
    # The float32 temporaries scale with the experts quantised together: a block of 8 in 64 needs an
    # eighth of the whole layer's, beside the packed output both hold.
    temporaries = (whole - packed_bytes) * PACK_EXPERTS_PER_BLOCK / num_experts
    assert blocked <= packed_bytes + 1.5 * temporaries
    assert blocked < whole / 3
