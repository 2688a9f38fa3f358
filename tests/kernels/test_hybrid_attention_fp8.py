"""Hybrid attention over FP8 KV rows (release numerics) decoded in the kernel, CPU interpreter.

The rows are written by the model's codec (`kv_rows.encode_kv`); the kernel reading them as one
assembled tile (`fp8_split_rope=False`) must give the plain kernel's output on the decoded pool
(`kv_rows.decode_kv`) bit for bit (the same tile after the load); read as two tiles (the default),
the same output up to float32 summation order; both the reference's on the decoded values within
the plain kernel's tolerance.
"""

from __future__ import annotations

import pytest
import torch

import antumbra.kernels.hybrid_attention.triton as triton_kernels
from antumbra.kernels.hybrid_attention.reference import hybrid_attention_reference
from antumbra.replicas.model.kv_rows import decode_kv, encode_kv, fp8_rows, kv_row_format
from antumbra.replicas.model.numerics import RELEASE

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
SUMMATION_ORDER = {torch.float32: 1e-6, torch.bfloat16: 1e-2}  # two-tile read against the plain kernel


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


def _coded_inputs(seed: int, dtype: torch.dtype, n: int, heads: int, head_dim: int, rope_dim: int,
                  window: int, extra: int):
    """Random values encoded as FP8 rows; row lists with the irregular cases of a batch."""
    gen = torch.Generator().manual_seed(seed)
    fmt = kv_row_format(RELEASE, head_dim, rope_dim, dtype)
    pool_rows, extra_pool_rows = 3 * n * window, 2 * n * extra + 1
    # Channels of very different magnitudes, so blocks get different exponents.
    spread = torch.logspace(-3, 2, head_dim)[torch.randperm(head_dim, generator=gen)]
    values = [(torch.randn(r, head_dim, generator=gen) * spread).to(dtype)
              for r in (pool_rows, extra_pool_rows)]
    kv_pool, extra_pool = (encode_kv(fmt, v, rope_dim, RELEASE) for v in values)
    q = torch.randn(n, heads, head_dim, generator=gen).to(dtype) * 0.05
    window_rows = torch.randint(0, pool_rows, (n, window), generator=gen, dtype=torch.int32)
    extra_rows = torch.randint(0, extra_pool_rows, (n, extra), generator=gen, dtype=torch.int32)
    window_rows[0, : window - 5] = -1
    extra_rows[1] = -1
    extra_rows[2, extra // 2 :] = -1
    sinks = torch.randn(heads, generator=gen)
    return fmt, q, kv_pool, window_rows, extra_pool, extra_rows, sinks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("config", "splits"),
    [
        pytest.param(triton_kernels.AttentionConfig(block_k=16, fp8_split_rope=False), 2,
                     id="resident-2split"),
        pytest.param(triton_kernels.AttentionConfig(block_k=16), 2, id="two-tiles-2split"),
        pytest.param(triton_kernels.AttentionConfig(block_k=16), 1, id="two-tiles-1split"),
        pytest.param(triton_kernels.AttentionConfig(block_k=16, block_d=32, block_dv=32), 1,
                     id="chunked-1split"),
    ],
)
def test_fp8_rows_decode_in_the_kernel(dtype, config, splits) -> None:
    # head_dim 128 with 32 RoPE channels: 96 e4m3 channels in two exponent blocks (one partial).
    n, heads, head_dim, rope_dim, window, extra = 4, 4, 128, 32, 16, 24
    fmt, q, kv_pool, window_rows, extra_pool, extra_rows, sinks = _coded_inputs(
        11 + splits, dtype, n, heads, head_dim, rope_dim, window, extra
    )
    layout = fp8_rows(fmt, rope_dim)
    assert layout is not None and kv_pool.dtype == torch.uint8 and kv_pool.shape[1] == layout.width
    coded = triton_kernels.hybrid_attention_decode(
        q, kv_pool, window_rows, extra_pool, extra_rows, sinks, num_splits=splits, config=config,
        fp8_rows=layout,
    )
    plain_pool, plain_extra = (decode_kv(fmt, p, rope_dim).contiguous() for p in (kv_pool, extra_pool))
    plain = triton_kernels.hybrid_attention_decode(
        q, plain_pool, window_rows, plain_extra, extra_rows, sinks, num_splits=splits, config=config,
    )
    if triton_kernels.fp8_constexprs(layout, head_dim, config)["SPLIT_ROPE"]:
        assert config.fp8_split_rope
        assert _rel_err(coded, plain) < SUMMATION_ORDER[dtype]
    else:
        assert torch.equal(coded, plain)
    ref = hybrid_attention_reference(q, plain_pool, window_rows, plain_extra, extra_rows, sinks)
    assert _rel_err(coded, ref) < TOLERANCE[dtype]


def test_fp8_rows_swa_only_at_v4_row_width() -> None:
    """The V4 layout (d = 512, 64 RoPE channels: 584-byte bf16 rows), window keys only."""
    n, heads, head_dim, rope_dim, window = 3, 2, 512, 64, 16
    fmt, q, kv_pool, window_rows, _extra, _rows, sinks = _coded_inputs(
        3, torch.bfloat16, n, heads, head_dim, rope_dim, window, 1
    )
    assert fmt.width == 584
    layout = fp8_rows(fmt, rope_dim)
    plain_pool = decode_kv(fmt, kv_pool, rope_dim).contiguous()
    for split_rope in (False, True):
        config = triton_kernels.AttentionConfig(block_k=16, fp8_split_rope=split_rope)
        assert triton_kernels.fp8_constexprs(layout, head_dim, config)["SPLIT_ROPE"] == split_rope
        coded = triton_kernels.hybrid_attention_decode(q, kv_pool, window_rows, None, None, sinks,
                                                       config=config, num_splits=1, fp8_rows=layout)
        plain = triton_kernels.hybrid_attention_decode(q, plain_pool, window_rows, None, None, sinks,
                                                       config=config, num_splits=1)
        if split_rope:
            assert _rel_err(coded, plain) < SUMMATION_ORDER[torch.bfloat16]
        else:
            assert torch.equal(coded, plain)
