"""Release-numerics codecs as Triton kernels, one launch each, for the fixed-shape decode step.

Definitions (the tests compare against them, bit for bit):
* `fp8_roundtrip`    `replicas/model/quant.fp8_roundtrip(x, 128)`: activations entering an FP8 / FP4
                     linear; per 128 channels of a row, scale 2^k with k = ceil(log2(max(amax, 1e-4)
                     * fl32(1/448))), values / 2^k rounded to e4m3 (nearest even), times 2^k.
* `indexer_roundtrip` `fp4_roundtrip(hadamard_rotate(x), 32)`: indexer queries, rotated by the
                     normalised Walsh-Hadamard transform, rounded to the model dtype, then e2m1 per 32
                     channels (floor 6 * 2^-126, scale fl32(1/6)).
* `store_fp8_rows`   `kv_rows.encode_kv` written to pool rows: SWA rows and compressed entries.
* `store_fp4_keys`   `kv_rows.encode_index` written to pool rows: indexer keys.

All scale arithmetic is exact: 2^k is built from float32 exponent bits, ceil(log2 v) read from the
bits of v, and e2m1 rounding works on multiples of the value's quantum (exact in float32). The
Hadamard transform runs the reference's butterfly stages in the same order (reshape / split / join
of a register tile), so it rounds identically. Each kernel is one program per row (`store_*`,
`indexer_roundtrip`) or per row and 1024 channels (`fp8_roundtrip`): decode-sized work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from antumbra.kernels.common import host_math
from antumbra.kernels.common.codecs import (
    ACT_BLOCK,
    ACT_BLOCKS_PER_PROGRAM,
    e4m3_round,
    pow2,
    round_half_even,
    rounded_to,
    scale_exponent,
)
from antumbra.kernels.common.interpreter import prepare

from .layout import KEY_SCALE_BLOCK, KV_SCALE_BLOCK, Fp4Keys, Fp8Rows

prepare()


@triton.jit
def _e4m3_codes(r):
    """e4m3 values (float32, from `e4m3_round`) -> their code bytes (uint8): sign (of zeros too,
    as torch's cast keeps it), 4 exponent bits (bias 7; 0 for subnormals), 3 mantissa bits."""
    mag = tl.abs(r)
    bits = mag.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 255) - 127
    normal = (((e + 7) << 3) | ((bits >> 20) & 7))
    sub = (mag * 512.0).to(tl.int32)  # m * 2^-9
    code = tl.where(mag >= 2.0**-6, normal, sub)
    return (code | (r.to(tl.int32, bitcast=True) < 0).to(tl.int32) << 7).to(tl.uint8)


@triton.jit
def _e2m1_steps(scaled):
    """float32 values within +-6 -> (rounded magnitude / quantum, quantum exponent - 1 in 0..2).

    The quantum is 0.5 below 2, 1 up to 4, then 2; rounding is to the nearest multiple, ties to an
    even one (mantissa bit 0)."""
    mag = tl.abs(scaled)
    qsel = (mag >= 2.0).to(tl.int32) + (mag >= 4.0).to(tl.int32)  # quantum 0.5 * 2^qsel
    steps = mag * tl.where(qsel == 0, 2.0, tl.where(qsel == 1, 1.0, 0.5))
    return round_half_even(steps), qsel


@triton.jit
def _e2m1_round(scaled):
    """float32 values within +-6 -> their e2m1 values (float32; zero is +0)."""
    steps, qsel = _e2m1_steps(scaled)
    mag = steps * tl.where(qsel == 0, 0.5, tl.where(qsel == 1, 1.0, 2.0))
    return tl.where(scaled < 0, -mag, mag)


@triton.jit
def _e2m1_codes(scaled):
    """float32 values within +-6 -> 4-bit codes (int32; values that round to zero get code 0)."""
    steps, qsel = _e2m1_steps(scaled)
    code = steps.to(tl.int32) + 2 * qsel  # values 0, .5, .., 2 are codes 0..4; 3, 4 are 5, 6; 6 is 7
    return code | (((scaled < 0) & (code > 0)).to(tl.int32) << 3)


