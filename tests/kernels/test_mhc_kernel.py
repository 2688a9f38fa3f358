"""mHC pre / post kernels vs their references, and the references vs the model's `HyperConnection`.

Runs in the Triton interpreter on CPU: small irregular shapes (D not a power of two, n = 3 padded to
4 in registers, several K slices in the split-K GEMM).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from antumbra.kernels.mhc import (
    mhc_head,
    mhc_head_reference,
    mhc_post,
    mhc_post_reference,
    mhc_pre,
    mhc_pre_reference,
)
from antumbra.kernels.mhc import triton as mhc_triton
from antumbra.replicas.model.hyper_connections import HyperConnection, HyperHead

ITERS, HC_EPS, NORM_EPS = 20, 1e-6, 1e-6


def _nan_empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _inputs(g: torch.Generator, tokens: int, n: int, d: int, dtype: torch.dtype):
    streams = torch.randn(tokens, n, d, generator=g).to(dtype)
    fn = torch.randn((2 + n) * n, n * d, generator=g) * 0.2
    base = torch.randn((2 + n) * n, generator=g)
    scale = torch.rand(3, generator=g) + 0.5
    return streams, fn, base, scale


@pytest.mark.parametrize(
    ("tokens", "n", "d", "dtype", "split_k"),
    [
        (3, 4, 40, torch.float32, 3),  # three K slices, the last one partial
        (5, 3, 24, torch.bfloat16, None),  # n padded to 4, heuristic split
        (1, 4, 72, torch.float32, 1),  # decode: one token, whole K in one program
    ],
)
def test_pre_matches_reference(tokens, n, d, dtype, split_k, monkeypatch):
    monkeypatch.setattr(mhc_triton, "_empty", _nan_empty)
    g = torch.Generator().manual_seed(tokens * 100 + d)
    streams, fn, base, scale = _inputs(g, tokens, n, d, dtype)
    collapsed, post, comb = mhc_pre(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS, split_k=split_k)
    # float32 reference on the upcast streams
    ref_c, ref_p, ref_m = mhc_pre_reference(streams.float(), fn, base, scale, ITERS, HC_EPS, NORM_EPS)
    for out in (collapsed, post, comb):
        assert out.isfinite().all(), "kernel left outputs unwritten"
    assert collapsed.dtype == dtype
    assert _rel_err(post, ref_p) < 1e-5
    assert _rel_err(comb, ref_m) < 1e-5
    assert _rel_err(collapsed, ref_c) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize(
    "tiles",
    [mhc_triton.PreTiles(mix_block_t=16, mix_warps=8, finish_warps=1),
     mhc_triton.PreTiles(mix_block_t=32, finish_warps=2)],
    ids=["narrow-tiles-one-warp-finish", "two-warp-finish"],
)
def test_pre_launch_shapes_give_the_reference(tiles, monkeypatch):
    """`PreTiles` overrides (what the prefill sweep times) keep the outputs: 70 tokens over token tiles
    of 16 / 32 leave a partial last tile."""
    monkeypatch.setattr(mhc_triton, "_empty", _nan_empty)
    g = torch.Generator().manual_seed(9)
    streams, fn, base, scale = _inputs(g, 70, 4, 40, torch.float32)
    collapsed, post, comb = mhc_pre(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS, tiles=tiles)
    ref_c, ref_p, ref_m = mhc_pre_reference(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS)
    for out, ref in ((collapsed, ref_c), (post, ref_p), (comb, ref_m)):
        assert out.isfinite().all(), "kernel left outputs unwritten"
        assert _rel_err(out, ref) < 1e-5


@pytest.mark.parametrize(
    ("tokens", "n", "d", "dtype"), [(3, 4, 40, torch.float32), (2, 3, 300, torch.bfloat16)]
)
def test_post_matches_reference(tokens, n, d, dtype, monkeypatch):
    monkeypatch.setattr(mhc_triton, "_empty", _nan_empty)
    g = torch.Generator().manual_seed(tokens * 100 + d + 1)
    streams = torch.randn(tokens, n, d, generator=g).to(dtype)
    block_out = torch.randn(tokens, d, generator=g).to(dtype)
    post = 2 * torch.rand(tokens, n, generator=g)
    comb = torch.rand(tokens, n, n, generator=g)
    out = mhc_post(streams, block_out, post, comb, block_d=256)
    ref = mhc_post_reference(streams.float(), block_out.float(), post, comb)
    assert out.dtype == dtype and out.isfinite().all()
    assert _rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_references_match_model():
    """Same streams through the model's HyperConnection.pre / .post give the references' results."""
    g = torch.Generator().manual_seed(7)
    tokens, n, d = 4, 4, 40
    cfg = SimpleNamespace(
        hc_mult=n, hc_sinkhorn_iters=ITERS, hc_eps=HC_EPS, rms_norm_eps=NORM_EPS, hidden_size=d
    )
    hc = HyperConnection(cfg)
    streams, fn, base, scale = _inputs(g, tokens, n, d, torch.float32)
    with torch.no_grad():
        hc.fn.copy_(fn)
        hc.base.copy_(base)
        hc.scale.copy_(scale)
        model_out = hc.pre(streams)
        ref_out = mhc_pre_reference(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS)
        for got, want in zip(ref_out, model_out, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        block_out = torch.randn(tokens, d, generator=g)
        torch.testing.assert_close(
            mhc_post_reference(streams, block_out, model_out[1], model_out[2]),
            hc.post(streams, block_out, model_out[1], model_out[2]),
            rtol=1e-5, atol=1e-6,
        )


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 32, 33, 64, 1024])
def test_compiled_pre_and_post_at_the_planned_shapes_give_the_reference(tokens, monkeypatch):
    """V4-Flash's widths on the GPU at the plans either side of `DECODE_TOKENS` and of the one-warp
    prefill finish: every planned launch shape gives the float32 reference."""
    monkeypatch.setattr(mhc_triton, "_empty", _nan_empty)
    g = torch.Generator().manual_seed(tokens)
    streams, fn, base, scale = (t.cuda() for t in _inputs(g, tokens, 4, 4096, torch.bfloat16))
    collapsed, post, comb = mhc_pre(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS)
    ref_c, ref_p, ref_m = mhc_pre_reference(streams.float(), fn, base, scale, ITERS, HC_EPS, NORM_EPS)
    assert _rel_err(post, ref_p) < 1e-5 and _rel_err(comb, ref_m) < 1e-5
    assert _rel_err(collapsed, ref_c) < 1e-2
    block_out = torch.randn(tokens, 4096, generator=g).to(torch.bfloat16).cuda()
    new = mhc_post(streams, block_out, post, comb)
    assert _rel_err(new, mhc_post_reference(streams.float(), block_out.float(), ref_p, ref_m)) < 1e-2


def _head_inputs(g: torch.Generator, tokens: int, n: int, d: int, dtype: torch.dtype):
    streams = torch.randn(tokens, n, d, generator=g).to(dtype)
    return streams, torch.randn(n, n * d, generator=g) * 0.2, torch.randn(n, generator=g), torch.rand(1) + 0.5


@pytest.mark.parametrize(
    ("tokens", "n", "d", "dtype"),
    [(1, 4, 72, torch.float32), (5, 3, 40, torch.bfloat16), (70, 4, 64, torch.float32)],
)
def test_head_matches_reference(tokens, n, d, dtype, monkeypatch):
    """One token; n = 3 padded in registers; past 64 tokens, where the mixing GEMM takes 3xTF32 on a
    GPU (the interpreter always multiplies in float32)."""
    monkeypatch.setattr(mhc_triton, "_empty", _nan_empty)
    g = torch.Generator().manual_seed(tokens * 10 + n)
    streams, fn, base, scale = _head_inputs(g, tokens, n, d, dtype)
    got = mhc_head(streams, fn, base, scale, HC_EPS, NORM_EPS)
    want = mhc_head_reference(streams.float(), fn, base, scale, HC_EPS, NORM_EPS)
    assert got.dtype == dtype and got.isfinite().all()
    assert _rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)


def _hyper_head(n: int, d: int, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor) -> HyperHead:
    head = HyperHead(SimpleNamespace(hc_mult=n, hc_eps=HC_EPS, rms_norm_eps=NORM_EPS, hidden_size=d))
    with torch.no_grad():
        head.hc_fn.copy_(fn)
        head.hc_base.copy_(base)
        head.hc_scale.copy_(scale)
    return head


def test_head_reference_is_the_models_hyper_head():
    g = torch.Generator().manual_seed(3)
    tokens, n, d = 3, 4, 40
    streams, fn, base, scale = _head_inputs(g, tokens, n, d, torch.float32)
    head = _hyper_head(n, d, fn, base, scale)
    with torch.no_grad():
        want = mhc_head_reference(streams, fn, base, scale, HC_EPS, NORM_EPS)
        torch.testing.assert_close(want, head(streams), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 33, 64, 1024])
def test_compiled_head_at_the_planned_shapes_gives_the_reference(tokens, monkeypatch):
    monkeypatch.setattr(mhc_triton, "_empty", _nan_empty)
    g = torch.Generator().manual_seed(tokens)
    streams, fn, base, scale = (t.cuda() for t in _head_inputs(g, tokens, 4, 4096, torch.bfloat16))
    got = mhc_head(streams, fn, base, scale, HC_EPS, NORM_EPS)
    assert _rel_err(got, mhc_head_reference(streams.float(), fn, base, scale, HC_EPS, NORM_EPS)) < 1e-2


@pytest.mark.gpu
def test_the_models_hyper_head_runs_the_kernel_on_cuda(monkeypatch):
    """Under no_grad on CUDA the head is the kernel's; with gradients it stays the chain."""
    from antumbra.replicas.model import hyper_connections

    calls = []
    fused = hyper_connections.mhc_head
    monkeypatch.setattr(hyper_connections, "mhc_head", lambda *a: calls.append(1) or fused(*a))
    g = torch.Generator().manual_seed(5)
    streams, fn, base, scale = (t.cuda() for t in _head_inputs(g, 3, 4, 256, torch.float32))
    head = _hyper_head(4, 256, fn, base, scale).cuda()
    with torch.no_grad():
        fast = head(streams)
    chain = head(streams)  # the parameters take gradients: the chain
    assert calls == [1] and chain.requires_grad
    torch.testing.assert_close(fast, chain.detach(), rtol=1e-5, atol=1e-5)
