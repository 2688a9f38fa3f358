"""Prefill-sized routed experts (kernels/moe_mxfp4/grouped.py) against the MXFP4 reference: the
weight decode kernel bit for bit (CPU interpreter), the grouped GEMM path within float tolerance,
with experts left without tokens, uneven groups and repeated experts across slots."""

from __future__ import annotations

import pytest
import torch

from antumbra.kernels.moe_mxfp4.grouped import dequant_mxfp4_into, group_slots, moe_mxfp4_grouped
from antumbra.kernels.moe_mxfp4.reference import dequant_mxfp4, moe_mxfp4_reference


def _packed(gen: torch.Generator, experts: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (experts, rows, cols // 2)
    codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(118, 134, (experts, rows, cols // 32), generator=gen, dtype=torch.int32)
    return codes, scales.to(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dequant_kernel_is_exact(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    codes, scales = _packed(gen, 3, 16, 96)
    out = torch.full((3, 40, 96), float("nan"), dtype=dtype)
    dequant_mxfp4_into(out, codes, scales, row_offset=8)
    assert torch.equal(out[:, 8:24], dequant_mxfp4(codes, scales).to(dtype))
    assert out[:, :8].isnan().all() and out[:, 24:].isnan().all(), "rows outside the target were written"


def test_group_slots_pads_each_expert_to_whole_tiles() -> None:
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])
    dest, offs, total = group_slots(ids, num_experts=5)
    assert total == ids.numel() + 16 * 5
    # expert 0: two slots at rows 0, 1; expert 1: none; expert 2: three slots from 16; expert 3 from 32.
    assert dest.tolist() == [16, 0, 17, 32, 1, 18]
    assert offs.tolist() == [16, 16, 32, 48, total]


@pytest.mark.parametrize("tokens", [1, 37, 130])
def test_grouped_experts_match_the_reference(tokens: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, top_k = 6, 64, 32, 3
    w1, s1 = _packed(gen, experts, inter, hidden)
    w3, s3 = _packed(gen, experts, inter, hidden)
    w2, s2 = _packed(gen, experts, hidden, inter)
    x = torch.randn(tokens, hidden, generator=gen)
    # The last expert gets no token.
    ids = torch.stack([torch.randperm(experts - 1, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    args = (x, weights, ids, w1, s1, w3, s3, w2, s2, 7.0)
    got, want = moe_mxfp4_grouped(*args), moe_mxfp4_reference(*args)
    # float32 both, but the grouped GEMM sums in its own order: outputs near 16 differ by up to
    # 1.7e-5 relative on some CPUs (rtol 1e-5 failed on one element); a wrong path is off by O(1).
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
