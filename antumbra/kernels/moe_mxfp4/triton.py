"""Grouped MXFP4 expert GEMMs for the routed MoE (see `reference.py` for the math and weight layout).

Two launches and a reduction:

1. `_moe_up_kernel`: for a block of (token, expert) pairs that share one expert and a tile of
   `BLOCK_N` intermediate rows, `g = x @ w1^T`, `u = x @ w3^T`, then the epilogue
   `h = silu(min(g, L)) * clamp(u, -L, L) * routing_weight` (as the official code, the routing
   weight is applied before w2). h is written in the activation dtype, one row per pair.
2. `_moe_down_kernel`: `y = h @ w2^T` for a tile of `BLOCK_N` hidden channels, written per pair.
3. `y.view(T, k, D).sum(1)` (torch, float32 accumulation): each token's k expert outputs; given the
   shared expert's output (`addend`), `slots.sum_slots` sums and adds it in one launch instead.
With `MoeTiles.sum_slots` (decode only) the down kernel instead walks a token's k experts itself and
writes the token's row, which drops step 3 (slower at batch 1 on an H200: k times fewer programs).

Weights stay packed in memory. Each step a program loads a `[BLOCK_N, BLOCK_KB]` tile of packed
bytes (2 * BLOCK_KB reduction elements; rows are contiguous, so loads coalesce) and the matching
`[BLOCK_N, BLOCK_KB / 16]` exponent bytes, and decodes in registers: the low nibbles are the even
reduction columns, the high nibbles the odd ones. Rather than interleaving them back, the even and
odd activation columns are loaded separately (stride-2 pointers into a small, cache-resident tile)
and both products are summed. Two decoders give the same values:
* on the GPU, a few lines of PTX (`_E2M1_PTX`) that turn 4 packed bytes at once into e4m3 bit
  patterns and let the hardware convert those (the instruction count of the decode is what bounds
  the batch-1 GEMV, not the arithmetic);
* everywhere (and the only one the CPU interpreter can run), plain Triton: a nibble becomes a
  float16 bit pattern (sign to bit 15, exponent and mantissa to bits 9..11), the e2m1 value times
  2^-14 for every code, subnormal 0.5 included.
Either power-of-two offset is folded into the group scale `2^(s - 127)` built from the exponent byte.

Work decomposition (the grid is (blocks of pairs, output tiles)):
* decode (`block_t == 1`): one program per (pair, output tile), no sorting. Every selected expert's
  weights are read once per token that picked it, spread over I / BLOCK_N (resp. D / BLOCK_N)
  programs. The products run on the CUDA cores: summed within each 32-weight group in registers,
  scaled once per group, and reduced across threads once after the loop. The reduction loop is
  software-pipelined explicitly (`tl.range(num_stages=...)`: its loads feed no `tl.dot`, so the
  kernel-wide `num_stages` would not apply), so the next weight tiles stream into shared memory
  while the current ones are decoded. With 16-bit activations the products run in f16x2
  (`_E2M1_HFMA_PTX`: weights and activations two per register, 4 products summed per lane before a
  float32 accumulate), about 2.6 instructions per weight against 4.2 for the float32 path.
  The packed weight tiles load as 16-byte async copies (the int32 view carries the alignment hint),
  and the f16x2 activation operands come pre-packed (`pack_pairs`, `MoeTiles.prepacked`). At batch 1
  the call is four launches, none alone near the copy bandwidth, which bounds it; wider steps
  (`block_kb` 512) beat 256. TUNING.md has the measurements.
* pairs two to a program (`block_t` 2 with the f16x2 products, `PAIR_TILES`): pairs sorted by expert
  and padded as below; each weight word is loaded and decoded once for both rows (`_E2M1_HFMA2_PTX`),
  whose products, sums and scaling are the per-pair tiles', so the outputs are bitwise theirs. A block
  whose second position is padding runs the one-row loop.
* rows (`block_t` 2, 4 or 8 without `tl.dot`): pairs sorted by expert and padded as below; a program
  decodes each weight tile of its expert once and multiplies it with its up to `block_t` activation
  rows on the CUDA cores in float32 (`_gemv_rows_step`). Between the two above: at 32-64 decode
  tokens over 256 experts most experts meet one to three pairs, so per-pair programs read an
  expert's bytes once per pair and 16-token tiles are mostly padding.
* batched (`block_t >= 16`): pairs are sorted by expert and each expert's list is padded to a
  multiple of `block_t` (`align_pairs`); a program multiplies its expert's weight tile with up to
  `block_t` tokens using `tl.dot` (weights as the M operand, tokens as N: the "swap AB" layout that
  keeps small token counts efficient). Unused blocks (from the static upper bound on the number of
  blocks, which keeps the launch free of host synchronisation) exit at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from antumbra.kernels.common import host_math
from antumbra.kernels.common.codecs import e2m1_times_2pow14
from antumbra.kernels.common.interpreter import interpreting, prepare
from antumbra.kernels.kv_codes.triton import fp8_roundtrip

from .slots import sum_slots

prepare()

MXFP4_BLOCK = 32


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Allocation of float outputs and workspaces; tests swap in a NaN fill to catch unwritten elements."""
    return torch.empty(*shape, dtype=dtype, device=device)


# PTX for `tl.inline_asm_elementwise(pack=4)`: $8 holds 4 packed bytes (element i in the low byte);
# $0..$3 get the low nibbles' e2m1 values and $4..$7 the high nibbles', as float32 times 2^-6.
# Four bytes are moved at once (SIMD within the register) into e4m3 bit patterns: the sign to
# bit 7 and the 3 exponent / mantissa bits to bits 2..4, which is the e2m1 value times 2^-6 for
# every code (e2m1's subnormal 0.5 lands on an e4m3 subnormal); sm_89+ converts an e4m3 pair to an
# f16 pair in one instruction (low byte to low half), and f16 -> f32 is exact. Cross-compiled for
# sm_90, the batch-1 gate/up loop is ~4.9 SASS instructions per weight with it and ~8 with the
# elementwise decode below.
_E2M1_PTX = tl.constexpr("""
{
.reg .b32 lo, hi, t, p0, p1, p2, p3;
.reg .b16 b0, b1, b2, b3, h0, h1, h2, h3, h4, h5, h6, h7;
and.b32 t, $8, 0x08080808;
shl.b32 t, t, 4;
and.b32 lo, $8, 0x07070707;
shl.b32 lo, lo, 2;
or.b32 lo, lo, t;
shr.b32 hi, $8, 2;
and.b32 hi, hi, 0x1C1C1C1C;
and.b32 t, $8, 0x80808080;
or.b32 hi, hi, t;
mov.b32 {b0, b1}, lo;
mov.b32 {b2, b3}, hi;
cvt.rn.f16x2.e4m3x2 p0, b0;
cvt.rn.f16x2.e4m3x2 p1, b1;
cvt.rn.f16x2.e4m3x2 p2, b2;
cvt.rn.f16x2.e4m3x2 p3, b3;
mov.b32 {h0, h1}, p0;
mov.b32 {h2, h3}, p1;
mov.b32 {h4, h5}, p2;
mov.b32 {h6, h7}, p3;
cvt.f32.f16 $0, h0;
cvt.f32.f16 $1, h1;
cvt.f32.f16 $2, h2;
cvt.f32.f16 $3, h3;
cvt.f32.f16 $4, h4;
cvt.f32.f16 $5, h5;
cvt.f32.f16 $6, h6;
cvt.f32.f16 $7, h7;
}
""")


