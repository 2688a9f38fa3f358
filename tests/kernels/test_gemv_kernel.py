"""The few-token linear kernel against its reference (`gemv_into_reference`).

Runs in the Triton interpreter on CPU, compiled where a CUDA device is present. Outputs and the
split-K workspace start as NaN, so an element the kernel never writes fails; rows no token maps to
must keep their values. The kernel sums in another order than the reference's float32 matmul, so a
bf16 output may differ by one rounding step, a float32 one by the order of float32 sums.
"""

from __future__ import annotations

import pytest
import torch

from antumbra.kernels.common.arrivals import MIN_COUNTERS, arrival_counters
from antumbra.kernels.gemv import (
    GEMV_MAX_TOKENS,
    GemvConfig,
    gemv,
    gemv_into,
    gemv_into_reference,
    takes_gemv,
)
from antumbra.kernels.gemv.triton import gemv_plan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROUNDING = {torch.bfloat16: 2.0**-7, torch.float32: 1e-5}


def _case(tokens: int, k: int, widths: tuple[int, ...], dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g).to(dtype).to(DEVICE)
    weights = [(0.05 * torch.randn(n, k, generator=g)).to(dtype).to(DEVICE) for n in widths]
    rows = torch.randperm(2 * tokens + 3, generator=g)[:tokens].to(DEVICE)
    return x, weights, rows


def _outputs(num_rows: int, weights, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.full((num_rows, w.shape[0]), float("nan"), dtype=dtype, device=DEVICE) for w in weights]


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.equal(out.isnan(), ref.isnan()), "the kernel wrote other rows than the reference"
    written = ~ref.isnan()
    tol = ROUNDING[dtype]
    o, r = out[written].float(), ref[written].float()
    assert torch.allclose(o, r, rtol=tol, atol=tol * float(r.abs().max())), float((o - r).abs().max())


CASES = [  # tokens, K, widths, config (None: the default plan)
    (1, 300, (40, 24), GemvConfig(block_n=16, block_k=64)),  # partial tiles and steps, two weights
    (1, 1024, (64,), None),
    (3, 1000, (33,), GemvConfig(block_n=8, block_k=128, split_k=3)),  # slices whose last runs past K
    (2, 512, (16, 16), GemvConfig(block_n=16, block_k=128, split_k=1)),
    (1, 640, (24, 8), GemvConfig(block_n=8, block_k=64, split_k=4)),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-K{c[1]}-N{'+'.join(map(str, c[2]))}")
def test_rows_and_values_match_the_reference(case, dtype):
    tokens, k, widths, config = case
    x, weights, rows = _case(tokens, k, widths, dtype, seed=k + tokens)
    num_rows = 2 * tokens + 3
    out = _outputs(num_rows, weights, torch.float32)
    ref = _outputs(num_rows, weights, torch.float32)
    gemv_into(x, weights, out, rows=rows, scale=0.25, config=config)
    gemv_into_reference(x, weights, ref, rows=rows, scale=0.25)
    for o, r in zip(out, ref, strict=True):
        _assert_close(o, r, dtype)
    assert not arrival_counters(x.device, MIN_COUNTERS).any(), "a counter was left non-zero"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gemv_is_a_bias_free_linear(dtype):
    x, (weight,), _ = _case(1, 700, (48,), dtype, seed=3)
    y = gemv(x[None], weight)  # [1, 1, K] -> [1, 1, N]
    assert y.shape == (1, 1, 48) and y.dtype == dtype
    ref = torch.nn.functional.linear(x.float(), weight.float()).to(dtype)
    _assert_close(y[0], ref, dtype)
    scaled = gemv(x, weight, scale=0.5, out_dtype=torch.float32)
    assert scaled.dtype == torch.float32
    assert torch.equal(scaled, y[0].float() * 0.5), "the scale applies to the rounded product"


def test_split_slices_agree_with_one_slice():
    x, weights, rows = _case(1, 2048, (32, 16), torch.float32, seed=11)
    one, four = _outputs(5, weights, torch.float32), _outputs(5, weights, torch.float32)
    gemv_into(x, weights, one, rows=rows, config=GemvConfig(block_k=256, split_k=1))
    gemv_into(x, weights, four, rows=rows, config=GemvConfig(block_k=256, split_k=4))
    for a, b in zip(one, four, strict=True):
        _assert_close(b, a, torch.float32)


def test_plan_splits_only_what_does_not_fill_the_chip():
    cfg = GemvConfig(block_n=16, block_k=512)
    assert gemv_plan(1, (1024, 1024), 4096, 132, cfg)[1] == 3  # 128 tiles: about two programs an SM
    assert gemv_plan(1, (64,), 4096, 132, cfg)[1] == 8  # capped by K / min_split_cols
    assert gemv_plan(4, (4096,), 4096, 132, cfg)[1] == 1  # 1024 tiles fill a wave


def test_bad_shapes_are_refused():
    x, weights, rows = _case(2, 64, (16,), torch.float32, seed=5)
    with pytest.raises(AssertionError, match="weights must be"):
        gemv_into(x, [weights[0].t().contiguous()], _outputs(5, weights, torch.float32))
    with pytest.raises(AssertionError, match="rows must be"):
        gemv_into(x, weights, _outputs(5, weights, torch.float32), rows=rows.float())
    with pytest.raises(AssertionError, match="one or two weights"):
        gemv_into(x, weights * 3, _outputs(5, weights * 3, torch.float32))


def test_model_calls_take_the_gemv_only_on_cuda_at_few_tokens():
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert not takes_gemv(torch.zeros(1, 16, dtype=torch.bfloat16), w)  # CPU: torch's own linear
    if torch.cuda.is_available():
        wc = w.cuda()
        assert takes_gemv(torch.zeros(GEMV_MAX_TOKENS, 16, dtype=torch.bfloat16, device="cuda"), wc)
        assert not takes_gemv(torch.zeros(GEMV_MAX_TOKENS + 1, 16, dtype=torch.bfloat16, device="cuda"), wc)
        assert not takes_gemv(torch.zeros(1, 16, dtype=torch.float32, device="cuda"), wc)


@pytest.mark.gpu
def test_graph_replays_are_bitwise_the_eager_call():
    """On a GPU only (`@pytest.mark.gpu`); `kernels.gemv` checks the same at every V4 shape."""
    x, weights, rows = _case(1, 4096, (1024, 1024), torch.bfloat16, seed=7)
    eager = _outputs(5, weights, torch.float32)
    gemv_into(x, weights, eager, rows=rows)
    replayed = _outputs(5, weights, torch.float32)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv_into(x, weights, replayed, rows=rows)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(eager, replayed, strict=True):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


@pytest.mark.gpu
@pytest.mark.parametrize("widths", [(1024, 1024), (256, 256), (512, 512), (256,), (64,)],
                         ids=lambda w: "+".join(map(str, w)))
def test_v4_projection_shapes_match_the_reference_on_a_gpu(widths):
    """The model's shapes at the default plan (the benchmark `kernels.gemv` checks them too)."""
    x, weights, rows = _case(1, 4096, widths, torch.bfloat16, seed=sum(widths))
    out, ref = _outputs(5, weights, torch.float32), _outputs(5, weights, torch.float32)  # rows < 2T + 3
    gemv_into(x, weights, out, rows=rows)
    gemv_into_reference(x, weights, ref, rows=rows)
    for o, r in zip(out, ref, strict=True):
        _assert_close(o, r, torch.bfloat16)
