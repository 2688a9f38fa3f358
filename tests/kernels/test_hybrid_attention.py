"""Hybrid sparse attention: Triton kernels (CPU interpreter) vs reference, reference vs model.

Shapes are tiny and irregular (odd batch, a row at sequence start with few window
keys, a row with no compressed key, a row with no key at all, duplicate rows); outputs
and split-K scratch are poisoned with NaN so any element left unwritten fails.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from torch import nn

import antumbra.kernels.hybrid_attention.triton as triton_kernels  # noqa: E402
from antumbra.kernels.hybrid_attention.reference import hybrid_attention_reference
from antumbra.replicas.model.attention import Attention

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


def _rows(gen: torch.Generator, n: int, width: int, pool_rows: int) -> torch.Tensor:
    return torch.randint(0, pool_rows, (n, width), generator=gen, dtype=torch.int32)


def _decode_inputs(seed: int, dtype: torch.dtype, n: int, heads: int, head_dim: int, window: int, extra: int):
    """Random pools and row lists with the irregular cases a batch really holds."""
    gen = torch.Generator().manual_seed(seed)
    pool_rows, extra_rows_n = 3 * n * window, 2 * n * extra + 1
    q = torch.randn(n, heads, head_dim, generator=gen).to(dtype)
    kv_pool = torch.randn(pool_rows, head_dim, generator=gen).to(dtype)
    extra_pool = torch.randn(extra_rows_n, head_dim, generator=gen).to(dtype)
    window_rows = _rows(gen, n, window, pool_rows)
    extra_rows = _rows(gen, n, extra, extra_rows_n)
    sinks = torch.randn(heads, generator=gen)
    window_rows[0, : window - 5] = -1  # sequence start: only the last 5 window keys exist
    extra_rows[1] = -1  # no compressed entry yet
    extra_rows[2, extra // 2 :] = -1  # fewer than K selected
    extra_rows[2, 1] = extra_rows[2, 0]  # the same row twice
    if n > 3:
        window_rows[3] = -1  # no key at all: only the sink, output 0
        extra_rows[3] = -1
    return q, kv_pool, window_rows, extra_pool, extra_rows, sinks


CONFIGS = [
    # (config, splits): whole head_dim resident with split-K + combine; one split (finished in place);
    # head_dim in chunks for q.k and for the output columns.
    pytest.param(triton_kernels.AttentionConfig(block_k=16), 2, id="resident-2split"),
    pytest.param(triton_kernels.AttentionConfig(block_k=16), 1, id="resident-1split"),
    pytest.param(triton_kernels.AttentionConfig(block_k=16, block_d=16, block_dv=16), 3, id="chunked-3split"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("config", "splits"), CONFIGS)
def test_decode_matches_reference(dtype: torch.dtype, config, splits) -> None:
    n, heads, head_dim, window, extra = 5, 4, 32, 16, 24
    seed = zlib.crc32(f"{dtype}-{config}-{splits}".encode())  # fresh inputs per case, reproducible
    q, kv_pool, window_rows, extra_pool, extra_rows, sinks = _decode_inputs(
        seed, dtype, n, heads, head_dim, window, extra
    )
    out = torch.full_like(q, float("nan"))
    num_blocks = 1 + 2  # 16 window keys and 24 extras in blocks of 16
    workspace = triton_kernels.AttentionWorkspace.empty(n, num_blocks, heads, head_dim, "cpu")
    workspace.acc.fill_(float("nan"))
    workspace.ml.fill_(float("nan"))
    triton_kernels.hybrid_attention_decode(
        q, kv_pool, window_rows, extra_pool, extra_rows, sinks,
        out=out, num_splits=splits, config=config, workspace=workspace,
    )
    ref = hybrid_attention_reference(q, kv_pool, window_rows, extra_pool, extra_rows, sinks)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < TOLERANCE[dtype]
    assert torch.equal(out[3].float(), torch.zeros_like(out[3].float()))  # sink only


@pytest.mark.parametrize("config", [triton_kernels.AttentionConfig(block_k=16),
                                    triton_kernels.AttentionConfig(block_k=16, lazy_rescale=True,
                                                                   rescale_threshold=1.0)],
                         ids=["eager-rescale", "lazy-rescale"])
def test_decode_default_workspace_bf16_partials(config) -> None:
    """No workspace passed: the kernel allocates partials in the query dtype (bf16), and the
    merge still matches; lazy rescaling (a low threshold so that both branches run) too."""
    n, heads, head_dim, window, extra = 4, 4, 32, 16, 48
    q, kv_pool, window_rows, extra_pool, extra_rows, sinks = _decode_inputs(
        zlib.crc32(str(config).encode()), torch.bfloat16, n, heads, head_dim, window, extra
    )
    q = q * 4  # sharper softmax: the running max moves between blocks
    out = torch.full_like(q, float("nan"))
    triton_kernels.hybrid_attention_decode(
        q, kv_pool, window_rows, extra_pool, extra_rows, sinks, out=out, num_splits=2, config=config
    )
    ref = hybrid_attention_reference(q, kv_pool, window_rows, extra_pool, extra_rows, sinks)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < TOLERANCE[torch.bfloat16]


def test_decode_many_splits_combine_in_chunks() -> None:
    """More splits than the combine kernel loads at once (COMBINE_SPLITS): the merge walks them in
    chunks, the last one partial."""
    n, heads, head_dim, window, extra = 3, 4, 32, 16, 16 * 20
    q, kv_pool, window_rows, extra_pool, extra_rows, sinks = _decode_inputs(
        23, torch.float32, n, heads, head_dim, window, extra
    )
    splits = 21  # one 16-key block each: the window's and twenty of extras
    assert splits > triton_kernels.COMBINE_SPLITS
    out = torch.full_like(q, float("nan"))
    workspace = triton_kernels.AttentionWorkspace.empty(n, splits, heads, head_dim, "cpu")
    workspace.acc.fill_(float("nan"))
    workspace.ml.fill_(float("nan"))
    triton_kernels.hybrid_attention_decode(
        q, kv_pool, window_rows, extra_pool, extra_rows, sinks, out=out, num_splits=splits,
        config=triton_kernels.AttentionConfig(block_k=16), workspace=workspace,
    )
    ref = hybrid_attention_reference(q, kv_pool, window_rows, extra_pool, extra_rows, sinks)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("with_extra", [True, False], ids=["swa+c128", "swa-only"])
def test_prefill_matches_reference(with_extra: bool) -> None:
    """T tokens of two sequences: sliding windows over contiguous SWA rows, and every causal
    C128-style entry of its sequence as extras (fewer for earlier tokens)."""
    gen = torch.Generator().manual_seed(7 + with_extra)
    heads, head_dim, window, rate = 4, 64, 16, 4
    lengths, starts = [5, 4], [30, 0]  # tokens in this step; positions they start at
    kv_pool = torch.randn(96, head_dim, generator=gen)
    extra_pool = torch.randn(20, head_dim, generator=gen)
    sinks = torch.randn(heads, generator=gen)
    win, ext = [], []
    for seq, (count, start) in enumerate(zip(lengths, starts, strict=True)):
        base = 40 * seq  # SWA rows of the sequence: base + position
        for pos in range(start, start + count):
            keys = torch.arange(pos - window + 1, pos + 1)
            win.append(torch.where(keys >= 0, base + keys, -1))
            entries = torch.arange(10)  # entry w usable once (pos + 1) // rate > w
            ext.append(torch.where(entries < (pos + 1) // rate, 10 * seq + entries, -1))
    window_rows = torch.stack(win).to(torch.int32)
    extra_rows = torch.stack(ext).to(torch.int32) if with_extra else None
    q = torch.randn(window_rows.shape[0], heads, head_dim, generator=gen)
    out = torch.full_like(q, float("nan"))
    triton_kernels.hybrid_attention_prefill(
        q, kv_pool, window_rows, extra_pool if with_extra else None, extra_rows, sinks, out=out,
        config=triton_kernels.AttentionConfig(block_k=16),
    )
    ref = hybrid_attention_reference(q, kv_pool, window_rows, extra_pool, extra_rows, sinks)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_matches_model_attend(dtype: torch.dtype) -> None:
    """The reference over gathered pool rows is the model's `Attention._attend` on the same keys."""
    n, heads, head_dim, window, extra = 5, 4, 32, 16, 24
    q, kv_pool, window_rows, extra_pool, extra_rows, sinks = _decode_inputs(
        11, dtype, n, heads, head_dim, window, extra
    )
    model = Attention.__new__(Attention)  # only the softmax path: no projections needed
    nn.Module.__init__(model)
    model.head_dim = head_dim
    model.sinks = nn.Parameter(sinks)
    keys = [kv_pool[window_rows.clamp(min=0).long()], extra_pool[extra_rows.clamp(min=0).long()]]
    valid = [window_rows >= 0, extra_rows >= 0]
    with torch.no_grad():
        model_out = model._attend(q, keys, valid)
    ref = hybrid_attention_reference(q, kv_pool, window_rows, extra_pool, extra_rows, sinks, upcast=False)
    assert _rel_err(ref, model_out) < (1e-6 if dtype == torch.float32 else 1e-2)
    upcast = hybrid_attention_reference(q, kv_pool, window_rows, extra_pool, extra_rows, sinks)
    assert _rel_err(upcast, model_out) < TOLERANCE[dtype]