# PTX for `tl.inline_asm_elementwise(pack=1)`: the dot products of one 32-bit word of packed codes
# (4 bytes, 8 weights) with the 8 activations of each of `rows` rows, each row given as four f16x2
# pairs, returned as float32 ($0 .. $rows-1; the word is $rows, row r's pairs $rows+1+4r ..
# $rows+4+4r). The nibbles become e4m3 bit patterns as in `_E2M1_PTX` and f16x2 pairs (value times
# 2^-6), decoded once for all rows; each row's 8 products are summed in f16x2 (two lanes of four),
# then its lanes are added in float32. The pairs follow the lanes of the converted weights: (x[0],
# x[2]), (x[4], x[6]), (x[1], x[3]), (x[5], x[7]) for the word's 8 weight columns. About 2.6 SASS
# instructions per weight for one row; a second row adds about 0.9.
def _hfma_ptx(rows: int) -> str:
    w = f"${rows}"
    decode = f"""
and.b32 t, {w}, 0x08080808;
shl.b32 t, t, 4;
and.b32 lo, {w}, 0x07070707;
shl.b32 lo, lo, 2;
or.b32 lo, lo, t;
shr.b32 hi, {w}, 2;
and.b32 hi, hi, 0x1C1C1C1C;
and.b32 t, {w}, 0x80808080;
or.b32 hi, hi, t;
mov.b32 {{b0, b1}}, lo;
mov.b32 {{b2, b3}}, hi;
cvt.rn.f16x2.e4m3x2 p0, b0;
cvt.rn.f16x2.e4m3x2 p1, b1;
cvt.rn.f16x2.e4m3x2 p2, b2;
cvt.rn.f16x2.e4m3x2 p3, b3;"""
    products = ""
    for r in range(rows):
        a, b, c, d = (f"${rows + 1 + 4 * r + i}" for i in range(4))
        products += f"""
mul.rn.f16x2 acc, p0, {a};
fma.rn.f16x2 acc, p1, {b}, acc;
fma.rn.f16x2 acc, p2, {c}, acc;
fma.rn.f16x2 acc, p3, {d}, acc;
mov.b32 {{h0, h1}}, acc;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
add.f32 o{r}, f0, f1;"""
    # The outputs are written after every input is read, whatever registers the compiler gives them.
    outputs = "".join(f"\nmov.f32 ${r}, o{r};" for r in range(rows))
    sums = ", ".join(f"o{r}" for r in range(rows))
    return ("{\n.reg .b32 lo, hi, t, p0, p1, p2, p3, acc;\n.reg .b16 b0, b1, b2, b3, h0, h1;\n"
            f".reg .f32 f0, f1, {sums};" + decode + products + outputs + "\n}\n")


_E2M1_HFMA_PTX = tl.constexpr(_hfma_ptx(1))
_E2M1_HFMA2_PTX = tl.constexpr(_hfma_ptx(2))  # two activation rows sharing each decoded word
# Activations enter the f16 products times 2^PACKED_X_SHIFT (and the group scale carries the inverse):
# with the codes' 2^-6, the f16 lanes hold x * code / 4, which keeps |x| up to ~1e4 clear of f16
# overflow (four products per lane) and products of |x| down to ~5e-4 out of f16 subnormals.
PACKED_X_SHIFT = tl.constexpr(4)
PACKED_X_MULT = tl.constexpr(16.0)  # 2^PACKED_X_SHIFT


