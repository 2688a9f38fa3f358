"""MXFP4 grouped expert kernels vs the reference, and the reference vs the model's code.

The reference restates the MXFP4 decode (kernels may not import the model), so it is checked against
`replicas.model.quant.unpack_mxfp4`, and its expert loop against `replicas.model.moe.Experts`.
Kernels run in the Triton interpreter on CPU: tiny grids, hidden and intermediate sizes that are not
multiples of the tiles.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from antumbra.kernels.moe_mxfp4 import (
    MoeTiles,
    align_pairs,
    dequant_mxfp4,
    moe_mxfp4,
    moe_mxfp4_reference,
    sum_slots,
    sum_slots_reference,
)
from antumbra.kernels.moe_mxfp4 import slots as moe_slots
from antumbra.kernels.moe_mxfp4 import triton as moe_triton
from antumbra.replicas.model.moe import Experts
from antumbra.replicas.model.quant import quant_mxfp4, unpack_mxfp4

LIMIT = 0.6  # low enough that the random gate / up values hit both clamps


def _nan_empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _weights(g: torch.Generator, experts: int, hidden: int, inter: int) -> list[torch.Tensor]:
    """[w1, s1, w3, s3, w2, s2], quantised from random float weights (float8_e8m0fnu scales)."""
    out = []
    for rows, cols in ((inter, hidden), (inter, hidden), (hidden, inter)):
        out.extend(quant_mxfp4(torch.randn(experts, rows, cols, generator=g) * 0.15))
    return out


def _routing(g: torch.Generator, tokens: int, experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    return weights, ids


def test_dequant_matches_model_quant():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 5, 48), generator=g, dtype=torch.uint8)  # every code, both nibbles
    exps = torch.randint(100, 140, (3, 5, 3), generator=g, dtype=torch.uint8)
    want = unpack_mxfp4(packed.view(torch.int8), exps.view(torch.float8_e8m0fnu))
    assert torch.equal(dequant_mxfp4(packed.view(torch.int8), exps.view(torch.float8_e8m0fnu)), want)
    assert torch.equal(dequant_mxfp4(packed, exps), want)


def test_reference_matches_model_experts():
    """Dequantised weights through the model's Experts module give the reference's output."""
    g = torch.Generator().manual_seed(1)
    experts, hidden, inter, tokens, top_k = 5, 64, 32, 6, 3
    w1, s1, w3, s3, w2, s2 = _weights(g, experts, hidden, inter)
    cfg = SimpleNamespace(
        num_experts=experts, moe_intermediate_size=inter, hidden_size=hidden, swiglu_limit=LIMIT
    )
    module = Experts(cfg)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.cat([unpack_mxfp4(w1, s1), unpack_mxfp4(w3, s3)], dim=1))
        module.down_proj.copy_(unpack_mxfp4(w2, s2))
        x = torch.randn(tokens, hidden, generator=g)
        weights, ids = _routing(g, tokens, experts, top_k)
        want = module(x, weights, ids)
    got = moe_mxfp4_reference(x, weights, ids, w1, s1, w3, s3, w2, s2, LIMIT)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_align_pairs():
    g = torch.Generator().manual_seed(2)
    experts, tokens, top_k, block_t = 6, 9, 3, 4
    _, ids = _routing(g, tokens, experts, top_k)
    pair_ids, block_expert = align_pairs(ids, experts, block_t)
    num_pairs = tokens * top_k
    real = pair_ids[pair_ids < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs)), "every pair exactly once"
    flat = ids.reshape(-1)
    for b, expert in enumerate(block_expert.tolist()):
        block = pair_ids[b * block_t : (b + 1) * block_t]
        block = block[block < num_pairs]
        if expert < 0:
            assert block.numel() == 0
        else:
            assert block.numel() > 0 and (flat[block.long()] == expert).all()


@pytest.mark.parametrize(
    ("tiles", "dtype"),
    [
        (MoeTiles(block_t=1, block_n=64, block_kb=32, use_dot=False), torch.float32),  # a pair per program
        # a token's experts summed in the down kernel instead of per-pair rows and a reduction
        (MoeTiles(block_t=1, block_n=16, block_kb=64, use_dot=False, sum_slots=True, down_block_n=8),
         torch.bfloat16),
        (MoeTiles(block_t=16, block_n=32, block_kb=32, use_dot=True), torch.bfloat16),  # sorted token tiles
        # sorted pairs sharing each decoded weight tile on the CUDA cores; K tail at block_kb 64
        (MoeTiles(block_t=2, block_n=16, block_kb=32, use_dot=False), torch.float32),
        (MoeTiles(block_t=4, block_n=32, block_kb=64, use_dot=False), torch.bfloat16),
        (MoeTiles(block_t=16, block_n=64, block_kb=16, use_dot=True), torch.float32),  # sorted, K tail
    ],
)
def test_kernel_matches_reference(tiles, dtype, monkeypatch):
    monkeypatch.setattr(moe_triton, "_empty", _nan_empty)
    g = torch.Generator().manual_seed(tiles.block_t * 10 + tiles.block_kb)
    experts, hidden, inter, tokens, top_k = 5, 96, 64, 3, 2
    w1, s1, w3, s3, w2, s2 = _weights(g, experts, hidden, inter)
    if tiles.block_t == 16:
        s1, s3, s2 = (s.view(torch.uint8) for s in (s1, s3, s2))  # raw exponent bytes are accepted too
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    weights, ids = _routing(g, tokens, experts, top_k)
    out = moe_mxfp4(x, weights, ids, w1, s1, w3, s3, w2, s2, LIMIT, tiles=tiles)
    ref = moe_mxfp4_reference(x.float(), weights, ids, w1, s1, w3, s3, w2, s2, LIMIT)
    assert out.dtype == dtype and out.isfinite().all(), "kernel left outputs unwritten"
    assert _rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize(
    "tiles",
    [MoeTiles(block_t=1, block_n=64, block_kb=32, use_dot=False),
     MoeTiles(block_t=16, block_n=32, block_kb=32, use_dot=True),
     MoeTiles(block_t=4, block_n=16, block_kb=32, use_dot=False)],
    ids=["pairs", "sorted", "rows"],
)
def test_release_round_trip_of_the_down_input(tiles, monkeypatch):
    """act_fp8: the weighted SwiGLU output takes an FP8 round trip before w2, as the model's release
    path does (reference: `down_input` = the model's round trip). float32, so the kernel and the
    reference round the same values up to accumulation order (tolerance as above)."""
    from antumbra.replicas.model.numerics import RELEASE

    monkeypatch.setattr(moe_triton, "_empty", _nan_empty)
    g = torch.Generator().manual_seed(7)
    experts, hidden, inter, tokens, top_k = 5, 96, 256, 3, 2  # two 128-channel blocks per down input
    w1, s1, w3, s3, w2, s2 = _weights(g, experts, hidden, inter)
    x = RELEASE.act(torch.randn(tokens, hidden, generator=g)).contiguous()
    weights, ids = _routing(g, tokens, experts, top_k)
    out = moe_mxfp4(x, weights, ids, w1, s1, w3, s3, w2, s2, LIMIT, tiles=tiles, act_fp8=True)
    ref = moe_mxfp4_reference(x, weights, ids, w1, s1, w3, s3, w2, s2, LIMIT, down_input=RELEASE.act)
    plain = moe_mxfp4_reference(x, weights, ids, w1, s1, w3, s3, w2, s2, LIMIT)
    assert out.isfinite().all()
    assert _rel_err(out, ref) < 1e-5
    assert _rel_err(plain, ref) > 1e-4  # the round trip is really applied


def _pairs_of(x: torch.Tensor) -> torch.Tensor:
    """`pack_pairs` restated in torch: 8 columns as f16x2 lanes (x0, x2), (x4, x6), (x1, x3), (x5, x7)."""
    words = (x.float() * 16.0).to(torch.float16).view(-1, 8)
    lanes = words[:, [0, 2, 4, 6, 1, 3, 5, 7]].contiguous()
    return lanes.view(torch.int32).view(x.shape[0], x.shape[1] // 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pack_pairs_lays_out_the_batch_one_operands(dtype):
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(3, 8 * 70, generator=g) * 4).to(dtype)  # 70 words: a ragged last block
    x[0, :8] = torch.tensor([0.0, -0.0, 1e-6, -3.5, 2000.0, -7e-5, 0.25, 1.0]).to(dtype)
    got = moe_triton.pack_pairs(x)
    assert got.dtype == torch.int32 and got.shape == (3, 8 * 70 // 2)
    assert torch.equal(got, _pairs_of(x))


# The f16x2 products are PTX: GPU only (benchmarks/kernels/moe.py makes the same bitwise check,
# `prepacked_bits`).
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act_fp8", [False, True])
def test_prepacked_operands_on_a_gpu_give_the_same_bits(dtype, act_fp8):
    """Batch 1 with `prepacked` (x packed by its own launch, h written packed unless act_fp8) makes the
    same products as the gathering path, so the outputs are equal bit for bit."""
    import dataclasses

    from antumbra.kernels.moe_mxfp4 import DECODE_TILES

    g = torch.Generator().manual_seed(12)
    experts, hidden, inter, top_k = 8, 512, 256, 3
    w = [t.cuda() for t in _weights(g, experts, hidden, inter)]
    weights, ids = (t.cuda() for t in _routing(g, 1, experts, top_k))
    x = torch.randn(1, hidden, generator=g).to(dtype).cuda()
    outs = [moe_mxfp4(x, weights, ids, *w, LIMIT, tiles=dataclasses.replace(DECODE_TILES, prepacked=p),
                      act_fp8=act_fp8) for p in (False, True)]
    assert outs[0].isfinite().all()
    assert torch.equal(outs[0], outs[1])


# The PTX nibble decode runs on a GPU only (`benchmarks/kernels/moe.py` checks the same tiles at
# V4-Flash's shapes before timing them).
@pytest.mark.gpu
@pytest.mark.parametrize("block_t", [2, 4, 8])
def test_row_tiles_on_a_gpu_match_the_reference(block_t):
    """Sorted rows sharing each decoded weight tile, with the GPU's decode, at a decode batch where
    experts meet one to several pairs."""
    g = torch.Generator().manual_seed(20 + block_t)
    experts, hidden, inter, tokens, top_k = 32, 512, 256, 24, 6
    w = [t.cuda() for t in _weights(g, experts, hidden, inter)]
    weights, ids = (t.cuda() for t in _routing(g, tokens, experts, top_k))
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).cuda()
    tiles = MoeTiles(block_t=block_t, block_n=16, block_kb=128, use_dot=False, num_stages=2)
    out = moe_mxfp4(x, weights, ids, *w, LIMIT, tiles=tiles)
    ref = moe_mxfp4_reference(x.float(), weights, ids, *w, LIMIT)
    assert out.isfinite().all()
    assert _rel_err(out, ref) < 1e-2


# The two-row f16x2 products are PTX: GPU only (`benchmarks/kernels/moe.py` makes the same bitwise check
# at V4-Flash's shapes, `pair_tiles_bits`).
@pytest.mark.gpu
@pytest.mark.parametrize("act_fp8", [False, True])
def test_pair_tiles_on_a_gpu_give_the_decode_tiles_bits(act_fp8):
    """Sorted pairs two to a program (`PAIR_TILES`: each word decoded once for both rows; an expert
    with an odd count ends in a block of one) make each pair's products exactly as the per-pair tiles
    do, so the outputs are equal bit for bit, and both match the reference."""
    from antumbra.kernels.moe_mxfp4 import DECODE_TILES, PAIR_TILES

    g = torch.Generator().manual_seed(31)
    experts, hidden, inter, tokens, top_k = 32, 512, 256, 24, 6
    w = [t.cuda() for t in _weights(g, experts, hidden, inter)]
    weights, ids = (t.cuda() for t in _routing(g, tokens, experts, top_k))
    counts = torch.bincount(ids.flatten().cpu(), minlength=experts)
    assert (counts % 2 == 1).any() and (counts >= 2).any()  # blocks of two and blocks of one
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).cuda()
    per_pair, paired = (moe_mxfp4(x, weights, ids, *w, LIMIT, tiles=t, act_fp8=act_fp8)
                        for t in (DECODE_TILES, PAIR_TILES))
    assert paired.isfinite().all()
    assert torch.equal(paired, per_pair)
    if not act_fp8:
        assert _rel_err(paired, moe_mxfp4_reference(x.float(), weights, ids, *w, LIMIT)) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_slot_sum_with_the_shared_output_is_the_reference_bit_for_bit(dtype, monkeypatch):
    """`sum_slots`: a token's k pair rows added in slot order, rounded, then the addend added and
    rounded again; D not a multiple of the block (a ragged last program)."""
    monkeypatch.setattr(moe_slots, "_empty", _nan_empty)
    g = torch.Generator().manual_seed(41)
    tokens, top_k, d = 3, 6, moe_slots.BLOCK + 40
    y = (torch.randn(tokens * top_k, d, generator=g) * 3).to(dtype)
    y[0, :4] = torch.tensor([0.0, -0.0, 1e-30, -2.5e4]).to(dtype)
    addend = torch.randn(tokens, d, generator=g).to(dtype)
    got = sum_slots(y, top_k, addend)
    assert got.dtype == dtype and torch.equal(got, sum_slots_reference(y, top_k, addend))
    torch.testing.assert_close(got, (y.view(tokens, top_k, d).float().sum(1).to(dtype) + addend))


@pytest.mark.parametrize(
    "tiles",
    [MoeTiles(block_t=1, block_n=64, block_kb=32, use_dot=False),
     MoeTiles(block_t=1, block_n=16, block_kb=64, use_dot=False, sum_slots=True, down_block_n=8)],
    ids=["pairs", "down-kernel-sums"],
)
def test_the_addend_is_what_adding_it_afterwards_gives(tiles, monkeypatch):
    """`moe_mxfp4(..., addend=a)` equals `moe_mxfp4(...) + a` bit for bit, whether a separate launch
    or the down kernel sums a token's pairs."""
    monkeypatch.setattr(moe_triton, "_empty", _nan_empty)
    g = torch.Generator().manual_seed(42)
    experts, hidden, inter, tokens, top_k = 5, 96, 64, 3, 2
    w = _weights(g, experts, hidden, inter)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    weights, ids = _routing(g, tokens, experts, top_k)
    shared = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    fused = moe_mxfp4(x, weights, ids, *w, LIMIT, tiles=tiles, addend=shared)
    assert torch.equal(fused, moe_mxfp4(x, weights, ids, *w, LIMIT, tiles=tiles) + shared)


@pytest.mark.gpu
def test_slot_sum_on_a_gpu_is_the_reference_and_near_torchs_chain():
    """V4-Flash's k and width at decode batch sizes, on the GPU: bit for bit the reference, and
    within one rounding of torch's own reduction and add (which may sum the slots in another order)."""
    g = torch.Generator(device="cuda").manual_seed(43)
    for tokens in (1, 8, 64):
        y = torch.randn(tokens * 6, 4096, device="cuda", generator=g).to(torch.bfloat16)
        addend = torch.randn(tokens, 4096, device="cuda", generator=g).to(torch.bfloat16)
        got = sum_slots(y, 6, addend)
        assert torch.equal(got, sum_slots_reference(y, 6, addend))
        chain = y.view(tokens, 6, 4096).sum(1) + addend
        torch.testing.assert_close(got, chain, rtol=2**-7, atol=2**-7)