@triton.jit
def _hadamard(x, N: tl.constexpr, LOG2N: tl.constexpr, SCALE: tl.constexpr):
    """[N] float32 -> the normalised Walsh-Hadamard transform, by the reference's butterflies:
    stage h pairs channel i with i + h inside each group of 2h, (a, b) -> (a + b, a - b)."""
    y = x
    # (A `half: tl.constexpr = 1 << s` here compiles under the interpreter only: compiled, a
    # constexpr cannot be reassigned across the unrolled stages.)
    for s in tl.static_range(LOG2N):
        t = tl.permute(tl.reshape(y, [N // (2 << s), 2, 1 << s]), [0, 2, 1])
        a, b = tl.split(t)
        y = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 2, 1]), [N])
    return y * SCALE


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _fp8_roundtrip_kernel(
    x_ptr,  # [M, K] activations, contiguous
    out_ptr,  # [M, K] round-tripped, x's dtype
    K,
    BLOCKS: tl.constexpr,  # 128-channel blocks a program handles
):
    m = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    offs = blk[:, None] * 128 + tl.arange(0, 128)[None, :]
    mask = offs < K
    x = tl.load(x_ptr + m * K + offs, mask=mask, other=0.0).to(tl.float32)
    k = scale_exponent(tl.max(tl.abs(x), 1), 1e-4, 1.0 / 448.0)
    scaled = tl.minimum(tl.maximum(x * pow2(-k)[:, None], -448.0), 448.0)
    q = e4m3_round(scaled) * pow2(k)[:, None]
    tl.store(out_ptr + m * K + offs, q.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _indexer_roundtrip_kernel(
    x_ptr,  # [R, N] rows (each head of each query), contiguous
    out_ptr,  # [R, N] rotated and FP4 round-tripped, x's dtype
    N: tl.constexpr,
    LOG2N: tl.constexpr,
    SCALE: tl.constexpr,  # N^-0.5 (float32)
    BLOCK: tl.constexpr,  # channels a scale: 32, or N when narrower (one partial block)
):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, N)
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + r * N + offs).to(tl.float32)
    rot = rounded_to(_hadamard(x, N, LOG2N, SCALE), dt)  # the reference rounds the rotation
    blocks = tl.reshape(rot, [N // BLOCK, BLOCK])
    k = scale_exponent(tl.max(tl.abs(blocks), 1), 6.0 * 2.0**-126, 1.0 / 6.0)
    scaled = tl.minimum(tl.maximum(blocks * pow2(-k)[:, None], -6.0), 6.0)
    q = _e2m1_round(scaled) * pow2(k)[:, None]
    tl.store(out_ptr + r * N + offs, tl.reshape(q, [N]).to(dt))


@triton.jit
def encode_fp8_row(
    x_ptr,  # pointer to one value row [D] (RoPE applied), the model dtype
    base,  # pointer to its pool row [WIDTH] uint8
    D: tl.constexpr,
    NOPE: tl.constexpr,
    NB: tl.constexpr,  # exponent bytes (64-channel blocks, the last may be partial)
    NB_PAD: tl.constexpr,  # next power of two of NB
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    ROPE_AT: tl.constexpr,
    WIDTH: tl.constexpr,
    PAD: tl.constexpr,  # power of two >= the longest zero gap of a row
):
    """One row of `encode_kv`, written; shared by the store kernel and the compressor's fused store."""
    offs = tl.arange(0, NB_PAD)[:, None] * 64 + tl.arange(0, 64)[None, :]
    mask = offs < NOPE
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    k = scale_exponent(tl.max(tl.abs(x), 1), 1e-4, 1.0 / 448.0)
    scaled = tl.minimum(tl.maximum(x * pow2(-k)[:, None], -448.0), 448.0)
    codes = _e4m3_codes(e4m3_round(scaled))
    tl.store(base + offs, codes, mask=mask)
    blocks = tl.arange(0, NB_PAD)
    exp_bytes = (tl.minimum(tl.maximum(k, -127), 127) + 127).to(tl.uint8)
    tl.store(base + NOPE + blocks, exp_bytes, mask=blocks < NB)
    offs_r = tl.arange(0, ROPE_PAD)
    rope = tl.load(x_ptr + NOPE + offs_r, mask=offs_r < ROPE)
    rope_ptr = (base + ROPE_AT).to(tl.pointer_type(x_ptr.dtype.element_ty), bitcast=True)
    tl.store(rope_ptr + offs_r, rope, mask=offs_r < ROPE)
    # The zero padding between the exponents and the RoPE channels, and after them.
    gap = tl.arange(0, PAD)
    zeros = tl.zeros([PAD], tl.uint8)
    tl.store(base + NOPE + NB + gap, zeros, mask=NOPE + NB + gap < ROPE_AT)
    rope_end: tl.constexpr = ROPE_AT + ROPE * x_ptr.dtype.element_ty.primitive_bitwidth // 8
    tl.store(base + rope_end + gap, zeros, mask=rope_end + gap < WIDTH)


@triton.jit
def encode_fp4_key(
    x_ptr,  # pointer to one indexer key [N] (RoPE applied, not rotated), the model dtype
    base,  # pointer to its pool row [WIDTH] uint8
    N: tl.constexpr,
    LOG2N: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK: tl.constexpr,  # channels a scale: 32, or N when narrower (one partial block)
    NB: tl.constexpr,  # exponent bytes: N / BLOCK
    WIDTH: tl.constexpr,
    PAD: tl.constexpr,  # power of two >= the zero padding after the exponents
):
    """One key of `encode_index`, written; shared by the store kernel and the compressor's fused store."""
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs).to(tl.float32)
    rot = rounded_to(_hadamard(x, N, LOG2N, SCALE), x_ptr.dtype.element_ty)
    blocks = tl.reshape(rot, [NB, BLOCK])
    k = scale_exponent(tl.max(tl.abs(blocks), 1), 6.0 * 2.0**-126, 1.0 / 6.0)
    scaled = tl.minimum(tl.maximum(blocks * pow2(-k)[:, None], -6.0), 6.0)
    codes = tl.reshape(_e2m1_codes(scaled), [N // 2, 2])
    low, high = tl.split(codes)
    tl.store(base + tl.arange(0, N // 2), (low | (high << 4)).to(tl.uint8))
    exp_bytes = (tl.minimum(tl.maximum(k, -127), 127) + 127).to(tl.uint8)
    tl.store(base + N // 2 + tl.arange(0, NB), exp_bytes)
    gap = tl.arange(0, PAD)
    tl.store(base + N // 2 + NB + gap, tl.zeros([PAD], tl.uint8), mask=N // 2 + NB + gap < WIDTH)


@triton.jit
def _store_fp8_rows_kernel(
    x_ptr,  # [E, D] values (RoPE applied), contiguous, the model dtype
    pool_ptr,  # [R, WIDTH] uint8 pool rows
    rows_ptr,  # [E] int64 pool row of each value row
    D: tl.constexpr,
    NOPE: tl.constexpr,
    NB: tl.constexpr,
    NB_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    ROPE_AT: tl.constexpr,
    WIDTH: tl.constexpr,
    PAD: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + e).to(tl.int64)
    encode_fp8_row(x_ptr + e * D, pool_ptr + row * WIDTH, D, NOPE, NB, NB_PAD, ROPE, ROPE_PAD, ROPE_AT,
                   WIDTH, PAD)


@triton.jit
def _store_fp4_keys_kernel(
    x_ptr,  # [E, N] indexer keys (RoPE applied, not rotated), contiguous, the model dtype
    pool_ptr,  # [R, WIDTH] uint8 pool rows
    rows_ptr,  # [E] int64 pool row of each key
    N: tl.constexpr,
    LOG2N: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    NB: tl.constexpr,
    WIDTH: tl.constexpr,
    PAD: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + e).to(tl.int64)
    encode_fp4_key(x_ptr + e * N, pool_ptr + row * WIDTH, N, LOG2N, SCALE, BLOCK, NB, WIDTH, PAD)


# ----------------------------------------------------------------------------- host side


def fp8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """x: [..., K] float (bf16 / fp32) -> the same shape and dtype, FP8 round-tripped per 128 channels."""
    flat = x.contiguous().view(-1, x.shape[-1]) if x.numel() else x.reshape(-1, max(x.shape[-1], 1))
    out = torch.empty_like(flat)
    rows, k = flat.shape
    if rows and k:
        grid = (rows, host_math.cdiv(host_math.cdiv(k, ACT_BLOCK), ACT_BLOCKS_PER_PROGRAM))
        _fp8_roundtrip_kernel[grid](flat, out, k, BLOCKS=ACT_BLOCKS_PER_PROGRAM, num_warps=4)
    return out.view(x.shape)


def _hadamard_consts(n: int) -> dict:
    assert n >= 2 and n & (n - 1) == 0, f"the rotated width must be a power of two, got {n}"
    return dict(N=n, LOG2N=n.bit_length() - 1, SCALE=n**-0.5, BLOCK=min(n, KEY_SCALE_BLOCK))


def indexer_roundtrip(q: torch.Tensor) -> torch.Tensor:
    """q: [..., n] float (n a power of two) -> rotated and FP4 round-tripped, same shape and dtype."""
    n = q.shape[-1]
    flat = q.contiguous().view(-1, n)
    out = torch.empty_like(flat)
    if flat.shape[0]:
        _indexer_roundtrip_kernel[(flat.shape[0],)](flat, out, **_hadamard_consts(n), num_warps=1)
    return out.view(q.shape)


def fp8_row_constexprs(layout: Fp8Rows, dtype: torch.dtype) -> dict[str, int]:
    """`encode_fp8_row`'s constexprs for `layout`'s rows of RoPE channels in `dtype`."""
    nb = -(-layout.nope // KV_SCALE_BLOCK)
    rope_end = layout.rope_at + layout.rope_dim * dtype.itemsize
    gap = max(layout.rope_at - layout.nope - nb, layout.width - rope_end, 1)
    return dict(D=layout.head_dim, NOPE=layout.nope, NB=nb, NB_PAD=host_math.next_power_of_2(nb),
                ROPE=layout.rope_dim, ROPE_PAD=host_math.next_power_of_2(layout.rope_dim),
                ROPE_AT=layout.rope_at, WIDTH=layout.width, PAD=host_math.next_power_of_2(gap))


def fp4_key_constexprs(layout: Fp4Keys) -> dict[str, int | float]:
    """`encode_fp4_key`'s constexprs for `layout`'s keys."""
    n = layout.head_dim
    nb = -(-n // KEY_SCALE_BLOCK)
    gap = max(layout.width - n // 2 - nb, 1)
    return dict(**_hadamard_consts(n), NB=nb, WIDTH=layout.width, PAD=host_math.next_power_of_2(gap))


def store_fp8_rows(values: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor, layout: Fp8Rows) -> None:
    """values: [E, d] (RoPE applied, model dtype); pool: [R, layout.width] uint8; rows: [E] int64
    -> pool[rows[e]] = encode_kv(values[e]) (rows in the padded tail of a fixed-shape step point at a
    scratch row)."""
    e, d = values.shape
    assert d == layout.head_dim and pool.dtype == torch.uint8 and pool.shape[1] == layout.width
    assert pool.is_contiguous() and rows.shape == (e,) and rows.device == pool.device == values.device
    if e == 0:
        return
    _store_fp8_rows_kernel[(e,)](values.contiguous(), pool, rows.to(torch.int64).contiguous(),
                                 **fp8_row_constexprs(layout, values.dtype), num_warps=2)


def store_fp4_keys(values: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor, layout: Fp4Keys) -> None:
    """values: [E, n] indexer keys (RoPE applied, not rotated; model dtype); pool: [R, layout.width]
    uint8; rows: [E] int64 -> pool[rows[e]] = encode_index(values[e])."""
    e, n = values.shape
    assert n == layout.head_dim and pool.dtype == torch.uint8 and pool.shape[1] == layout.width
    assert pool.is_contiguous() and rows.shape == (e,) and rows.device == pool.device == values.device
    if e == 0:
        return
    _store_fp4_keys_kernel[(e,)](values.contiguous(), pool, rows.to(torch.int64).contiguous(),
                                 **fp4_key_constexprs(layout), num_warps=1)