@triton.jit
def _tile_mask(row_ok, cols, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """[BLOCK_N, BLOCK] mask of a weight tile's loads: rows only when WIDTH is whole steps of BLOCK, so
    the mask is constant along a row and the loads vectorise to 16 bytes."""
    if WIDTH % BLOCK == 0:
        return tl.broadcast_to(row_ok[:, None], [row_ok.shape[0], BLOCK])
    return row_ok[:, None] & (cols < WIDTH)[None, :]


@triton.jit
def _load_mxfp4(
    w_ptr,  # *u8 [N, K_BYTES] packed e2m1 codes of one expert, contiguous
    s_ptr,  # *u8 [N, K_BYTES // 16] UE8M0 exponents of one expert, contiguous
    rows,  # [BLOCK_N] output rows of this tile
    row_ok,  # [BLOCK_N] rows < N
    kb,  # first packed byte of this step
    K_BYTES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KB: tl.constexpr,
    ASM: tl.constexpr,
):
    """-> (even, odd, mult).

    even, odd: float32 [BLOCK_N, BLOCK_KB], the codes of weight columns 2(kb + j) and 2(kb + j) + 1
    times 2^-c (c = 6 with the PTX decode, 14 without); mult: float32 [BLOCK_N, BLOCK_KB // 16], the
    scale 2^(s - 127) times 2^c of each 32-column group (exponent bytes above 240, scales beyond
    2^113, are not supported).
    """
    cols = tl.max_contiguous(tl.multiple_of(kb + tl.arange(0, BLOCK_KB), BLOCK_KB), BLOCK_KB)
    packed = tl.load(w_ptr + rows[:, None] * K_BYTES + cols[None, :],
                     mask=_tile_mask(row_ok, cols, K_BYTES, BLOCK_KB), other=0)
    groups = kb // 16 + tl.arange(0, BLOCK_KB // 16)
    exps = tl.load(s_ptr + rows[:, None] * (K_BYTES // 16) + groups[None, :],
                   mask=row_ok[:, None] & (groups < K_BYTES // 16)[None, :], other=0)
    if ASM:
        even, odd = tl.inline_asm_elementwise(
            _E2M1_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [packed], dtype=(tl.float32, tl.float32), is_pure=True,
            pack=4,
        )
        mult = ((exps.to(tl.int32) + 6) << 23).to(tl.float32, bitcast=True)
    else:
        even = e2m1_times_2pow14(packed & 15)
        odd = e2m1_times_2pow14(packed >> 4)
        mult = ((exps.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
    return even, odd, mult


@triton.jit
def _per_group(v, mult, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr):
    """v [BLOCK_N, BLOCK_KB] times its group's mult [BLOCK_N, BLOCK_KB // 16] (16 packed bytes a group)."""
    return tl.reshape(tl.reshape(v, [BLOCK_N, BLOCK_KB // 16, 16]) * mult[:, :, None], [BLOCK_N, BLOCK_KB])


@triton.jit
def _act_cols(
    a_ptr,  # *T [rows, 2 * K_BYTES] activations, contiguous
    a_rows,  # [BLOCK_T] activation rows
    a_ok,  # [BLOCK_T]
    kb,
    K_BYTES: tl.constexpr,
    BLOCK_KB: tl.constexpr,
    DT: tl.constexpr,
):
    """-> (even, odd): [BLOCK_KB, BLOCK_T] DT, activation columns 2(kb + j) and 2(kb + j) + 1 of each row,
    loaded with stride-2 pointers: the tile is small and cache-resident, and this avoids a register
    shuffle to de-interleave it."""
    j = kb + tl.arange(0, BLOCK_KB)
    a_cols = a_ptr + a_rows.to(tl.int64)[None, :] * (2 * K_BYTES) + 2 * j[:, None]
    a_mask = a_ok[None, :] & (j < K_BYTES)[:, None]
    return (tl.load(a_cols, mask=a_mask, other=0.0).to(DT),
            tl.load(a_cols + 1, mask=a_mask, other=0.0).to(DT))


@triton.jit
def _dot_step(
    acc,  # [BLOCK_N, BLOCK_T] float32
    w_ptr,  # *u8 [N, K_BYTES] packed weights of one expert
    s_ptr,  # *u8 [N, K_BYTES // 16] exponents of one expert
    rows,  # [BLOCK_N] weight rows
    row_ok,  # [BLOCK_N]
    a_ptr,  # *T [rows, 2 * K_BYTES] activations, contiguous
    a_rows,  # [BLOCK_T] activation rows
    a_ok,  # [BLOCK_T]
    kb,
    K_BYTES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_KB: tl.constexpr,
    DT: tl.constexpr,
    ASM: tl.constexpr,
):
    """acc += W[rows, 2kb : 2(kb + BLOCK_KB)] @ A[a_rows, same columns]^T on the tensor cores."""
    even, odd, mult = _load_mxfp4(w_ptr, s_ptr, rows, row_ok, kb, K_BYTES, BLOCK_N, BLOCK_KB, ASM)
    even = _per_group(even, mult, BLOCK_N, BLOCK_KB)
    odd = _per_group(odd, mult, BLOCK_N, BLOCK_KB)
    a_even, a_odd = _act_cols(a_ptr, a_rows, a_ok, kb, K_BYTES, BLOCK_KB, DT)
    if DT == tl.float32:
        acc = tl.dot(even, a_even, acc, input_precision="ieee")
        acc = tl.dot(odd, a_odd, acc, input_precision="ieee")
    else:
        acc = tl.dot(even.to(DT), a_even, acc)
        acc = tl.dot(odd.to(DT), a_odd, acc)
    return acc


@triton.jit
def _gemv_step(
    acc,  # [BLOCK_N, BLOCK_KB // 16] float32 per-group partial sums
    w_ptr,  # *u8 [N, K_BYTES] packed weights of one expert
    s_ptr,  # *u8 [N, K_BYTES // 16] exponents of one expert
    rows,  # [BLOCK_N] weight rows
    row_ok,  # [BLOCK_N]
    a_row_ptr,  # *T [2 * K_BYTES] one activation row
    a_ok,  # scalar: the row is real
    kb,
    K_BYTES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KB: tl.constexpr,
    ASM: tl.constexpr,
):
    """acc[:, g] += (sum over group g of W[rows, k] * a[k]) * scale of group g, for one activation row.

    Products are summed within each 32-weight group first (in-thread FMAs), so the scale costs one
    multiply per group rather than one per weight, and the loop carries no cross-thread reduction.
    """
    even, odd, mult = _load_mxfp4(w_ptr, s_ptr, rows, row_ok, kb, K_BYTES, BLOCK_N, BLOCK_KB, ASM)
    j = kb + tl.arange(0, BLOCK_KB)
    a_mask = (j < K_BYTES) & a_ok
    a_even = tl.load(a_row_ptr + 2 * j, mask=a_mask, other=0.0).to(tl.float32)
    a_odd = tl.load(a_row_ptr + 2 * j + 1, mask=a_mask, other=0.0).to(tl.float32)
    prod = even * a_even[None, :] + odd * a_odd[None, :]
    return acc + tl.sum(tl.reshape(prod, [BLOCK_N, BLOCK_KB // 16, 16]), axis=2) * mult


@triton.jit
def _gemv_rows_step(
    acc,  # [BLOCK_N, BLOCK_KB // 16, BLOCK_T] float32 per-group partial sums of each activation row
    w_ptr,  # *u8 [N, K_BYTES] packed weights of one expert
    s_ptr,  # *u8 [N, K_BYTES // 16] exponents of one expert
    rows,  # [BLOCK_N] weight rows
    row_ok,  # [BLOCK_N]
    a_ptr,  # *T [rows, 2 * K_BYTES] activations, contiguous
    a_rows,  # [BLOCK_T] activation rows
    a_ok,  # [BLOCK_T]
    kb,
    K_BYTES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_KB: tl.constexpr,
    ASM: tl.constexpr,
):
    """`_gemv_step` for BLOCK_T activation rows that share the expert: the weight tile is loaded and
    decoded once and multiplied with every row on the CUDA cores (no tensor-core tile to pad)."""
    even, odd, mult = _load_mxfp4(w_ptr, s_ptr, rows, row_ok, kb, K_BYTES, BLOCK_N, BLOCK_KB, ASM)
    a_even, a_odd = _act_cols(a_ptr, a_rows, a_ok, kb, K_BYTES, BLOCK_KB, tl.float32)
    prod = even[:, :, None] * a_even[None, :, :] + odd[:, :, None] * a_odd[None, :, :]  # [N, KB, T]
    part = tl.sum(tl.reshape(prod, [BLOCK_N, BLOCK_KB // 16, 16, BLOCK_T]), axis=2)
    return acc + part * mult[:, :, None]


@triton.jit
def _x_pair(a_row_ptr, words, ok, first: tl.constexpr):
    """f16x2 pairs (x[8w + first], x[8w + first + 2]) times 2^PACKED_X_SHIFT as int32, for words w."""
    lo = tl.load(a_row_ptr + 8 * words + first, mask=ok, other=0.0).to(tl.float32)
    hi = tl.load(a_row_ptr + 8 * words + first + 2, mask=ok, other=0.0).to(tl.float32)
    lo16 = (lo * PACKED_X_MULT).to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
    hi16 = (hi * PACKED_X_MULT).to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
    return (lo16 | (hi16 << 16)).to(tl.int32, bitcast=True)


@triton.jit
def _x_pairs(
    a_row_ptr,  # *T [2 * K_BYTES] one activation row, or *i32 [K_BYTES] its packed pairs (PREPACKED)
    kb,
    a_ok,  # scalar: the row is real
    K_BYTES: tl.constexpr,
    BLOCK_KB: tl.constexpr,
    PREPACKED: tl.constexpr,
):
    """-> the four f16x2 operands of `_E2M1_HFMA_PTX` for this step's words, [BLOCK_KB // 4] int32 each.

    PREPACKED reads them from a row `_pack_pairs_kernel` wrote (four 32-bit loads a word); otherwise
    they are gathered and converted here (eight 16-bit loads at a stride of 8 elements a word)."""
    words = kb // 4 + tl.arange(0, BLOCK_KB // 4)
    ok = (words < K_BYTES // 4) & a_ok
    if PREPACKED:
        q = a_row_ptr.to(tl.pointer_type(tl.int32)) + 4 * words
        x0 = tl.load(q, mask=ok, other=0)
        x1 = tl.load(q + 1, mask=ok, other=0)
        x2 = tl.load(q + 2, mask=ok, other=0)
        x3 = tl.load(q + 3, mask=ok, other=0)
    else:
        x0 = _x_pair(a_row_ptr, words, ok, 0)
        x1 = _x_pair(a_row_ptr, words, ok, 4)
        x2 = _x_pair(a_row_ptr, words, ok, 1)
        x3 = _x_pair(a_row_ptr, words, ok, 5)
    return x0, x1, x2, x3


# f16 position, within its word's 8, of activation column j (0..7) in the packed layout: lanes
# (x0, x2), (x4, x6), (x1, x3), (x5, x7), low half first.
@triton.jit
def _packed_slot(j):
    return (j % 2) * 4 + (j // 4) * 2 + (j // 2) % 2


@triton.jit
def _pack_pairs_kernel(
    x_ptr,  # *T [rows, 8 * NUM_WORDS] activations, contiguous
    q_ptr,  # *i32 [rows, 4 * NUM_WORDS] out: the f16x2 operands of each word, 16 bytes a word
    NUM_WORDS: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    words = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    ok = words < NUM_WORDS
    x0, x1, x2, x3 = _x_pairs(x_ptr + row * (8 * NUM_WORDS), 4 * tl.program_id(1) * BLOCK_W, True,
                              4 * NUM_WORDS, 4 * BLOCK_W, False)
    q = q_ptr + row * (4 * NUM_WORDS) + 4 * words
    tl.store(q, x0, mask=ok)
    tl.store(q + 1, x1, mask=ok)
    tl.store(q + 2, x2, mask=ok)
    tl.store(q + 3, x3, mask=ok)


PACK_BLOCK_W = 512  # words per program of `_pack_pairs_kernel`: a V4-Flash row (4096 values) in one


def pack_pairs(x: Tensor) -> Tensor:
    """x [T, C] bf16 / fp16 (C a multiple of 8, contiguous) -> [T, C / 2] int32: each 8 columns as the four
    f16x2 operands the batch-1 products take (values times 2^PACKED_X_SHIFT rounded to f16), so the
    kernels load them as 16 contiguous bytes. One launch."""
    rows, cols = x.shape
    assert cols % 8 == 0 and x.is_contiguous() and x.dtype in (torch.bfloat16, torch.float16)
    out = torch.empty(rows, cols // 2, dtype=torch.int32, device=x.device)
    if rows:
        words = cols // 8
        block_w = min(PACK_BLOCK_W, host_math.next_power_of_2(words))
        _pack_pairs_kernel[(rows, host_math.cdiv(words, block_w))](x, out, NUM_WORDS=words, BLOCK_W=block_w)
    return out


@triton.jit
def _packed_words(
    w_ptr,  # *u8 [N, K_BYTES] packed weights of one expert (read as 32-bit words)
    s_ptr,  # *u8 [N, K_BYTES // 16] exponents of one expert
    rows,  # [BLOCK_N] weight rows
    row_ok,  # [BLOCK_N]
    kb,
    K_BYTES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KB: tl.constexpr,
):
    """-> (packed [BLOCK_N, BLOCK_KB // 4] int32, the words of this step; mult [BLOCK_N, BLOCK_KB // 16]
    float32, each group's scale for the f16x2 products)."""
    BLOCK_W: tl.constexpr = BLOCK_KB // 4
    words = tl.max_contiguous(tl.multiple_of(kb // 4 + tl.arange(0, BLOCK_W), BLOCK_W), BLOCK_W)
    # The int32 view loses the byte pointer's alignment hint; the host checks 16-byte alignment
    # (`_as_u8`), and rows and experts are whole 16-byte multiples, so the loads may take 16 bytes.
    w32 = tl.multiple_of(w_ptr.to(tl.pointer_type(tl.int32)), 16)  # bytes
    packed = tl.load(w32 + rows[:, None] * (K_BYTES // 4) + words[None, :],
                     mask=_tile_mask(row_ok, words, K_BYTES // 4, BLOCK_W), other=0)
    groups = kb // 16 + tl.arange(0, BLOCK_KB // 16)
    exps = tl.load(s_ptr + rows[:, None] * (K_BYTES // 16) + groups[None, :],
                   mask=row_ok[:, None] & (groups < K_BYTES // 16)[None, :], other=0)
    # code * 2^-6 * x * 2^PACKED_X_SHIFT per product: the scale 2^(s - 127) times 2^(6 - PACKED_X_SHIFT).
    mult = ((exps.to(tl.int32) + (6 - PACKED_X_SHIFT)) << 23).to(tl.float32, bitcast=True)
    return packed, mult


@triton.jit
def _wide(x, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    return tl.broadcast_to(x[None, :], [BLOCK_N, BLOCK_W])


@triton.jit
def _gemv_step_packed(
    acc,  # [BLOCK_N, BLOCK_KB // 16] float32 per-group partial sums
    w_ptr,  # *u8 [N, K_BYTES] packed weights of one expert (read as 32-bit words)
    s_ptr,  # *u8 [N, K_BYTES // 16] exponents of one expert
    rows,  # [BLOCK_N] weight rows
    row_ok,  # [BLOCK_N]
    x0, x1, x2, x3,  # [BLOCK_KB // 4] int32: `_x_pairs` of this step
    kb,
    K_BYTES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KB: tl.constexpr,
):
    """`_gemv_step` with the products in f16x2 (`_E2M1_HFMA_PTX`, GPU only): one asm call per 8 weights,
    no float32 conversion of each weight."""
    BLOCK_W: tl.constexpr = BLOCK_KB // 4
    packed, mult = _packed_words(w_ptr, s_ptr, rows, row_ok, kb, K_BYTES, BLOCK_N, BLOCK_KB)
    part = tl.inline_asm_elementwise(
        _E2M1_HFMA_PTX, "=r,r,r,r,r,r",
        [packed, _wide(x0, BLOCK_N, BLOCK_W), _wide(x1, BLOCK_N, BLOCK_W), _wide(x2, BLOCK_N, BLOCK_W),
         _wide(x3, BLOCK_N, BLOCK_W)],
        dtype=tl.float32, is_pure=True, pack=1,
    )
    return acc + tl.sum(tl.reshape(part, [BLOCK_N, BLOCK_KB // 16, 4]), axis=2) * mult


@triton.jit
def _gemv2_step_packed(
    acc0,  # [BLOCK_N, BLOCK_KB // 16] float32 per-group partial sums of the first row
    acc1,  # the same of the second row
    w_ptr,  # *u8 [N, K_BYTES] packed weights of one expert (read as 32-bit words)
    s_ptr,  # *u8 [N, K_BYTES // 16] exponents of one expert
    rows,  # [BLOCK_N] weight rows
    row_ok,  # [BLOCK_N]
    x0, x1, x2, x3,  # [BLOCK_KB // 4] int32: `_x_pairs` of the first row
    y0, y1, y2, y3,  # the same of the second row
    kb,
    K_BYTES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KB: tl.constexpr,
):
    """`_gemv_step_packed` of two activation rows that share the expert: each word is loaded and decoded
    once (`_E2M1_HFMA2_PTX`). Each row's products, sums and scaling are those of `_gemv_step_packed`, in
    the same order, so either row's result is bitwise the one-row step's."""
    BLOCK_W: tl.constexpr = BLOCK_KB // 4
    packed, mult = _packed_words(w_ptr, s_ptr, rows, row_ok, kb, K_BYTES, BLOCK_N, BLOCK_KB)
    part0, part1 = tl.inline_asm_elementwise(
        _E2M1_HFMA2_PTX, "=r,=r,r,r,r,r,r,r,r,r,r",
        [packed, _wide(x0, BLOCK_N, BLOCK_W), _wide(x1, BLOCK_N, BLOCK_W), _wide(x2, BLOCK_N, BLOCK_W),
         _wide(x3, BLOCK_N, BLOCK_W), _wide(y0, BLOCK_N, BLOCK_W), _wide(y1, BLOCK_N, BLOCK_W),
         _wide(y2, BLOCK_N, BLOCK_W), _wide(y3, BLOCK_N, BLOCK_W)],
        dtype=(tl.float32, tl.float32), is_pure=True, pack=1,
    )
    acc0 = acc0 + tl.sum(tl.reshape(part0, [BLOCK_N, BLOCK_KB // 16, 4]), axis=2) * mult
    acc1 = acc1 + tl.sum(tl.reshape(part1, [BLOCK_N, BLOCK_KB // 16, 4]), axis=2) * mult
    return acc0, acc1

@triton.jit
def _two_rows_operands(a_row0, a_row1, TWO: tl.constexpr, kb, K_BYTES: tl.constexpr, BLOCK_KB: tl.constexpr,
                       PREPACKED: tl.constexpr):
    """`_x_pairs` of both activation rows for this step (the first row's again, unread, unless TWO)."""
    x0, x1, x2, x3 = _x_pairs(a_row0, kb, True, K_BYTES, BLOCK_KB, PREPACKED)
    if TWO:
        y0, y1, y2, y3 = _x_pairs(a_row1, kb, True, K_BYTES, BLOCK_KB, PREPACKED)
    else:
        y0, y1, y2, y3 = x0, x1, x2, x3
    return x0, x1, x2, x3, y0, y1, y2, y3


@triton.jit
def _two_rows_step(
    acc0, acc1,  # [BLOCK_N, BLOCK_KB // 16] float32 per-group partial sums of each row
    w_ptr, s_ptr, rows, row_ok,
    x0, x1, x2, x3, y0, y1, y2, y3,  # `_two_rows_operands` of this step
    TWO: tl.constexpr,  # the second row is real: else it is not computed
    kb,
    K_BYTES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KB: tl.constexpr,
):
    if TWO:
        acc0, acc1 = _gemv2_step_packed(acc0, acc1, w_ptr, s_ptr, rows, row_ok, x0, x1, x2, x3,
                                        y0, y1, y2, y3, kb, K_BYTES, BLOCK_N, BLOCK_KB)
    else:
        acc0 = _gemv_step_packed(acc0, w_ptr, s_ptr, rows, row_ok, x0, x1, x2, x3, kb, K_BYTES, BLOCK_N,
                                 BLOCK_KB)
    return acc0, acc1


@triton.jit
def _gate_up_rows(
    x_row0, x_row1, w1, s1, w3, s3, n, n_ok,
    TWO: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KB: tl.constexpr,
    GEMV_STAGES: tl.constexpr,
    PREPACKED: tl.constexpr,
):
    """-> (gate, up): [BLOCK_N, 2] float32 of the two rows (the second zero unless TWO). Each step's
    activation operands are loaded once for both projections."""
    g0 = tl.zeros([BLOCK_N, BLOCK_KB // 16], tl.float32)
    g1 = tl.zeros([BLOCK_N, BLOCK_KB // 16], tl.float32)
    u0 = tl.zeros([BLOCK_N, BLOCK_KB // 16], tl.float32)
    u1 = tl.zeros([BLOCK_N, BLOCK_KB // 16], tl.float32)
    for kb in tl.range(0, D // 2, BLOCK_KB, num_stages=GEMV_STAGES):
        x0, x1, x2, x3, y0, y1, y2, y3 = _two_rows_operands(x_row0, x_row1, TWO, kb, D // 2, BLOCK_KB,
                                                            PREPACKED)
        g0, g1 = _two_rows_step(g0, g1, w1, s1, n, n_ok, x0, x1, x2, x3, y0, y1, y2, y3, TWO, kb, D // 2,
                                BLOCK_N, BLOCK_KB)
        u0, u1 = _two_rows_step(u0, u1, w3, s3, n, n_ok, x0, x1, x2, x3, y0, y1, y2, y3, TWO, kb, D // 2,
                                BLOCK_N, BLOCK_KB)
    return tl.join(tl.sum(g0, axis=1), tl.sum(g1, axis=1)), tl.join(tl.sum(u0, axis=1), tl.sum(u1, axis=1))


@triton.jit
def _up_two_rows(x_ptr, pair_ptr, pid_b, num_pairs, w1, s1, w3, s3, n, n_ok,
                 D: tl.constexpr, TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr,
                 GEMV_STAGES: tl.constexpr, PREPACKED: tl.constexpr):
    """Gate and up products of a block of two sorted positions (one expert): [BLOCK_N, 2] float32 each.
    A block whose second position is padding runs the one-row loop, so its cost is a pair's."""
    x_stride: tl.constexpr = D // 2 if PREPACKED else D
    pair0 = tl.load(pair_ptr + 2 * pid_b)
    pair1 = tl.load(pair_ptr + 2 * pid_b + 1)
    x_row0 = x_ptr + (pair0 // TOPK).to(tl.int64) * x_stride
    x_row1 = x_ptr + (pair1 // TOPK).to(tl.int64) * x_stride
    if pair1 < num_pairs:
        g, u = _gate_up_rows(x_row0, x_row1, w1, s1, w3, s3, n, n_ok, True, D, BLOCK_N, BLOCK_KB, GEMV_STAGES,
                             PREPACKED)
    else:
        g, u = _gate_up_rows(x_row0, x_row0, w1, s1, w3, s3, n, n_ok, False, D, BLOCK_N, BLOCK_KB,
                             GEMV_STAGES, PREPACKED)
    return g, u


@triton.jit
def _down_rows(
    h_row0, h_row1, w2, s2, n, n_ok,
    TWO: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KB: tl.constexpr,
    GEMV_STAGES: tl.constexpr,
    PREPACKED: tl.constexpr,
):
    acc0 = tl.zeros([BLOCK_N, BLOCK_KB // 16], tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_KB // 16], tl.float32)
    for kb in tl.range(0, INTER // 2, BLOCK_KB, num_stages=GEMV_STAGES):
        x0, x1, x2, x3, y0, y1, y2, y3 = _two_rows_operands(h_row0, h_row1, TWO, kb, INTER // 2, BLOCK_KB,
                                                            PREPACKED)
        acc0, acc1 = _two_rows_step(acc0, acc1, w2, s2, n, n_ok, x0, x1, x2, x3, y0, y1, y2, y3, TWO, kb,
                                    INTER // 2, BLOCK_N, BLOCK_KB)
    return tl.join(tl.sum(acc0, axis=1), tl.sum(acc1, axis=1))


@triton.jit
def _down_two_rows(h_ptr, pair_ptr, pid_b, num_pairs, w2, s2, n, n_ok,
                   INTER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr,
                   GEMV_STAGES: tl.constexpr, PREPACKED: tl.constexpr):
    """Down products of a block of two sorted positions (h rows 2 pid_b and 2 pid_b + 1): [BLOCK_N, 2]."""
    h_row0 = h_ptr + (2 * pid_b).to(tl.int64) * INTER
    if tl.load(pair_ptr + 2 * pid_b + 1) < num_pairs:
        acc = _down_rows(h_row0, h_row0 + INTER, w2, s2, n, n_ok, True, INTER, BLOCK_N, BLOCK_KB, GEMV_STAGES,
                         PREPACKED)
    else:
        acc = _down_rows(h_row0, h_row0, w2, s2, n, n_ok, False, INTER, BLOCK_N, BLOCK_KB, GEMV_STAGES,
                         PREPACKED)
    return acc


# The pair count (tokens times top-k) is not specialised: it only masks padding, and the
# tiles (constexprs) follow the bucketed token count (`tiles_for`), never the routing.
@triton.jit(do_not_specialize=["num_pairs"])
def _moe_up_kernel(
    x_ptr,  # *T [num_tokens, D] activations, contiguous (PREPACKED: *i32 [num_tokens, D / 2] `pack_pairs`)
    w1_ptr,  # *u8 [E, I, D / 2] packed gate weights
    s1_ptr,  # *u8 [E, I, D / 32] gate exponents
    w3_ptr,  # *u8 [E, I, D / 2] packed up weights
    s3_ptr,  # *u8 [E, I, D / 32] up exponents
    route_w_ptr,  # *f32 [P] routing weight of pair p = token * TOPK + slot
    pair_ptr,  # *i32 [NB * BLOCK_T] pair at each sorted position, >= P for padding (not read if IDENTITY)
    block_expert_ptr,  # *int [NB] expert of each block of positions, < 0 for an unused block
    h_ptr,  # *T [NB * BLOCK_T, I] out: routing-weighted SwiGLU activation at each position (PACK_H: *f16)
    num_pairs,
    limit,
    D: tl.constexpr,
    INTER: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KB: tl.constexpr,
    IDENTITY: tl.constexpr,
    USE_DOT: tl.constexpr,
    DT: tl.constexpr,
    ASM: tl.constexpr,  # decode nibbles with the PTX above (GPU only; the interpreter cannot run PTX)
    PACKED: tl.constexpr,  # batch-1 products in f16x2 (`_gemv_step_packed`; GPU only, 16-bit activations)
    GEMV_STAGES: tl.constexpr,  # software-pipeline depth of the batch-1 loop (its loads feed no tl.dot)
    PREPACKED: tl.constexpr = False,  # PACKED: x_ptr holds `pack_pairs(x)`
    # PACKED: h is written as `pack_pairs` of its ACT_DT rounding would write it (f16 slots, times
    # 2^PACKED_X_SHIFT), so the down kernel reads its operands whole; None writes h itself.
    PACK_H: tl.constexpr = False,
    ACT_DT: tl.constexpr = tl.bfloat16,  # the activations' dtype (PACK_H rounds h to it first)
):
    pid_b = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_b).to(tl.int64)
    if expert >= 0:
        pos = pid_b * BLOCK_T + tl.arange(0, BLOCK_T)
        if IDENTITY:
            pair = pos
        else:
            pair = tl.load(pair_ptr + pos)
        pair_ok = pair < num_pairs
        token = pair // TOPK
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < INTER
        w1 = w1_ptr + expert * (INTER * D // 2)
        w3 = w3_ptr + expert * (INTER * D // 2)
        s1 = s1_ptr + expert * (INTER * D // 32)
        s3 = s3_ptr + expert * (INTER * D // 32)
        if USE_DOT:
            acc_g = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
            acc_u = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
            for kb in tl.range(0, D // 2, BLOCK_KB):
                acc_g = _dot_step(acc_g, w1, s1, n, n_ok, x_ptr, token, pair_ok, kb, D // 2, BLOCK_N, BLOCK_T,
                                  BLOCK_KB, DT, ASM)
                acc_u = _dot_step(acc_u, w3, s3, n, n_ok, x_ptr, token, pair_ok, kb, D // 2, BLOCK_N, BLOCK_T,
                                  BLOCK_KB, DT, ASM)
        elif BLOCK_T == 2 and PACKED:  # the expert's two pairs share each decoded word
            acc_g, acc_u = _up_two_rows(x_ptr, pair_ptr, pid_b, num_pairs, w1, s1, w3, s3, n, n_ok, D, TOPK,
                                        BLOCK_N, BLOCK_KB, GEMV_STAGES, PREPACKED)
        elif BLOCK_T > 1:  # the block's pairs share one decoded weight tile, products on CUDA cores
            acc_g3 = tl.zeros([BLOCK_N, BLOCK_KB // 16, BLOCK_T], tl.float32)
            acc_u3 = tl.zeros([BLOCK_N, BLOCK_KB // 16, BLOCK_T], tl.float32)
            for kb in tl.range(0, D // 2, BLOCK_KB, num_stages=GEMV_STAGES):
                acc_g3 = _gemv_rows_step(acc_g3, w1, s1, n, n_ok, x_ptr, token, pair_ok, kb, D // 2, BLOCK_N,
                                         BLOCK_T, BLOCK_KB, ASM)
                acc_u3 = _gemv_rows_step(acc_u3, w3, s3, n, n_ok, x_ptr, token, pair_ok, kb, D // 2, BLOCK_N,
                                         BLOCK_T, BLOCK_KB, ASM)
            acc_g = tl.sum(acc_g3, axis=1)
            acc_u = tl.sum(acc_u3, axis=1)
        else:  # BLOCK_T == 1
            x_row = x_ptr + tl.sum(token).to(tl.int64) * (D // 2 if PREPACKED else D)
            row_ok = tl.sum(pair_ok.to(tl.int32)) > 0
            acc_g = tl.zeros([BLOCK_N, BLOCK_KB // 16], tl.float32)
            acc_u = tl.zeros([BLOCK_N, BLOCK_KB // 16], tl.float32)
            for kb in tl.range(0, D // 2, BLOCK_KB, num_stages=GEMV_STAGES):
                if PACKED:  # one set of activation operands for both projections
                    x0, x1, x2, x3 = _x_pairs(x_row, kb, row_ok, D // 2, BLOCK_KB, PREPACKED)
                    acc_g = _gemv_step_packed(acc_g, w1, s1, n, n_ok, x0, x1, x2, x3, kb, D // 2, BLOCK_N,
                                              BLOCK_KB)
                    acc_u = _gemv_step_packed(acc_u, w3, s3, n, n_ok, x0, x1, x2, x3, kb, D // 2, BLOCK_N,
                                              BLOCK_KB)
                else:
                    acc_g = _gemv_step(acc_g, w1, s1, n, n_ok, x_row, row_ok, kb, D // 2, BLOCK_N, BLOCK_KB,
                                       ASM)
                    acc_u = _gemv_step(acc_u, w3, s3, n, n_ok, x_row, row_ok, kb, D // 2, BLOCK_N, BLOCK_KB,
                                       ASM)
            acc_g = tl.sum(acc_g, axis=1)[:, None]
            acc_u = tl.sum(acc_u, axis=1)[:, None]
        route_w = tl.load(route_w_ptr + pair, mask=pair_ok, other=0.0)
        gate = tl.minimum(acc_g, limit)
        up = tl.minimum(tl.maximum(acc_u, -limit), limit)
        h = gate * tl.sigmoid(gate) * up * route_w[None, :]
        if PACK_H:  # the value `_x_pair` would make of the stored h, at its `pack_pairs` slot
            h16 = (h.to(ACT_DT).to(tl.float32) * PACKED_X_MULT).to(tl.float16)
            col = (n // 8) * 8 + _packed_slot(n % 8)
            tl.store(h_ptr + pos.to(tl.int64)[None, :] * INTER + col[:, None], h16,
                     mask=n_ok[:, None] & pair_ok[None, :])
        else:
            tl.store(h_ptr + pos.to(tl.int64)[None, :] * INTER + n[:, None], h.to(h_ptr.dtype.element_ty),
                     mask=n_ok[:, None] & pair_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_down_kernel(
    h_ptr,  # *T [NB * BLOCK_T, I] activations from _moe_up_kernel (PREPACKED: its PACK_H f16 slots)
    w2_ptr,  # *u8 [E, D, I / 2] packed down weights
    s2_ptr,  # *u8 [E, D, I / 32] down exponents
    pair_ptr,  # *i32 [NB * BLOCK_T] pair at each sorted position (not read if IDENTITY)
    block_expert_ptr,  # *int [NB] expert of each block, < 0 for an unused block
    y_ptr,  # *T out: [P, D] each pair's (routing-weighted) expert output, or [T, D] token sums (SUM_SLOTS)
    num_pairs,
    D: tl.constexpr,
    INTER: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,  # power of two >= TOPK
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KB: tl.constexpr,
    IDENTITY: tl.constexpr,
    USE_DOT: tl.constexpr,
    SUM_SLOTS: tl.constexpr,  # BLOCK_T == 1 only: program (token, tile) sums the token's TOPK experts
    DT: tl.constexpr,
    ASM: tl.constexpr,  # decode nibbles with the PTX above (GPU only; the interpreter cannot run PTX)
    PACKED: tl.constexpr,  # batch-1 products in f16x2 (`_gemv_step_packed`; GPU only, 16-bit activations)
    GEMV_STAGES: tl.constexpr,  # software-pipeline depth of the batch-1 loop (its loads feed no tl.dot)
    PREPACKED: tl.constexpr = False,  # PACKED: h was written with PACK_H
):
    pid_b = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < D
    if SUM_SLOTS:
        # Decode: the token's TOPK (pair, expert) products are summed in registers and the token's
        # output row is written once (no per-pair rows, no separate reduction). One pipelined loop
        # walks every (slot, reduction step) of the token, so the loads of the next expert are in
        # flight while the last steps of the current one compute.
        STEPS: tl.constexpr = triton.cdiv(INTER // 2, BLOCK_KB)
        slots = tl.arange(0, TOPK_PAD)
        experts = tl.load(block_expert_ptr + pid_b * TOPK + slots, mask=slots < TOPK, other=0).to(tl.int64)
        acc = tl.zeros([BLOCK_N, BLOCK_KB // 16], tl.float32)
        for it in tl.range(0, TOPK * STEPS, num_stages=GEMV_STAGES):
            slot = it // STEPS
            kb = (it - slot * STEPS) * BLOCK_KB
            expert = tl.sum(tl.where(slots == slot, experts, 0))
            w2 = w2_ptr + expert * (D * INTER // 2)
            s2 = s2_ptr + expert * (D * INTER // 32)
            h_row = h_ptr + (pid_b * TOPK + slot).to(tl.int64) * INTER
            if PACKED:
                x0, x1, x2, x3 = _x_pairs(h_row, kb, True, INTER // 2, BLOCK_KB, PREPACKED)
                acc = _gemv_step_packed(acc, w2, s2, n, n_ok, x0, x1, x2, x3, kb, INTER // 2, BLOCK_N,
                                        BLOCK_KB)
            else:
                acc = _gemv_step(acc, w2, s2, n, n_ok, h_row, True, kb, INTER // 2, BLOCK_N, BLOCK_KB, ASM)
        y = tl.sum(acc, axis=1)
        tl.store(y_ptr + pid_b.to(tl.int64) * D + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)
    else:
        expert = tl.load(block_expert_ptr + pid_b).to(tl.int64)
        if expert >= 0:
            pos = pid_b * BLOCK_T + tl.arange(0, BLOCK_T)
            if IDENTITY:
                pair = pos
            else:
                pair = tl.load(pair_ptr + pos)
            pair_ok = pair < num_pairs
            w2 = w2_ptr + expert * (D * INTER // 2)
            s2 = s2_ptr + expert * (D * INTER // 32)
            if USE_DOT:
                acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
                for kb in tl.range(0, INTER // 2, BLOCK_KB):
                    acc = _dot_step(acc, w2, s2, n, n_ok, h_ptr, pos, pair_ok, kb, INTER // 2, BLOCK_N,
                                    BLOCK_T, BLOCK_KB, DT, ASM)
            elif BLOCK_T == 2 and PACKED:
                acc = _down_two_rows(h_ptr, pair_ptr, pid_b, num_pairs, w2, s2, n, n_ok, INTER, BLOCK_N,
                                     BLOCK_KB, GEMV_STAGES, PREPACKED)
            elif BLOCK_T > 1:
                acc3 = tl.zeros([BLOCK_N, BLOCK_KB // 16, BLOCK_T], tl.float32)
                for kb in tl.range(0, INTER // 2, BLOCK_KB, num_stages=GEMV_STAGES):
                    acc3 = _gemv_rows_step(acc3, w2, s2, n, n_ok, h_ptr, pos, pair_ok, kb, INTER // 2,
                                           BLOCK_N, BLOCK_T, BLOCK_KB, ASM)
                acc = tl.sum(acc3, axis=1)
            else:  # BLOCK_T == 1
                h_row = h_ptr + pid_b.to(tl.int64) * INTER
                row_ok = tl.sum(pair_ok.to(tl.int32)) > 0
                acc = tl.zeros([BLOCK_N, BLOCK_KB // 16], tl.float32)
                for kb in tl.range(0, INTER // 2, BLOCK_KB, num_stages=GEMV_STAGES):
                    if PACKED:
                        x0, x1, x2, x3 = _x_pairs(h_row, kb, row_ok, INTER // 2, BLOCK_KB, PREPACKED)
                        acc = _gemv_step_packed(acc, w2, s2, n, n_ok, x0, x1, x2, x3, kb, INTER // 2, BLOCK_N,
                                                BLOCK_KB)
                    else:
                        acc = _gemv_step(acc, w2, s2, n, n_ok, h_row, row_ok, kb, INTER // 2, BLOCK_N,
                                         BLOCK_KB, ASM)
                acc = tl.sum(acc, axis=1)[:, None]
            tl.store(y_ptr + pair.to(tl.int64)[None, :] * D + n[:, None], acc.to(y_ptr.dtype.element_ty),
                     mask=n_ok[:, None] & pair_ok[None, :])


@dataclass(frozen=True)
class MoeTiles:
    """Launch shape of both GEMMs."""

    block_t: int  # tokens per program; 1 = one (token, expert) pair per program, no sorting
    block_n: int  # output rows per program (of I for gate/up, of D for down)
    block_kb: int  # packed bytes of the reduction per step (2 inputs each); a multiple of 16
    # tl.dot (needs block_t >= 16), else FMAs on CUDA cores: block_t 1 (a pair per program, no sorting) or
    # 2 / 4 / 8 (the sorted pairs of one expert share each decoded weight tile)
    use_dot: bool
    num_warps: int = 4
    num_stages: int = 3
    asm_decode: bool = True  # PTX nibble decode on the GPU (the interpreter always uses the Triton path)
    # block_t == 1 on the GPU with bf16 / fp16 activations: products in f16x2 (`_E2M1_HFMA_PTX`), about
    # half the instructions per weight of the float32 path; the partial sums of 4 products are rounded to
    # f16 (relative error ~1e-3 of the output, against bf16 output rounding of 4e-3).
    packed_math: bool = True
    # block_t == 1: the down GEMM sums each token's top-k expert outputs in registers and writes the
    # token's row (grid (tokens, D / block_n)) instead of one row per pair plus a reduction. Off by
    # default: at batch 1 the per-pair grid (top_k times more programs) streams the weights faster
    # than one program walking all top_k experts, even counting the reduction's launch.
    sum_slots: bool = False
    down_block_n: int = 0  # rows per program of the down GEMM when sum_slots (0 = block_n)
    # With packed_math: the activations go in as `pack_pairs` rows (one extra launch for x; the up
    # kernel writes h so, unless the release's FP8 round trip of h sits between the kernels), so each
    # step loads its f16x2 operands as four 32-bit words instead of gathering and converting 8 values
    # at a stride of 8. Same products, same results, a little faster with the pack launch included
    # (TUNING.md).
    prepacked: bool = True


DECODE_TILES = MoeTiles(block_t=1, block_n=16, block_kb=512, use_dot=False, num_warps=4, num_stages=2)
# Sorted pairs two to a program: an expert that two pairs picked is read and decoded once for both
# (measured, not picked: TUNING.md).
PAIR_TILES = MoeTiles(block_t=2, block_n=16, block_kb=512, use_dot=False, num_warps=4, num_stages=2)
SMALL_BATCH_TILES = MoeTiles(block_t=16, block_n=64, block_kb=64, use_dot=True, num_warps=4)
PREFILL_TILES = MoeTiles(block_t=64, block_n=128, block_kb=64, use_dot=True, num_warps=8)


def pick_tiles(num_tokens: int, top_k: int, num_experts: int) -> MoeTiles:
    """Decode tiles (one program per (token, slot) pair) for a handful of tokens, and while the
    pairs are at most twice the experts, so that most experts meet one or two pairs and a 16-token
    tile would be mostly rows of padding (the pair tiles took about half the time at V4-Flash's 256
    experts: TUNING.md; an expert's second pair finds its bytes in L2, and pairing them in one program,
    `PAIR_TILES`, measured no faster); token tiles of 16 up to ~16 pairs per expert, else 64.
    `moe_mxfp4` asks for next_power_of_2(T) (`tiles_for`), so the tiles are a function of T's bucket:
    how the routing spreads the pairs over the experts never picks a variant."""
    if num_tokens <= 4 or num_tokens * top_k <= 2 * num_experts:
        return DECODE_TILES
    if num_tokens * top_k <= 16 * num_experts:
        return SMALL_BATCH_TILES
    return PREFILL_TILES


def tiles_for(num_tokens: int, top_k: int, num_experts: int) -> MoeTiles:
    """The tiles `moe_mxfp4` runs T tokens with: `pick_tiles` of next_power_of_2(T)."""
    return pick_tiles(host_math.next_power_of_2(max(num_tokens, 1)), top_k, num_experts)


def align_pairs(topk_ids: Tensor, num_experts: int, block_t: int) -> tuple[Tensor, Tensor]:
    """Sort the (token, slot) pairs by expert and pad each expert's run to a multiple of block_t.

    topk_ids: [T, k] int expert ids. -> (pair_ids [NB * block_t] int32: pair p = t * k + slot at each
    sorted position, P = T * k marks padding; block_expert [NB] int32: expert of each block, -1 past
    the end). NB = ceil(P / block_t) + min(num_experts, P) bounds the padded length from above, so
    nothing here waits for the device and the whole thing can be captured in a CUDA graph.
    """
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    device = flat.device
    num_blocks = host_math.cdiv(num_pairs, block_t) + min(num_experts, num_pairs)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_t - 1) // block_t * block_t
    pad_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    dest = (pad_end - padded)[sorted_experts] + rank
    pair_ids = torch.full((num_blocks * block_t,), num_pairs, dtype=torch.int32, device=device)
    pair_ids[dest] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=device) * block_t
    block_expert = torch.searchsorted(pad_end, starts, right=True)
    block_expert = torch.where(starts < pad_end[-1], block_expert, -1).to(torch.int32)
    return pair_ids, block_expert


def _tile_constexprs(tiles: MoeTiles) -> dict[str, Any]:
    return dict(
        BLOCK_T=tiles.block_t, BLOCK_KB=tiles.block_kb, IDENTITY=tiles.block_t == 1, USE_DOT=tiles.use_dot,
        GEMV_STAGES=tiles.num_stages if not tiles.use_dot else 1, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def up_constexprs(tiles: MoeTiles, d: int, inter: int, top_k: int) -> dict[str, Any]:
    """Constexprs and launch options of `_moe_up_kernel`, less the dtype- and device-dependent
    DT / ASM / PACKED: the tiles' and the model's, nothing of the routing."""
    return dict(D=d, INTER=inter, TOPK=top_k, BLOCK_N=tiles.block_n, **_tile_constexprs(tiles))


def down_constexprs(tiles: MoeTiles, d: int, inter: int, top_k: int) -> dict[str, Any]:
    """As `up_constexprs`, of `_moe_down_kernel`."""
    sum_slots = tiles.block_t == 1 and tiles.sum_slots
    return dict(
        D=d, INTER=inter, TOPK=top_k, TOPK_PAD=host_math.next_power_of_2(top_k),
        BLOCK_N=(tiles.down_block_n or tiles.block_n) if sum_slots else tiles.block_n, SUM_SLOTS=sum_slots,
        **_tile_constexprs(tiles),
    )


def _as_u8(t: Tensor) -> Tensor:
    assert t.is_contiguous(), "expert weights and scales must be contiguous (a copy would double them)"
    assert t.data_ptr() % 16 == 0, "expert weights and scales must start 16-byte aligned (vector loads)"
    return t.view(torch.uint8)


def moe_mxfp4(
    x: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w1: Tensor,
    w1_scale: Tensor,
    w3: Tensor,
    w3_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    swiglu_limit: float,
    *,
    tiles: MoeTiles | None = None,
    act_fp8: bool = False,
    addend: Tensor | None = None,
) -> Tensor:
    """Routed experts with in-kernel MXFP4 dequantisation, as `moe_mxfp4_reference`.

    x: [T, D] bf16 / fp16 / fp32, contiguous. topk_weights: [T, k] float (routing weights, scaling
    included); topk_ids: [T, k] int in [0, E).
    w1, w3: [E, I, D/2] int8 / uint8; w1_scale, w3_scale: [E, I, D/32] float8_e8m0fnu or uint8.
    w2: [E, D, I/2]; w2_scale: [E, D, I/32]. D and I multiples of 32; weights and scales contiguous;
    exponent bytes <= 240 (scales up to 2^113). -> [T, D] x.dtype.
    tiles: launch shape (None = `tiles_for`). Expert ids are not range-checked (that would synchronise).
    act_fp8: release numerics: the down projection's input (already weighted by the routing weight,
    as the release kernels quantise it) takes an FP8 round trip per 128 channels, one launch
    (`kv_codes.fp8_roundtrip`) between the two GEMMs.
    addend: [T, D] x.dtype (the shared expert's output) added to the routed sum, as
    `moe_mxfp4(...) + addend` would add it (the sum rounded to x.dtype first), in the launch that
    sums a token's k pairs (`slots.sum_slots`).
    """
    num_tokens, d = x.shape
    num_experts, inter, d_half = w1.shape
    top_k = topk_ids.shape[1]
    assert x.is_floating_point() and x.is_contiguous()
    assert d % MXFP4_BLOCK == 0 and inter % MXFP4_BLOCK == 0, "D and I must be multiples of 32"
    assert d_half * 2 == d and w3.shape == w1.shape and w2.shape == (num_experts, d, inter // 2)
    assert w1_scale.shape == w3_scale.shape == (num_experts, inter, d // MXFP4_BLOCK)
    assert w2_scale.shape == (num_experts, d, inter // MXFP4_BLOCK)
    for w in (w1, w3, w2):
        assert w.element_size() == 1 and not w.is_floating_point(), "packed weights are int8 / uint8"
    for s in (w1_scale, w3_scale, w2_scale):
        assert s.dtype in (torch.uint8, torch.float8_e8m0fnu), f"scales must be e8m0 or uint8, got {s.dtype}"
    assert topk_weights.shape == topk_ids.shape == (num_tokens, top_k) and not topk_ids.is_floating_point()
    assert addend is None or (addend.shape == x.shape and addend.dtype == x.dtype)
    if num_tokens == 0:
        return torch.empty_like(x)

    tiles = tiles or tiles_for(num_tokens, top_k, num_experts)
    assert tiles.block_kb % 16 == 0 and (tiles.block_t >= 16 if tiles.use_dot else
                                         tiles.block_t in (1, 2, 4, 8))
    num_pairs = num_tokens * top_k
    identity = tiles.block_t == 1
    if identity:
        block_expert = topk_ids.reshape(-1).contiguous()
        pair_ids = block_expert  # never read
    else:
        pair_ids, block_expert = align_pairs(topk_ids, num_experts, tiles.block_t)
    num_blocks = block_expert.shape[0]
    # The interpreter computes bf16 arithmetic on raw bits, so it multiplies in float32 (same values).
    if x.dtype == torch.float32 or not tiles.use_dot or interpreting():
        dot_dtype = tl.float32
    else:
        dot_dtype = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16
    route_w = topk_weights.reshape(-1).to(torch.float32).contiguous()
    asm = tiles.asm_decode and not interpreting()
    two_rows = tiles.block_t == 2 and not tiles.use_dot
    half = x.dtype in (torch.bfloat16, torch.float16)
    packed = asm and tiles.packed_math and (identity or two_rows) and half
    prepacked = packed and tiles.prepacked
    pack_h = prepacked and not act_fp8
    h = _empty(num_blocks * tiles.block_t, inter, dtype=torch.float16 if pack_h else x.dtype, device=x.device)
    device_consts = dict(DT=dot_dtype, ASM=asm, PACKED=packed)
    act_dt = tl.float16 if x.dtype == torch.float16 else tl.bfloat16
    _moe_up_kernel[(num_blocks, host_math.cdiv(inter, tiles.block_n))](
        pack_pairs(x) if prepacked else x, _as_u8(w1), _as_u8(w1_scale), _as_u8(w3), _as_u8(w3_scale),
        route_w, pair_ids, block_expert, h, num_pairs, float(swiglu_limit),
        **up_constexprs(tiles, d, inter, top_k), **device_consts, PREPACKED=prepacked, PACK_H=pack_h,
        ACT_DT=act_dt,
    )
    if act_fp8:
        h = fp8_roundtrip(h)
    device_consts = dict(device_consts, PREPACKED=pack_h)  # the down kernel reads h as written
    down = down_constexprs(tiles, d, inter, top_k)
    if down["SUM_SLOTS"]:
        out = _empty(num_tokens, d, dtype=x.dtype, device=x.device)
        _moe_down_kernel[(num_tokens, host_math.cdiv(d, down["BLOCK_N"]))](
            h, _as_u8(w2), _as_u8(w2_scale), pair_ids, block_expert, out, num_pairs, **down, **device_consts,
        )
        return out if addend is None else out + addend
    y = _empty(num_pairs, d, dtype=x.dtype, device=x.device)
    _moe_down_kernel[(num_blocks, host_math.cdiv(d, down["BLOCK_N"]))](
        h, _as_u8(w2), _as_u8(w2_scale), pair_ids, block_expert, y, num_pairs, **down, **device_consts,
    )
    if addend is not None:
        return sum_slots(y, top_k, addend)
    return y.view(num_tokens, top_k, d).sum(dim=1)  # one kernel; torch accumulates bf16 in float32
