"""Linears of a few tokens on full-width weights, one launch (see `gemv_into_reference`).

At decode sizes the model's small bf16 projections (the window compressors' kv and gate, the
router's gate, the indexer's head weights) cost cuBLAS a split-K GEMM and a reduce launch each,
and the compressors a third launch to store the results into their state rows: a dozen launches a
layer, each longer than the bytes it reads. Here one launch covers up to two weights that read the
same input and writes each result where it goes.

Program (t, n, s): token t, output tile n of `block_n` rows of the concatenated weights (the first
weight's tiles, then the second's: a tile never straddles them), K slice s. Each step loads a
`[block_n, block_k]` tile of the weight and multiply-adds it with the step's activations into a
float32 `[block_n, block_k]` accumulator on the CUDA cores; the rows are summed once, after the loop.
Several K slices finish in the tile's last program to arrive (`common.arrivals.store_split_tile`:
ordered sum, no second launch, no fill). The epilogue rounds the sum to the input's dtype (what
`nn.Linear` returns), widens it, multiplies by `scale` and stores it in the output's dtype at the
token's output row (`rows[t]`, or t).

Each token re-reads the weight (from L2 after the first), so the launch pays off only at a few
tokens: callers ask `takes_gemv`, which follows `GEMV_MAX_TOKENS`. Allocations are `torch.empty` of
sizes fixed by the shapes and the launch reads nothing from the device: calls can be captured in
CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from antumbra.kernels.common import host_math
from antumbra.kernels.common.arrivals import arrival_counters, store_split_tile, tile_slots
from antumbra.kernels.common.device import multiprocessor_count
from antumbra.kernels.common.interpreter import prepare

prepare()

# The most tokens a call takes the GEMV at (`takes_gemv`); past it cuBLAS reads each weight once
# for all tokens. `benchmarks/kernels/gemv.py` times both sides of the threshold.
GEMV_MAX_TOKENS = 1
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape of one call."""

    block_n: int = 16  # weight rows per program: a power of two
    block_k: int = 512  # reduction columns per step: a power of two
    num_warps: int = 4
    num_stages: int = 3  # software-pipeline depth of the reduction loop
    split_k: int = 0  # K slices; 0 = chosen from the shape (`host_math.split_k_slices`)
    programs_per_sm: int = 2
    min_split_cols: int = 512


GEMV_CONFIG = GemvConfig()


def takes_gemv(x: Tensor, *weights: Tensor) -> bool:
    """Does a model call on x [T, K] with these weights take `gemv_into` (CUDA, at most
    GEMV_MAX_TOKENS rows, one float dtype throughout, contiguous weights, no autograd)?"""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] <= GEMV_MAX_TOKENS and x.dtype in DTYPES
            and x.stride(-1) == 1
            and not (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)))
            and all(w.dtype == x.dtype and w.is_contiguous() for w in weights))


def gemv_plan(num_tokens: int, widths: Sequence[int], k: int, num_sms: int,
              config: GemvConfig | None = None) -> tuple[GemvConfig, int]:
    """-> (launch shape, K slices) of a call of T tokens on weights of these output widths."""
    config = config or GEMV_CONFIG
    tiles = num_tokens * sum(host_math.cdiv(n, config.block_n) for n in widths)
    return config, host_math.split_k_slices(tiles, k, config.block_k, num_sms, config.programs_per_sm,
                                            config.min_split_cols, config.split_k)


def gemv_constexprs(config: GemvConfig, has_rows: bool) -> dict[str, Any]:
    """Constexprs and launch options of a launch at `config`, with or without output rows."""
    return dict(BLOCK_N=config.block_n, BLOCK_K=config.block_k, STAGES=config.num_stages, HAS_ROWS=has_rows,
                num_warps=config.num_warps)


