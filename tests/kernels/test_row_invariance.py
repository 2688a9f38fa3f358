"""Batch-invariant mode's premise, per kernel: at one launch shape (the rows T fixed, so every tile,
split and config is fixed), a row's output is bitwise the same whatever the other rows hold and
wherever the row sits. Batch-invariant mode then fixes the shape (`replicas/decode_graphs.py`,
`invariant_batch_size`). Run in the Triton interpreter on CPU at small shapes; the GPU check is the
engine's (`tests/replicas/test_gpu_paths.py`).
"""

from __future__ import annotations

import pytest
import torch

from antumbra.kernels.fp8_linear import fp8_linear
from antumbra.kernels.mhc import mhc_post, mhc_pre
from antumbra.kernels.moe_mxfp4 import moe_mxfp4
from antumbra.replicas.model.quant import quant_fp8_block, quant_mxfp4

ROWS = 6  # the launch's row count
ROW, MOVED_TO = 1, 4  # the row under test, and where it sits in the second batch


def _moved(g: torch.Generator, x: torch.Tensor) -> torch.Tensor:
    """The same launch shape: row ROW of x at MOVED_TO, every other row new random values."""
    other = torch.randn(x.shape, generator=g).to(x.dtype)
    other[MOVED_TO] = x[ROW]
    return other


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_row_is_independent_of_its_batch(dtype):
    g = torch.Generator().manual_seed(3)
    weight, scale = quant_fp8_block(0.05 * torch.randn(160, 200, generator=g))  # partial 128-blocks
    x = torch.randn(ROWS, 200, generator=g).to(dtype)
    first = fp8_linear(x, weight, scale)
    second = fp8_linear(_moved(g, x), weight, scale)
    assert torch.equal(first[ROW], second[MOVED_TO])


def test_moe_mxfp4_row_is_independent_of_its_batch():
    """The other rows route to other experts, so the row's pairs land in other tiles."""
    g = torch.Generator().manual_seed(4)
    experts, hidden, inter, top_k = 5, 64, 32, 2
    weights = []
    for rows, cols in ((inter, hidden), (inter, hidden), (hidden, inter)):
        weights.extend(quant_mxfp4(torch.randn(experts, rows, cols, generator=g) * 0.15))
    x = torch.randn(ROWS, hidden, generator=g)
    route_w = torch.rand(ROWS, top_k, generator=g) + 0.1
    ids = torch.rand(ROWS, experts, generator=g).topk(top_k, dim=-1).indices
    first = moe_mxfp4(x, route_w, ids, *weights, 0.6)
    ids2 = torch.rand(ROWS, experts, generator=g).topk(top_k, dim=-1).indices
    ids2[MOVED_TO] = ids[ROW]
    route_w2 = torch.rand(ROWS, top_k, generator=g) + 0.1
    route_w2[MOVED_TO] = route_w[ROW]
    second = moe_mxfp4(_moved(g, x), route_w2, ids2, *weights, 0.6)
    assert torch.equal(first[ROW], second[MOVED_TO])


def test_mhc_pre_and_post_rows_are_independent_of_their_batch():
    g = torch.Generator().manual_seed(5)
    n, d = 4, 40
    fn = torch.randn((2 + n) * n, n * d, generator=g) * 0.2
    base = torch.randn((2 + n) * n, generator=g)
    scale = torch.rand(3, generator=g) + 0.5
    streams = torch.randn(ROWS, n, d, generator=g)
    block_out = torch.randn(ROWS, d, generator=g)
    outs = []
    for s, b in ((streams, block_out), (_moved(g, streams), _moved(g, block_out))):
        collapsed, post, comb = mhc_pre(s, fn, base, scale, 20, 1e-6, 1e-6)
        outs.append((collapsed, post, comb, mhc_post(s, b, post, comb)))
    for first, second in zip(outs[0], outs[1], strict=True):
        assert torch.equal(first[ROW], second[MOVED_TO])
