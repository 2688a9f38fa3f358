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


@pytest.mark.gpu
def test_packing_a_many_expert_layer_needs_a_blocks_float32_not_the_layers() -> None:
    experts = _experts(64, 512, 1024, "cuda", torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    packed = PackedExperts.from_experts(experts)
    torch.cuda.synchronize()
    extra_peak = torch.cuda.max_memory_allocated() - before
    packed_bytes = sum(b.numel() * b.element_size() for b in packed.buffers())
    one_expert_f32 = 3 * 512 * 1024 * 4
    layer_f32 = 64 * one_expert_f32
    # The packed layer, plus temporaries of one block of experts (a few float32 copies of it).
    assert extra_peak <= packed_bytes + 6 * PACK_EXPERTS_PER_BLOCK * one_expert_f32
    assert extra_peak < layer_f32 / 2