# The token count and the steps per K slice follow the call, so they are not specialised (they only
# bound masks and loops); the widths keep their divisibility hints.
@triton.jit(do_not_specialize=["num_tokens", "k_steps"])
def _gemv_rows_kernel(
    x_ptr,  # *T [T, K] activations, unit stride along K
    w1_ptr,  # *T [N1, K] first weight, contiguous
    w2_ptr,  # *T [N2, K] second weight, contiguous (the first again when N2 = 0)
    out1_ptr,  # out: [R1, N1] contiguous, any float dtype
    out2_ptr,  # out: [R2, N2] contiguous, out1's dtype (out1 again when N2 = 0)
    rows_ptr,  # *int [T] output rows (read when HAS_ROWS)
    part_ptr,  # out: *f32 [SPLIT, T, tiles * BLOCK_N] partial sums (written with several slices)
    count_ptr,  # *i32 [T * tiles] arrival counters, zero, left zero (with several slices)
    num_tokens,
    N1,
    N2,
    K,
    stride_x,  # elements between activation rows
    k_steps,  # BLOCK_K steps per K slice
    scale,  # float32 factor on the rounded sum
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,  # its loads feed no tl.dot, so the kernel-wide num_stages would not apply
    HAS_ROWS: tl.constexpr,
):
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    tiles1 = tl.cdiv(N1, BLOCK_N)
    if pid_n < tiles1:
        w_ptr = w1_ptr
        out_ptr = out1_ptr
        n = N1
        n0 = pid_n * BLOCK_N
    else:
        w_ptr = w2_ptr
        out_ptr = out2_ptr
        n = N2
        n0 = (pid_n - tiles1) * BLOCK_N
    cols_n = n0 + tl.arange(0, BLOCK_N)
    row_ok = cols_n < n
    w_rows = w_ptr + cols_n.to(tl.int64)[:, None] * K
    x_row = x_ptr + t.to(tl.int64) * stride_x
    k_first = split * k_steps * BLOCK_K
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for i in tl.range(0, k_steps, num_stages=STAGES):
        cols = k_first + i * BLOCK_K + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        x = tl.load(x_row + cols, mask=col_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_ROWS:
        row = tl.load(rows_ptr + t).to(tl.int64)
    else:
        row = t.to(tl.int64)
    slots, slice_stride = tile_slots(t, pid_n, num_tokens, BLOCK_N)
    # Rounded to the input's dtype, as `nn.Linear` returns it, then widened and scaled.
    store_split_tile(y, out_ptr + row * n + cols_n, part_ptr + slots, row_ok, slice_stride,
                     count_ptr + t * tl.num_programs(1) + pid_n, x_ptr.dtype.element_ty, scale)


def _check(x: Tensor, weights: Sequence[Tensor], outs: Sequence[Tensor], rows: Tensor | None) -> None:
    assert x.dim() == 2 and x.dtype in DTYPES and x.stride(-1) == 1, (
        f"x must be [T, K] {DTYPES} with unit stride along K, got {tuple(x.shape)} {x.dtype}")
    assert 1 <= len(weights) <= 2 and len(outs) == len(weights), "one or two weights, one output each"
    for w, out in zip(weights, outs, strict=True):
        assert w.dim() == 2 and w.shape[1] == x.shape[1] and w.dtype == x.dtype and w.is_contiguous(), (
            f"weights must be [N, {x.shape[1]}] {x.dtype} contiguous, got {tuple(w.shape)} {w.dtype}")
        assert out.dim() == 2 and out.shape[1] == w.shape[0] and out.is_contiguous(), (
            f"outputs must be [R, {w.shape[0]}] contiguous, got {tuple(out.shape)}")
        assert out.dtype == outs[0].dtype and out.device == x.device == w.device
        if rows is None:
            assert out.shape[0] >= x.shape[0], "without rows an output needs a row per token"
    if rows is not None:
        assert rows.shape == (x.shape[0],) and not rows.is_floating_point(), "rows must be [T] integers"


def gemv_into(x: Tensor, weights: Sequence[Tensor], outs: Sequence[Tensor], rows: Tensor | None = None,
              scale: float = 1.0, config: GemvConfig | None = None) -> None:
    """As `gemv_into_reference`, one launch: x [T, K] bf16 / fp16 / fp32 (unit stride along K); one or
    two weights [N_i, K] of x's dtype, contiguous; outs [R_i, N_i] contiguous, one dtype; rows [T]
    integer output rows (None: row t). Padded rows may repeat a row: which write lands there is
    unspecified, as with an indexed store."""
    _check(x, weights, outs, rows)
    num_tokens, k = x.shape
    widths = [w.shape[0] for w in weights]
    if num_tokens == 0 or sum(widths) == 0:
        return
    config, split = gemv_plan(num_tokens, widths, k, multiprocessor_count(x.device), config)
    tiles = sum(host_math.cdiv(n, config.block_n) for n in widths)
    w2, out2, n2 = (weights[1], outs[1], widths[1]) if len(weights) == 2 else (weights[0], outs[0], 0)
    # With one slice neither is touched, but both keep their types (int32 counters, float32 partials):
    # the compiler types the untaken split-K branch too.
    counters = arrival_counters(x.device, num_tokens * tiles if split > 1 else 1)
    partial = (torch.empty(split, num_tokens, tiles * config.block_n, dtype=torch.float32, device=x.device)
               if split > 1 else counters.view(torch.float32))
    k_steps = host_math.cdiv(host_math.cdiv(k, config.block_k), split)
    stride_x = x.stride(0) if num_tokens > 1 else k  # a single row's stride is never used
    _gemv_rows_kernel[(num_tokens, tiles, split)](
        x, weights[0], w2, outs[0], out2, x if rows is None else rows, partial, counters,
        num_tokens, widths[0], n2, k, stride_x, k_steps, float(scale),
        **gemv_constexprs(config, rows is not None),
    )


def gemv(x: Tensor, weight: Tensor, scale: float = 1.0, out_dtype: torch.dtype | None = None,
         config: GemvConfig | None = None) -> Tensor:
    """x [..., K] @ weight [N, K]^T, rounded to x's dtype, times `scale` -> [..., N] in `out_dtype`
    (default x's dtype): `nn.Linear` without bias, one launch."""
    *lead, k = x.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=out_dtype or x.dtype, device=x.device)
    gemv_into(x2, (weight,), (out,), scale=scale, config=config)
    return out.view(*lead, weight.shape[0])
