"""Prefill-sized routed experts (kernels/moe_mxfp4/grouped.py) against the MXFP4 reference: the
weight decode kernel bit for bit (CPU interpreter), the grouped GEMM path within float tolerance,
with experts left without tokens, uneven groups and repeated experts across slots."""

from __future__ import annotations

import pytest
import torch

from antumbra.kernels.moe_mxfp4.grouped import (
    DEQUANT_SWEEP,
    Mxfp4DequantConfig,
    dequant_mxfp4_into,
    group_slots,
    moe_mxfp4_grouped,
)
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


def _decode_into(config: Mxfp4DequantConfig, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                 row_offset: int, spare_rows: int) -> torch.Tensor:
    """Decode into rows [row_offset, row_offset + R) of a NaN-filled [G, R + spare_rows, C] target, checking
    that no other row was written; -> the decoded rows."""
    groups, rows, half = codes.shape
    out = torch.full((groups, rows + spare_rows, 2 * half), float("nan"), dtype=dtype)
    dequant_mxfp4_into(out, codes, scales, row_offset=row_offset, config=config)
    outside = torch.cat([out[:, :row_offset], out[:, row_offset + rows :]], dim=1)
    assert outside.isnan().all(), f"{config}: rows outside the target were written"
    return out[:, row_offset : row_offset + rows]


def test_every_dequant_variant_is_exact() -> None:
    """Each tile the benchmark sweeps, bf16. 2 x 40 rows (no tile height divides them) and 400 packed
    bytes a row (a partial column tile for every width)."""
    gen = torch.Generator().manual_seed(2)
    codes, scales = _packed(gen, 2, 40, 800)
    want = dequant_mxfp4(codes, scales).to(torch.bfloat16)
    for config in DEQUANT_SWEEP:
        got = _decode_into(config, codes, scales, torch.bfloat16, row_offset=8, spare_rows=24)
        assert torch.equal(got, want), config


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_a_swept_tile_is_exact_in_other_dtypes(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    codes, scales = _packed(gen, 3, 24, 160)
    config = Mxfp4DequantConfig(block_r=32, block_b=64)
    got = _decode_into(config, codes, scales, dtype, row_offset=4, spare_rows=8)
    assert torch.equal(got, dequant_mxfp4(codes, scales).to(dtype))


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


def test_padded_rows_put_each_pair_at_its_group_row() -> None:
    from antumbra.kernels.moe_mxfp4.grouped import _padded_rows

    gen = torch.Generator().manual_seed(5)
    tokens, top_k, experts = 7, 3, 5
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices
    dest, _, total = group_slots(ids, experts)
    x = torch.randn(tokens, 24, generator=gen)
    want = x.new_zeros(total, 24)
    want[dest] = x.repeat_interleave(top_k, dim=0)  # the scatter it replaces
    assert torch.equal(_padded_rows(x, dest, total, top_k), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_combine_kernel_sums_each_tokens_slots_in_float32(dtype: torch.dtype) -> None:
    """`combine_slots` (interpreter) against the slot-by-slot float32 sum it states, on a D that is not
    a multiple of its block, with padded rows that must not be read."""
    from antumbra.kernels.moe_mxfp4.grouped import combine_slots

    gen = torch.Generator().manual_seed(6)
    tokens, top_k, experts, d = 5, 4, 6, 1100
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices
    dest, _, total = group_slots(ids, experts)
    y = torch.randn(total, d, generator=gen).to(dtype)
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    got = combine_slots(y, dest, weights)
    want = torch.zeros(tokens, d)
    for slot in range(top_k):
        want += y[dest.view(tokens, top_k)[:, slot]].float() * weights[:, slot : slot + 1]
    assert got.dtype == dtype and got.shape == (tokens, d)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.float(), want.to(dtype).float(), rtol=tol, atol=tol)
