"""Hybrid sparse attention (SWA window + compressed extras + sink) as Triton kernels.

Semantics: `reference.hybrid_attention_reference`. One query row n carries all H heads
of a decode request (or of one prefill token); its keys are gathered pool rows of the
layer's single latent head, K = V.

Work decomposition
------------------
The key list of row n is the concatenation [window rows (W) | extra rows (K)], cut into
blocks of BLOCK_K keys; a block never straddles the two lists (the window part is padded
up to a block boundary), so each block reads one pool. The blocks are dealt out in
contiguous runs of equal length to SPLITS programs per row (split-K), so that even a
single decode request spreads over many multiprocessors (`plan_splits`: as many splits
as keep all programs in one wave, `programs_per_sm` per multiprocessor). A program owns
all H heads of its row: with one latent KV head, each gathered key row is loaded once and
serves every head as an [H, d] x [d, BLOCK_K] product (MQA), and the same tile is the V
operand of [H, BLOCK_K] x [BLOCK_K, d].

The row indices of block i + 1 are loaded during step i and carried, so the compiler's
software pipeline issues the gather of the next key tile (asynchronous copies into shared
memory) without first waiting for its indices.

Tiling over head_dim (V4-Flash: H = 64, d = 512)
------------------------------------------------
* q.k: when BLOCK_D == d the [H, d] query tile is loaded once per program and each key
  block is loaded as one [BLOCK_K, d] tile; otherwise the contraction runs in BLOCK_D
  chunks, re-reading the query chunk (L1/L2 resident) per key block.
* p.v: each program produces output columns [dv0, dv0 + BLOCK_DV) (a third grid axis
  when BLOCK_DV < d). With BLOCK_D == BLOCK_DV == d the key tile already loaded for
  q.k is reused as V: every key byte is read from memory exactly once. With
  BLOCK_DV < d the fp32 accumulator shrinks to [H, BLOCK_DV] (fewer registers) at the
  cost of recomputing q.k once per output chunk.
  Shared memory at d = 512, bf16: the resident query tile H * 1 KiB = 64 KiB plus one
  K tile of BLOCK_K * 1 KiB per pipeline stage. The default (BLOCK_K = 64, two stages,
  8 warps) compiles for sm_90 to 196,608 B of the 232,448 B a block may use, 255
  registers per thread and no spills; the [64, 512] fp32 accumulator is 128 of them.

Online softmax (base-2, reference max m, running sum l, unnormalised accumulator acc)
-----------------------------------------------------------------------------------
Per key block with logits s = q.k * scale * log2(e) (-inf for missing keys):
    m' = max(m, max_j s_j);  alpha = 2^(m - m');  p_j = 2^(s_j - m')
    l' = l * alpha + sum_j p_j;  acc' = acc * alpha + p @ V
While nothing valid has been seen m' is -inf; it is replaced by 0 in the exponents so
that -inf - -inf never produces NaN (alpha and p are then exactly 0). With
`lazy_rescale` m is only raised when some head's block max exceeds it by more than
`rescale_threshold`, so most blocks skip the rescale of acc (off by default: the branch
costs registers at d = 512 and measured slower).

Merge (combine kernel, or in place when SPLITS == 1) with the sink σ_h (natural-log
units, so σ2 = σ_h * log2(e)). Split s stores its normalised output o_s = acc_s / l_s
(in the query dtype by default: normalised values keep bf16's relative precision, and
the scratch traffic halves) with (m_s, l_s):
    M = max(σ2, max_s m_s);  w_s = l_s 2^(m_s - M);  L = 2^(σ2 - M) + sum_s w_s
    out = sum_s w_s o_s / L
The sink is finite, so M is finite even when every split saw no valid key; empty
splits then contribute 2^(-inf) = 0. The combine kernel loads up to COMBINE_SPLITS
splits' partials at once and walks longer rows in chunks.

FP8 rows (release numerics, `fp8_rows`: `kv_codes.Fp8Rows`)
-------------------------------------------------------
The pools then hold each key as bytes: e4m3 codes of the non-RoPE channels, one UE8M0
exponent byte per 64 of them, and the RoPE channels in the query dtype. `_load_rows`
gathers the codes, their exponents (the same few bytes for 64 lanes: cache hits) and the
RoPE channels of a tile with masked loads and decodes them in registers into the same
[BLOCK_K, d] tile a plain pool gives, so everything after the load is unchanged and the
output equals the plain kernel's on the decoded pool bit for bit. A row is 584 bytes at
V4 widths against 1024 in bf16; nothing is dequantised to memory.

`benchmarks/kernels/attention.py` times it; TUNING.md keeps what those runs decided.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from antumbra.kernels.common import host_math
from antumbra.kernels.common.device import multiprocessor_count
from antumbra.kernels.common.interpreter import interpreting, prepare
from antumbra.kernels.kv_codes.layout import Fp8Rows

LOG2E = 1.4426950408889634
COMBINE_SPLITS = 16  # splits the combine kernel loads at once


prepare()


@dataclass(frozen=True)
class AttentionConfig:
    """Launch shape of the split kernel; 0 means "the whole head_dim"."""

    block_k: int = 64  # keys per inner step
    block_d: int = 0  # q.k contraction chunk
    block_dv: int = 0  # output columns per program
    num_warps: int = 8
    num_stages: int = 2
    # Split-K never gives a split fewer keys than this: each split writes H*d partial
    # outputs that have to be read back, against 2*d bytes per key it saves reading.
    min_keys_per_split: int = 64
    # Programs per multiprocessor the split heuristic aims for (one: the resident query
    # tile and key stages of the default shape take most of a multiprocessor's shared
    # memory, so a second wave would run after the first rather than beside it).
    programs_per_sm: int = 1
    # Partial outputs of split-K in the query dtype (normalised, so bf16 keeps the same
    # relative precision as the output) instead of float32: half the scratch traffic.
    narrow_partials: bool = True
    # Lazy rescaling: the running max used for the exponentials is only raised when a
    # block's max exceeds it by more than `rescale_threshold` (base-2 units), so most
    # blocks skip the rescale of the [H, d] accumulator (probabilities stay below
    # 2^rescale_threshold). Off by default: the branch costs registers at d = 512.
    lazy_rescale: bool = False
    rescale_threshold: float = 8.0
    # FP8 rows (release numerics) read as two tiles, the e4m3 channels and the RoPE channels, each
    # one contiguous load a row (`_load_fp8_parts`), with whole tiles only (block_d = block_dv = d).
    # Off: one [block_k, d] tile assembled channel by channel (a byte load per channel for the
    # exponents, a masked load per channel for the RoPE part), which equals the plain kernel on the
    # decoded pool bit for bit; on, the RoPE channels' products are summed apart, so the output
    # differs from it by float32 summation order.
    fp8_split_rope: bool = True


DEFAULT_CONFIG = AttentionConfig()
# float32 on a GPU: the default's resident [H, d] query tile and [block_k, d] key stages take twice
# the bytes and overflow a multiprocessor's shared memory (272 KB at d = 512 against the H200's
# 227 KB), so the contraction and the output columns are chunked instead, in chunks of 64 that
# never straddle the RoPE channels or an FP8 row's exponent blocks.
FLOAT32_CONFIG = AttentionConfig(block_k=32, block_d=64, block_dv=64)


@dataclass
class AttentionWorkspace:
    """Split-K scratch; keep one per shape to launch without allocations (CUDA graphs)."""

    acc: torch.Tensor  # [N, S, H, d] normalised partial outputs (float32, or the query dtype)
    ml: torch.Tensor  # [N, S, 2, H] fp32 running max (base 2) and running sum per split

    @staticmethod
    def empty(
        rows: int,
        splits: int,
        heads: int,
        head_dim: int,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
    ) -> AttentionWorkspace:
        return AttentionWorkspace(
            acc=torch.empty(rows, splits, heads, head_dim, dtype=dtype, device=device),
            ml=torch.empty(rows, splits, 2, heads, dtype=torch.float32, device=device),
        )


@triton.jit
def _mm(a, b, acc, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b. DOT_F32 upcasts the operands: used for fp32 inputs and by the CPU
    interpreter, whose dot does not understand bf16."""
    if DOT_F32:
        res = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    else:
        res = tl.dot(a, b, acc, input_precision=PRECISION)
    return res


