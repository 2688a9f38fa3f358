"""FP8-block weight -> a dense bf16 / fp16 / float32 copy, in one launch (see `reference.py`).

At prefill sizes `fp8_linear` expands the weight once and hands the product to cuBLAS
(`dense_linear`): the Triton GEMM's in-loop decode keeps it well below the bf16 tensor-core rate,
while this pass costs one read of the e4m3 bytes and one write of the wider copy (3 bytes per weight
for bf16; against the 2T flops per weight of a T-token GEMM, about 15% of its time at 2048 tokens on
an H200 if the pass runs at the copy bandwidth).

Each program writes a `[block_n, block_k]` tile, loaded as `[block_n, groups, group_k]`: `group_k =
min(block_k, 128)` columns share one scale, so the scales are a `[groups]` vector broadcast over the
rows and columns of its group, never a per-element gather. `block_n` divides 128, so all rows of a
tile share one row of scales. N and K need not be multiples of 128 (or of the tile): rows and
columns past the end are masked.

Exactness: an e4m3 value has 4 significant bits (3 stored mantissa bits) and the scale 2^(s - 127)
is a power of two, so the float32 product is exact, and so is its bf16 rounding (8 significant
bits, float32's exponent range) for every exponent byte from 3 (e4m3's smallest subnormal 2^-9
times 2^-124 is bf16's smallest subnormal 2^-133) to 246 (448 times 2^119 is below bf16's largest).
Outside that range too the kernel rounds the same float32 product the reference rounds, to nearest
even, so the two agree bit for bit. fp16 has 5 exponent bits: below a scale of 2^-15 the smallest
e4m3 values fall under its subnormal step 2^-24 and lose bits (and past 2^7 the largest overflow),
so fp16 activations stay on the Triton GEMM, which scales each step's float32 product instead.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from antumbra.kernels.common import host_math
from antumbra.kernels.common.codecs import e8m0_to_f32
from antumbra.kernels.common.interpreter import prepare

from .reference import FP8_BLOCK

prepare()

_FP8_BLOCK = tl.constexpr(FP8_BLOCK)


@dataclass(frozen=True)
class Fp8DequantConfig:
    """Tile of one dequantisation program (and, passed to `fp8_linear`, a request for its dense path)."""

    block_n: int = 16  # weight rows per program: a power of two dividing 128
    block_k: int = 256  # columns per program: a power of two, at least 16 (16-byte e4m3 vectors)
    num_warps: int = 8


# The best of DEQUANT_SWEEP on an H200, by a hair over 32 x 256 at 4 warps (TUNING.md).
DEQUANT_CONFIG = Fp8DequantConfig()
# Tiles a benchmark compares (benchmarks/kernels/dequant.py); the tests run each one.
DEQUANT_SWEEP: tuple[Fp8DequantConfig, ...] = tuple(
    Fp8DequantConfig(block_n=rows, block_k=cols, num_warps=warps)
    for rows, cols, warps in itertools.product((16, 32, 64), (128, 256, 512), (4, 8))
)


@triton.jit
def _dequant_fp8_kernel(
    w_ptr,  # *e4m3 [N, K] weight, contiguous
    s_ptr,  # *u8 [ceil(N/128), ceil(K/128)] exponents, contiguous
    out_ptr,  # out: *T [N, K], contiguous
    N,
    K,
    BLOCK_N: tl.constexpr,  # divides 128: one row of scales per tile
    GROUPS: tl.constexpr,  # column groups per tile
    GROUP_K: tl.constexpr,  # columns per group: min(block_k, 128), inside one scale block
):
    # Column tiles on the fast grid axis: neighbouring programs finish whole rows together.
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    starts = pid_k * (GROUPS * GROUP_K) + tl.arange(0, GROUPS) * GROUP_K  # first column of each group
    cols = starts[:, None] + tl.arange(0, GROUP_K)[None, :]  # [GROUPS, GROUP_K]
    offs = rows.to(tl.int64)[:, None, None] * K + cols[None, :, :]
    mask = (rows < N)[:, None, None] & (cols < K)[None, :, :]
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    # Groups past K read the row's last scale: the loads stay inside the scale tensor.
    s_row = s_ptr + (pid_n * BLOCK_N // _FP8_BLOCK) * tl.cdiv(K, _FP8_BLOCK)
    scale = e8m0_to_f32(tl.load(s_row + tl.minimum(starts, K - 1) // _FP8_BLOCK))
    values = w.to(tl.float32) * scale[None, :, None]
    tl.store(out_ptr + offs, values.to(out_ptr.dtype.element_ty), mask=mask)


def _check_config(config: Fp8DequantConfig) -> None:
    pow2 = host_math.next_power_of_2
    assert pow2(config.block_n) == config.block_n and FP8_BLOCK % config.block_n == 0, config
    assert pow2(config.block_k) == config.block_k and config.block_k >= 16, config


def dequant_constexprs(config: Fp8DequantConfig) -> dict[str, Any]:
    """Constexprs and launch options of `_dequant_fp8_kernel` under `config`: none follow the call."""
    group_k = min(config.block_k, FP8_BLOCK)
    return dict(BLOCK_N=config.block_n, GROUPS=config.block_k // group_k, GROUP_K=group_k,
                num_warps=config.num_warps)


def dequant_fp8_into(
    out: Tensor, weight: Tensor, scale: Tensor, config: Fp8DequantConfig | None = None
) -> Tensor:
    """Write weight * 2^(scale - 127) per 128 x 128 block into `out`, as `dequant_fp8_weight`; -> out.

    out: [N, K] bf16 / fp16 / float32, contiguous (fp16: exact only for scales of 2^-15 .. 2^7).
    weight: [N, K] float8_e4m3fn, contiguous.
    scale: [ceil(N/128), ceil(K/128)] float8_e8m0fnu or uint8 exponent bytes, contiguous.
    One launch; reads nothing back from the device (capturable in a CUDA graph).
    """
    config = config or DEQUANT_CONFIG
    _check_config(config)
    n, k = weight.shape
    assert weight.dtype == torch.float8_e4m3fn and weight.is_contiguous(), weight.dtype
    assert out.shape == (n, k) and out.is_contiguous(), out.shape
    assert out.dtype in (torch.bfloat16, torch.float16, torch.float32), out.dtype
    assert scale.dtype in (torch.float8_e8m0fnu, torch.uint8), scale.dtype
    assert scale.shape == (host_math.cdiv(n, FP8_BLOCK), host_math.cdiv(k, FP8_BLOCK))
    assert scale.is_contiguous()
    if n == 0 or k == 0:
        return out
    grid = (host_math.cdiv(k, config.block_k), host_math.cdiv(n, config.block_n))
    _dequant_fp8_kernel[grid](weight, scale.view(torch.uint8), out, n, k, **dequant_constexprs(config))
    return out