@triton.jit
def _block_rows(
    win_base,  # pointer to window_rows[n, 0]
    x_base,  # pointer to extra_rows[n, 0]
    blk,  # key block index in [window blocks | extra blocks]
    win_blocks,
    total_blocks,
    W,
    K,
    BLOCK_K: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
):
    """-> (rows [BLOCK_K] int32 pool rows of key block blk, -1 = no key; the block is a
    window block). Blocks past the end have no key."""
    in_win = blk < win_blocks
    if HAS_EXTRA:
        rows_base = tl.where(in_win, win_base, x_base)
        start = tl.where(in_win, blk, blk - win_blocks) * BLOCK_K
        n_keys = tl.where(in_win, W, K)
    else:
        rows_base = win_base
        start = blk * BLOCK_K
        n_keys = W
    n_keys = tl.where(blk < total_blocks, n_keys, 0)
    offs_k = start + tl.arange(0, BLOCK_K)
    rows = tl.load(rows_base + offs_k, mask=offs_k < n_keys, other=-1)
    return rows, in_win


@triton.jit
def _load_rows(
    pool_ptr,  # pointer to pool[0, 0]: plain rows of the value dtype, or FP8 rows of bytes
    row_off,  # [BLOCK_K] int64 element offset of each gathered row
    offs_c,  # [C] channels to load
    valid,  # [BLOCK_K] rows that hold a key
    VDT: tl.constexpr,  # the value dtype (the query's)
    KV_FP8: tl.constexpr,
    NOPE: tl.constexpr,  # FP8 rows: e4m3 channels, whose exponent bytes follow them
    ROPE_AT: tl.constexpr,  # FP8 rows: byte offset of the RoPE channels (VDT values)
):
    """-> [BLOCK_K, C] key (= value) tile in VDT, 0 where not valid.

    FP8 rows are decoded in registers: e4m3 code times 2^(byte - 127) of its 64-channel block,
    built as float32 bits (exact), rounded to VDT, which holds it exactly; the RoPE channels are
    read as stored. The result equals `kv_rows.decode_kv` of the same rows, bit for bit."""
    if KV_FP8:
        is_nope = offs_c < NOPE
        ptrs = pool_ptr + row_off[:, None] + offs_c[None, :]
        m_nope = valid[:, None] & is_nope[None, :]
        codes = tl.load(ptrs, mask=m_nope, other=0)
        exps = tl.load(pool_ptr + row_off[:, None] + NOPE + offs_c[None, :] // 64, mask=m_nope, other=127)
        scale = (exps.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        nope = (codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale).to(VDT)
        rope_ptrs = (pool_ptr + row_off + ROPE_AT).to(tl.pointer_type(VDT), bitcast=True)
        rope = tl.load(rope_ptrs[:, None] + (offs_c - NOPE)[None, :], mask=valid[:, None] & ~is_nope[None, :],
                       other=0.0)
        tile = tl.where(is_nope[None, :], nope, rope)
    else:
        tile = tl.load(pool_ptr + row_off[:, None] + offs_c[None, :], mask=valid[:, None], other=0.0)
    return tile


@triton.jit
def _load_fp8_parts(
    pool_ptr,  # pointer to pool[0, 0]: FP8 rows of bytes
    row_off,  # [BLOCK_K] int64 byte offset of each gathered row
    valid,  # [BLOCK_K] rows that hold a key
    VDT: tl.constexpr,
    D: tl.constexpr,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_AT: tl.constexpr,
):
    """-> ([BLOCK_K, D] the e4m3 channels decoded, 0 from NOPE on; [BLOCK_K, ROPE] the RoPE channels).

    Each part is one contiguous load per row: the first D bytes of the row whole (the bytes past
    NOPE are exponents and padding, zeroed after the decode), one exponent byte per 64 channels
    broadcast over its block, and the RoPE channels as their own tile, so the loads vectorise
    instead of gathering a byte per channel. Decoded values equal `kv_rows.decode_kv`'s."""
    offs_d = tl.arange(0, D)
    codes = tl.load(pool_ptr + row_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0)
    blocks = tl.arange(0, D // 64)
    exps = tl.load(pool_ptr + row_off[:, None] + NOPE + blocks[None, :],
                   mask=valid[:, None] & (blocks[None, :] * 64 < NOPE), other=127)
    scale = (exps.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(byte - 127), exact
    block_k: tl.constexpr = codes.shape[0]
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], [block_k, D // 64, 64]), [block_k, D])
    values = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
    nope = tl.where((offs_d < NOPE)[None, :], values, 0.0).to(VDT)
    rope_ptrs = (pool_ptr + row_off + ROPE_AT).to(tl.pointer_type(VDT), bitcast=True)
    rope = tl.load(rope_ptrs[:, None] + tl.arange(0, ROPE)[None, :], mask=valid[:, None], other=0.0)
    return nope, rope


@triton.jit
def _attend_block(
    acc,  # [BLOCK_H, BLOCK_DV] fp32 running unnormalised output
    acc_rope,  # [BLOCK_H, ROPE] fp32 the RoPE columns' (SPLIT_ROPE; acc's are then 0)
    q_rope,  # [BLOCK_H, ROPE] resident RoPE channels of the query (SPLIT_ROPE)
    m_i,  # [BLOCK_H] fp32 running reference max logit (base 2)
    l_i,  # [BLOCK_H] fp32 running sum of 2^(logit - m_i)
    q_tile,  # [BLOCK_H, D] resident query tile (only read when BLOCK_D == D)
    q_row_ptr,  # pointer to q[n, 0, 0]; rows of one query are D apart
    pool_ptr,  # pointer to pool[0, 0]; [R, ROW_W] contiguous key(=value) rows
    rows,  # [BLOCK_K] int32 pool rows of this block, -1 = no key
    offs_h,  # [BLOCK_H] head indices
    h_mask,  # [BLOCK_H] heads < H
    dv0,  # first output column of this program
    qk_scale,  # softmax scale * log2(e)
    tau,  # lazy-rescale threshold (base 2)
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    ROW_W: tl.constexpr,  # pool elements a row (D for plain rows, the byte width of FP8 rows)
    KV_FP8: tl.constexpr,
    NOPE: tl.constexpr,
    ROPE_AT: tl.constexpr,
    ROPE: tl.constexpr,
    SPLIT_ROPE: tl.constexpr,  # FP8 rows as two tiles (`_load_fp8_parts`); needs BLOCK_D == BLOCK_DV == D
):
    VDT: tl.constexpr = q_row_ptr.dtype.element_ty
    valid = rows >= 0
    row_off = rows.to(tl.int64) * ROW_W  # [BLOCK_K] element offset of each gathered row

    if SPLIT_ROPE:
        # q.k over the e4m3 channels (q's RoPE channels meet zeros there) plus over the RoPE tile.
        k_tile, rope_tile = _load_fp8_parts(pool_ptr, row_off, valid, VDT, D, NOPE, ROPE, ROPE_AT)
        s = _mm(q_tile, tl.trans(k_tile), tl.zeros([BLOCK_H, BLOCK_K], tl.float32), DOT_F32, PRECISION)
        s = _mm(q_rope, tl.trans(rope_tile), s, DOT_F32, PRECISION)
    elif BLOCK_D == D:
        offs_d = tl.arange(0, D)
        k_tile = _load_rows(pool_ptr, row_off, offs_d, valid, VDT, KV_FP8, NOPE, ROPE_AT)
        s = _mm(q_tile, tl.trans(k_tile), tl.zeros([BLOCK_H, BLOCK_K], tl.float32), DOT_F32, PRECISION)
    else:
        s = tl.zeros([BLOCK_H, BLOCK_K], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_c = d0 + tl.arange(0, BLOCK_D)
            q_c = tl.load(q_row_ptr + offs_h[:, None] * D + offs_c[None, :], mask=h_mask[:, None], other=0.0)
            k_c = _load_rows(pool_ptr, row_off, offs_c, valid, VDT, KV_FP8, NOPE, ROPE_AT)
            s = _mm(q_c, tl.trans(k_c), s, DOT_F32, PRECISION)

    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if LAZY_RESCALE:
        # Keep the reference max while no head's max grew by more than tau (a head
        # without any key yet, m_new == m_i == -inf, needs nothing).
        if tl.max(tl.where(m_new > m_i, m_new - m_i, 0.0), 0) > tau:
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            acc = acc * alpha[:, None]
            if SPLIT_ROPE:
                acc_rope = acc_rope * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
    else:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        acc = acc * alpha[:, None]
        if SPLIT_ROPE:
            acc_rope = acc_rope * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_new
    m_ref = tl.where(m_i == float("-inf"), 0.0, m_i)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i + tl.sum(p, 1)

    if SPLIT_ROPE:
        acc_rope = _mm(p.to(rope_tile.dtype), rope_tile, acc_rope, DOT_F32, PRECISION)
    if BLOCK_D == D and BLOCK_DV == D:
        v_tile = k_tile  # K = V: the tile loaded for q.k is the value tile
    else:
        offs_v = dv0 + tl.arange(0, BLOCK_DV)
        v_tile = _load_rows(pool_ptr, row_off, offs_v, valid, VDT, KV_FP8, NOPE, ROPE_AT)
    # p is rounded to the value dtype for the tensor-core product, as flash attention does.
    acc = _mm(p.to(v_tile.dtype), v_tile, acc, DOT_F32, PRECISION)
    return acc, acc_rope, m_i, l_i


@triton.jit
def _combine_tile(
    o_row_ptr,  # pointer to part_o[n, 0, 0, 0]: [S, H, D] normalised partial outputs
    ml_row_ptr,  # pointer to part_ml[n, 0, 0, 0]: [S, 2, H] running max (base 2) and sum
    sinks_ptr,  # [H] fp32 sink logits (natural-log units)
    out_row_ptr,  # pointer to out[n, 0, 0]
    S,  # splits of the row
    offs_h,  # [BLOCK_HC] heads of this tile
    d0,  # first output column of this tile
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_HC: tl.constexpr,
    BLOCK_DC: tl.constexpr,
):
    """out[n, offs_h, d0 : d0 + BLOCK_DC] = merge of the S partial outputs and the sink, BLOCK_S
    splits at a time (all of a chunk's partials are loaded at once: [BLOCK_S, BLOCK_HC, BLOCK_DC])."""
    h_mask = offs_h < H
    offs_s = tl.arange(0, BLOCK_S)
    sink2 = tl.load(sinks_ptr + offs_h, mask=h_mask, other=0.0) * 1.4426950408889634
    m_all = sink2  # finite: the sink is finite
    for s0 in range(0, S, BLOCK_S):
        sh_mask = ((s0 + offs_s)[:, None] < S) & h_mask[None, :]
        m_s = tl.load(
            ml_row_ptr + (s0 + offs_s)[:, None] * 2 * H + offs_h[None, :], mask=sh_mask, other=float("-inf")
        )
        m_all = tl.maximum(m_all, tl.max(m_s, 0))
    denom = tl.exp2(sink2 - m_all)
    offs_d = d0 + tl.arange(0, BLOCK_DC)
    o = tl.zeros([BLOCK_HC, BLOCK_DC], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        sh_mask = ((s0 + offs_s)[:, None] < S) & h_mask[None, :]
        ml_ptrs = ml_row_ptr + (s0 + offs_s)[:, None] * 2 * H + offs_h[None, :]
        m_s = tl.load(ml_ptrs, mask=sh_mask, other=float("-inf"))
        l_s = tl.load(ml_ptrs + H, mask=sh_mask, other=0.0)
        w = l_s * tl.exp2(m_s - m_all[None, :])  # [BLOCK_S, BLOCK_HC]; 0 for empty / missing splits
        denom += tl.sum(w, 0)
        o_ptrs = (
            o_row_ptr
            + (s0 + offs_s)[:, None, None] * H * D
            + offs_h[None, :, None] * D
            + offs_d[None, None, :]
        )
        part = tl.load(o_ptrs, mask=sh_mask[:, :, None], other=0.0).to(tl.float32)
        o += tl.sum(part * w[:, :, None], 0)
    o = o / denom[:, None]
    tl.store(
        out_row_ptr + offs_h[:, None] * D + offs_d[None, :],
        o.to(out_row_ptr.dtype.element_ty),
        mask=h_mask[:, None],
    )


# Key counts and trip counts change with every request's context: not specialised, so they
# do not multiply the compiled variants (they bound loops and masks; W is the model's window).
@triton.jit(do_not_specialize=["K", "blocks_per_split"])
def _hybrid_split_kernel(
    q_ptr,  # [N, H, D] queries, contiguous (bf16 or fp32)
    kv_ptr,  # [R, ROW_W] SWA pool rows of this layer, contiguous (q's dtype, or FP8 row bytes)
    win_ptr,  # [N, W] int32 SWA rows per query, -1 = no key
    extra_ptr,  # [Rc, ROW_W] compressed pool rows (C4 / C128), contiguous; = kv_ptr without HAS_EXTRA
    xrows_ptr,  # [N, K] int32 compressed rows per query, -1 = no key; = win_ptr when HAS_EXTRA is False
    sinks_ptr,  # [H] fp32 sink logits (natural-log units, not scaled)
    out_ptr,  # [N, H, D] output in q's dtype; written here when SINGLE_SPLIT or by the merging program
    part_o_ptr,  # [N, S, H, D] normalised partial outputs; written unless SINGLE_SPLIT
    part_ml_ptr,  # [N, S, 2, H] fp32 per-split reference max (base 2) and sum; written unless SINGLE_SPLIT
    W,  # window keys per query
    K,  # extra keys per query
    blocks_per_split,  # key blocks each split walks
    qk_scale,  # softmax scale * log2(e)
    tau,  # lazy-rescale threshold (base 2)
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    ROW_W: tl.constexpr = 0,  # pool elements a row; 0: D (plain rows)
    KV_FP8: tl.constexpr = False,  # rows in the FP8 layout (`kv_codes.Fp8Rows`), decoded in registers
    NOPE: tl.constexpr = 0,  # FP8 rows: e4m3 channels
    ROPE_AT: tl.constexpr = 0,  # FP8 rows: byte offset of the RoPE channels
    ROPE: tl.constexpr = 16,  # FP8 rows: RoPE channels (D - NOPE)
    SPLIT_ROPE: tl.constexpr = False,  # FP8 rows read as two tiles (`_load_fp8_parts`)
):
    ROW_STRIDE: tl.constexpr = D if ROW_W == 0 else ROW_W
    n = tl.program_id(0)
    split = tl.program_id(1)
    dv0 = tl.program_id(2) * BLOCK_DV
    num_splits = tl.num_programs(1)

    # Trip counts are kernel arguments, identical for every split: blocks past the end
    # of the list (only in the last split) have no valid key.
    win_blocks = tl.cdiv(W, BLOCK_K)
    total_blocks = win_blocks
    if HAS_EXTRA:
        total_blocks += tl.cdiv(K, BLOCK_K)
    win_base = win_ptr + n.to(tl.int64) * W
    x_base = xrows_ptr + n.to(tl.int64) * K
    blk0 = split * blocks_per_split
    # The row indices of block i + 1 are loaded during step i (carried), so the gather of
    # the next key tile can be issued as soon as the pipeline has a free stage, without
    # waiting for its indices. The first indices are requested before the query tile,
    # whose load the kernel waits for.
    rows, in_win = _block_rows(win_base, x_base, blk0, win_blocks, total_blocks, W, K, BLOCK_K, HAS_EXTRA)

    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    q_row_ptr = q_ptr + n.to(tl.int64) * H * D
    if BLOCK_D == D:
        offs_d = tl.arange(0, D)
        q_tile = tl.load(q_row_ptr + offs_h[:, None] * D + offs_d[None, :], mask=h_mask[:, None], other=0.0)
    else:
        q_tile = tl.zeros([BLOCK_H, BLOCK_D], q_ptr.dtype.element_ty)  # unused placeholder
    if SPLIT_ROPE:
        offs_r = NOPE + tl.arange(0, ROPE)
        q_rope = tl.load(q_row_ptr + offs_h[:, None] * D + offs_r[None, :], mask=h_mask[:, None], other=0.0)
    else:
        q_rope = tl.zeros([BLOCK_H, ROPE], q_ptr.dtype.element_ty)  # unused placeholder
    acc_rope = tl.zeros([BLOCK_H, ROPE], tl.float32)

    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    for i in range(0, blocks_per_split):
        if HAS_EXTRA:
            pool = tl.where(in_win, kv_ptr, extra_ptr)
        else:
            pool = kv_ptr
        acc, acc_rope, m_i, l_i = _attend_block(
            acc,
            acc_rope,
            q_rope,
            m_i,
            l_i,
            q_tile,
            q_row_ptr,
            pool,
            rows,
            offs_h,
            h_mask,
            dv0,
            qk_scale,
            tau,
            D,
            BLOCK_H,
            BLOCK_K,
            BLOCK_D,
            BLOCK_DV,
            LAZY_RESCALE,
            DOT_F32,
            PRECISION,
            ROW_STRIDE,
            KV_FP8,
            NOPE,
            ROPE_AT,
            ROPE,
            SPLIT_ROPE,
        )
        rows, in_win = _block_rows(
            win_base, x_base, blk0 + i + 1, win_blocks, total_blocks, W, K, BLOCK_K, HAS_EXTRA
        )

    offs_v = dv0 + tl.arange(0, BLOCK_DV)
    if SINGLE_SPLIT:
        # Merge with the sink in place: one split is the whole softmax.
        sink2 = tl.load(sinks_ptr + offs_h, mask=h_mask, other=0.0) * 1.4426950408889634
        m_all = tl.maximum(m_i, sink2)
        alpha = tl.exp2(m_i - m_all)
        denom = l_i * alpha + tl.exp2(sink2 - m_all)
        factor = alpha / denom
        o_ptrs = out_ptr + n.to(tl.int64) * H * D + offs_h[:, None] * D
    else:
        row_split = n.to(tl.int64) * num_splits + split
        factor = 1.0 / tl.where(l_i > 0.0, l_i, 1.0)  # normalised: narrow partials keep precision
        o_ptrs = part_o_ptr + row_split * H * D + offs_h[:, None] * D
    o = acc * factor[:, None]
    if SPLIT_ROPE:  # acc's RoPE columns are zeros; acc_rope holds them
        nope_mask = h_mask[:, None] & (offs_v < NOPE)[None, :]
        tl.store(o_ptrs + offs_v[None, :], o.to(o_ptrs.dtype.element_ty), mask=nope_mask)
        o_rope = acc_rope * factor[:, None]
        tl.store(o_ptrs + (NOPE + tl.arange(0, ROPE))[None, :], o_rope.to(o_ptrs.dtype.element_ty),
                 mask=h_mask[:, None])
    else:
        tl.store(o_ptrs + offs_v[None, :], o.to(o_ptrs.dtype.element_ty), mask=h_mask[:, None])
    if not SINGLE_SPLIT:
        # Every output-column program computed the same (m, l); the first one records it.
        ml_mask = h_mask & (dv0 == 0)
        tl.store(part_ml_ptr + row_split * 2 * H + offs_h, m_i, mask=ml_mask)
        tl.store(part_ml_ptr + row_split * 2 * H + H + offs_h, l_i, mask=ml_mask)


@triton.jit(do_not_specialize=["S"])
def _hybrid_combine_kernel(
    part_o_ptr,  # [N, S, H, D] normalised partial outputs
    part_ml_ptr,  # [N, S, 2, H] fp32 per-split reference max (base 2) and sum
    sinks_ptr,  # [H] fp32 sink logits (natural-log units)
    out_ptr,  # [N, H, D] output in q's dtype
    S,  # splits per row
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_HC: tl.constexpr,
    BLOCK_DC: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_HC + tl.arange(0, BLOCK_HC)
    _combine_tile(
        part_o_ptr + n * S * H * D,
        part_ml_ptr + n * S * 2 * H,
        sinks_ptr,
        out_ptr + n * H * D,
        S,
        offs_h,
        tl.program_id(2) * BLOCK_DC,
        H,
        D,
        BLOCK_S,
        BLOCK_HC,
        BLOCK_DC,
    )


def plan_splits(
    rows: int,
    window: int,
    extra: int,
    head_dim: int,
    device: torch.device | str,
    config: AttentionConfig = DEFAULT_CONFIG,
    num_splits: int | None = None,
) -> tuple[int, int]:
    """-> (splits, key blocks per split) a call with these sizes launches on `device`; size an
    `AttentionWorkspace` with `splits` to reuse it across calls (see `split_plan`)."""
    sms = multiprocessor_count(torch.device(device))
    return split_plan(rows, window, extra, head_dim, sms, config, num_splits)


def split_plan(
    rows: int,
    window: int,
    extra: int,
    head_dim: int,
    num_sms: int,
    config: AttentionConfig = DEFAULT_CONFIG,
    num_splits: int | None = None,
) -> tuple[int, int]:
    """-> (splits, key blocks per split) on a device of `num_sms` multiprocessors.

    By default: as many splits as keep rows * splits * (d / BLOCK_DV) programs within
    `config.programs_per_sm` per multiprocessor (one wave: a second wave would only
    start when the first ends), at least one, and no split with fewer than
    `config.min_keys_per_split` keys."""
    num_blocks = host_math.cdiv(window, config.block_k) + host_math.cdiv(extra, config.block_k)
    if num_splits is None:
        dv_programs = head_dim // (config.block_dv or head_dim)
        slots = config.programs_per_sm * num_sms
        want = max(1, slots // max(rows * dv_programs, 1))
        cap = max(1, num_blocks // max(1, config.min_keys_per_split // config.block_k))
        num_splits = min(want, cap)
    splits = max(1, min(num_splits, max(num_blocks, 1)))
    blocks_per_split = host_math.cdiv(max(num_blocks, 1), splits)
    return host_math.cdiv(max(num_blocks, 1), blocks_per_split), blocks_per_split  # no split without work


def launch_constexprs(
    heads: int, head_dim: int, extra: int, splits: int, config: AttentionConfig = DEFAULT_CONFIG
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """-> (split kernel's constexprs and launch options, combine kernel's or None with one split),
    less the dtype-dependent DOT_F32 / PRECISION. What varies with a request: HAS_EXTRA (any
    compressed key) and SINGLE_SPLIT; the combine's are model constants (`variants.py`)."""
    block_d = config.block_d or head_dim
    block_dv = config.block_dv or head_dim
    block_h = max(16, host_math.next_power_of_2(heads))
    split = dict(
        H=heads, D=head_dim, BLOCK_H=block_h, BLOCK_K=config.block_k, BLOCK_D=block_d, BLOCK_DV=block_dv,
        HAS_EXTRA=extra > 0, SINGLE_SPLIT=splits == 1, LAZY_RESCALE=config.lazy_rescale,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if splits == 1:
        return split, None
    # Small tiles: at batch 1 the merge must still spread over many multiprocessors. The split
    # count is a plain argument: the kernel walks any number of splits BLOCK_S at a time (masked rows
    # add exact zeros), BLOCK_S the split count's power of two up to COMBINE_SPLITS, so a split
    # count has one of four variants. (A fixed 16 loaded 16 partial tiles for every 2 to 4 splits,
    # which more than doubled a small batch's split + combine: TUNING.md.)
    block_s = min(COMBINE_SPLITS, max(2, host_math.next_power_of_2(splits)))
    combine = dict(
        H=heads, D=head_dim, BLOCK_S=block_s, BLOCK_HC=min(8, block_h), BLOCK_DC=min(64, head_dim),
        num_warps=4,
    )
    return split, combine


def fp8_constexprs(layout: Fp8Rows, head_dim: int, config: AttentionConfig) -> dict[str, Any]:
    """ROPE and SPLIT_ROPE of a launch over FP8 rows: the two-tile read where the config asks for it
    and the shapes allow (whole tiles, 64-channel exponent blocks across d, a RoPE tile a power of
    two of at least 16 channels)."""
    rope = layout.rope_dim
    whole = (config.block_d or head_dim) == head_dim and (config.block_dv or head_dim) == head_dim
    fits = head_dim % 64 == 0 and rope >= 16 and rope & (rope - 1) == 0
    return dict(ROPE=rope if fits else 16, SPLIT_ROPE=config.fp8_split_rope and whole and fits)


def _check_rows(rows: torch.Tensor, n: int, name: str) -> None:
    assert rows.dtype == torch.int32, f"{name} must be int32, got {rows.dtype}"
    assert rows.dim() == 2 and rows.shape[0] == n, f"{name} must be [{n}, *], got {tuple(rows.shape)}"
    assert rows.is_contiguous(), f"{name} must be contiguous"


def hybrid_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    window_rows: torch.Tensor,
    extra_pool: torch.Tensor | None,
    extra_rows: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: AttentionConfig = DEFAULT_CONFIG,
    workspace: AttentionWorkspace | None = None,
    fp8_rows: Fp8Rows | None = None,
) -> torch.Tensor:
    """One launch (SPLITS == 1) or split + combine over N query rows.

    q: [N, H, d] bf16/fp32, contiguous; kv_pool: [R, d] contiguous; window_rows: [N, W]
    int32 (-1 = no key); extra_pool: [Rc, d] contiguous or None; extra_rows: [N, K] int32
    (-1 = no key) or None; sinks: [H] fp32; all on one device -> out: [N, H, d] in q's
    dtype (written into `out` when given). `workspace` must hold at least
    [N, num_splits, H, d] / [N, num_splits, 2, H] when given.
    fp8_rows: both pools hold FP8 rows of this layout instead ([R, width] / [Rc, width] uint8,
    RoPE channels in q's dtype), decoded in registers.
    """
    assert q.dim() == 3 and q.is_contiguous(), "q must be a contiguous [N, H, d] tensor"
    n_rows, heads, head_dim = q.shape
    assert q.dtype in (torch.bfloat16, torch.float32), f"q dtype {q.dtype} unsupported"
    assert head_dim % 16 == 0, "head_dim must be a multiple of 16"
    row_width = head_dim if fp8_rows is None else fp8_rows.width
    assert kv_pool.dim() == 2 and kv_pool.shape[1] == row_width and kv_pool.is_contiguous()
    if fp8_rows is None:
        assert kv_pool.dtype in (torch.bfloat16, torch.float32), f"kv dtype {kv_pool.dtype} unsupported"
    else:
        assert fp8_rows.head_dim == head_dim, f"FP8 rows of {fp8_rows.head_dim} values, q of {head_dim}"
        assert kv_pool.dtype == torch.uint8, f"FP8 rows are bytes, got {kv_pool.dtype}"
    _check_rows(window_rows, n_rows, "window_rows")
    extra = extra_rows.shape[1] if extra_rows is not None else 0
    has_extra = extra > 0
    if extra_rows is not None and has_extra:
        assert extra_pool is not None
        _check_rows(extra_rows, n_rows, "extra_rows")
        assert extra_pool.dim() == 2 and extra_pool.shape[1] == row_width and extra_pool.is_contiguous()
        assert extra_pool.dtype == kv_pool.dtype, "both pools must share one dtype"
        assert extra_pool.device == q.device
    assert sinks.shape == (heads,) and sinks.dtype == torch.float32 and sinks.is_contiguous()
    assert kv_pool.device == q.device == window_rows.device == sinks.device
    scale = head_dim**-0.5 if scale is None else float(scale)
    if config is DEFAULT_CONFIG and q.dtype == torch.float32 and head_dim > FLOAT32_CONFIG.block_d \
            and not interpreting():
        config = FLOAT32_CONFIG  # narrow heads (head_dim <= 64) fit whole, as in bf16

    block_d = config.block_d or head_dim
    block_dv = config.block_dv or head_dim
    block_k = config.block_k
    assert head_dim % block_d == 0 and head_dim % block_dv == 0, "block_d / block_dv must divide head_dim"
    for width in (block_d, block_dv, block_k):
        assert width >= 16 and width & (width - 1) == 0, "tile widths must be powers of two >= 16"

    window = window_rows.shape[1]
    dv_programs = head_dim // block_dv
    splits, blocks_per_split = plan_splits(n_rows, window, extra, head_dim, q.device, config, num_splits)
    split_consts, combine_consts = launch_constexprs(heads, head_dim, extra, splits, config)

    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    if n_rows == 0:
        return out
    single = splits == 1
    if single:
        part_o = part_ml = out  # never touched: SINGLE_SPLIT stores straight to `out`
    else:
        if workspace is None:
            part_dtype = q.dtype if config.narrow_partials else torch.float32
            workspace = AttentionWorkspace.empty(n_rows, splits, heads, head_dim, q.device, part_dtype)
        assert workspace.acc.dtype in (torch.float32, q.dtype), "partials are float32 or the query dtype"
        part_o = workspace.acc.view(-1)[: n_rows * splits * heads * head_dim]
        part_ml = workspace.ml.view(-1)[: n_rows * splits * 2 * heads]
        assert part_o.numel() == n_rows * splits * heads * head_dim, "workspace too small"
        assert part_ml.numel() == n_rows * splits * 2 * heads, "workspace too small"

    fp32 = q.dtype == torch.float32 or kv_pool.dtype == torch.float32
    dot_f32 = fp32 or interpreting()
    row_consts: dict[str, Any] = {}
    if fp8_rows is not None:
        row_consts = dict(ROW_W=fp8_rows.width, KV_FP8=True, NOPE=fp8_rows.nope, ROPE_AT=fp8_rows.rope_at,
                          **fp8_constexprs(fp8_rows, head_dim, config))
    _hybrid_split_kernel[(n_rows, splits, dv_programs)](
        q,
        kv_pool,
        window_rows,
        extra_pool if has_extra else kv_pool,
        extra_rows if has_extra else window_rows,
        sinks,
        out,
        part_o,
        part_ml,
        window,
        extra,
        blocks_per_split,
        scale * LOG2E,
        float(config.rescale_threshold),
        DOT_F32=dot_f32,
        PRECISION="ieee" if fp32 else "tf32",
        **split_consts,
        **row_consts,
    )
    if combine_consts is not None:
        block_hc, block_dc = combine_consts["BLOCK_HC"], combine_consts["BLOCK_DC"]
        grid = (n_rows, host_math.cdiv(heads, block_hc), head_dim // block_dc)
        _hybrid_combine_kernel[grid](part_o, part_ml, sinks, out, splits, **combine_consts)
    return out


def hybrid_attention_decode(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    window_rows: torch.Tensor,
    extra_pool: torch.Tensor | None,
    extra_rows: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float | None = None,
    **kwargs,
) -> torch.Tensor:
    """Decode: q [B, H, d], window_rows [B, W], extra_rows [B, K] -> [B, H, d]. Split-K
    keeps the GPU busy at small B (see `hybrid_attention` for all arguments)."""
    return hybrid_attention(q, kv_pool, window_rows, extra_pool, extra_rows, sinks, scale, **kwargs)


def hybrid_attention_prefill(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    window_rows: torch.Tensor,
    extra_pool: torch.Tensor | None,
    extra_rows: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float | None = None,
    **kwargs,
) -> torch.Tensor:
    """Prefill: q [T, H, d], per-token window_rows [T, W] and extra_rows [T, K] -> [T, H, d].

    Every token is its own query row; with T rows the split heuristic settles on one
    split and the softmax is finished in the same launch. Neighbouring tokens share most
    window rows, which then come from L2."""
    return hybrid_attention(q, kv_pool, window_rows, extra_pool, extra_rows, sinks, scale, **kwargs)
