"""Fused compressor: gated window softmax, weighted sum, RMSNorm, RoPE and pool store in one pass.

One launch closes a batch of E windows (see `reference.compress_reference` for the math). The
unfused chain gathers the state rows, materialises the gate + bias, the softmax weights, the
product, the sum, the normed and the rotated entry; here each state element is read once and only
the final entry is written.

Tiling. Program (e, t) owns event e and channel tile t of `BLOCK_D` channels. It streams the
window's slots `BLOCK_S` at a time ([BLOCK_S, BLOCK_D] loads of gate, bias and kv; each slot's
tile is a contiguous run of its state row, so the loads coalesce) and keeps an online softmax per
channel (running max, running sum, running weighted sum), so the rate does not bound the register
use: m = 4 with overlap (8 slots) and m = 128 run the same loop. The overlap case folds the previous
window's first half (columns [0, d)) and then this window's second half (columns [d, 2d)).

The RMSNorm needs the whole d-channel row. With `SPLIT == 1` one program holds all channels
(`BLOCK_D >= d`, d <= 512 fits in registers) and finishes the row itself. With `SPLIT > 1` (few
events, e.g. decode, where one program per event would leave most SMs idle and a 128-slot window
is 512 KB to stream) each program writes its un-normalised tile to a float32 scratch row and bumps
a per-event arrival counter; the last program to arrive reads the row back (L2-resident, 2 KB) and
finishes it. That is the usual "last block reduces" pattern: a CTA barrier, then one acq_rel
atomic per program, so every tile's stores are visible to the finishing program. The counters are
the stream's (`common.arrivals`): the finishing program sets its counter back to zero, so no call
fills them.

Coded pools (release numerics, fixed-shape decode). With `codes` the entry is also encoded into a
pool of code bytes in the same program: it is stored to `out` in the model dtype as before (a
staging row), then, after a CTA barrier (which orders the row's global stores before the reads of
the other threads), read back and encoded by the same jitted bodies the `kv_codes` store kernels
run (`encode_fp8_row`, `encode_fp4_key`), so the codes equal `store_fp8_rows` / `store_fp4_keys`
of the staged entries bit for bit, one launch fewer per window close.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from antumbra.kernels.common import host_math
from antumbra.kernels.common.arrivals import arrival_counters, arrive, finish_arrivals
from antumbra.kernels.common.device import multiprocessor_count
from antumbra.kernels.common.interpreter import prepare
from antumbra.kernels.kv_codes.layout import Fp4Keys, Fp8Rows
from antumbra.kernels.kv_codes.triton import (
    encode_fp4_key,
    encode_fp8_row,
    fp4_key_constexprs,
    fp8_row_constexprs,
)

prepare()

MAX_HEAD_DIM = 1024
# CODE: what the entries are encoded into besides `out` (the jitted code reads the constexpr copies).
PLAIN, FP8_ROWS, FP4_KEYS = 0, 1, 2
PLAIN_CODE, FP8_CODE = tl.constexpr(PLAIN), tl.constexpr(FP8_ROWS)


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Allocation of float outputs and workspaces; tests swap in a NaN fill to catch unwritten elements."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _fold_window(
    kv_ptr,  # *f32 [R, C*D] state kv pool
    gate_ptr,  # *f32 [R, C*D] state gate pool
    rows_ptr,  # *int [M] state rows of this window's tokens (already offset to the event)
    ape_ptr,  # *f32 [M, C*D] position bias
    chan,  # [BLOCK_D] channel indices of this tile
    chan_ok,  # [BLOCK_D] chan < D
    col0,  # first column of the half this window contributes (0, or D for the overlap's Cb half)
    row_width,  # C*D, the row stride of the state pools and of ape
    run_max,
    run_sum,
    acc,
    M: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Fold the M slots of one window into the per-channel online softmax state."""
    for s0 in tl.range(0, M, BLOCK_S):
        slots = s0 + tl.arange(0, BLOCK_S)
        slot_ok = slots < M
        rows = tl.load(rows_ptr + slots, mask=slot_ok, other=0).to(tl.int64)
        mask = slot_ok[:, None] & chan_ok[None, :]
        offs = rows[:, None] * row_width + col0 + chan[None, :]
        gate = tl.load(gate_ptr + offs, mask=mask, other=float("-inf"))
        gate += tl.load(ape_ptr + slots[:, None] * row_width + col0 + chan[None, :], mask=mask, other=0.0)
        kv = tl.load(kv_ptr + offs, mask=mask, other=0.0)
        new_max = tl.maximum(run_max, tl.max(gate, axis=0))
        # Channels past D only ever see -inf; keep their max finite so exp() never meets -inf - -inf.
        new_max = tl.where(chan_ok, new_max, 0.0)
        alpha = tl.exp(run_max - new_max)
        p = tl.exp(gate - new_max[None, :])
        run_sum = run_sum * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p * kv, axis=0)
        run_max = new_max
    return run_max, run_sum, acc


@triton.jit
def _norm_rope_store(
    x,  # [BLOCK_FULL] f32 weighted sums of one entry, zero past D
    out_ptr,  # *T [Rc, D] compressed pool
    out_row,  # scalar int64 pool row of this entry
    norm_w_ptr,  # *f32 [D] RMSNorm weight
    cos_ptr,  # *f32 [E, ROPE // 2] (already offset to the event)
    sin_ptr,  # *f32 [E, ROPE // 2] (already offset to the event)
    eps,
    D: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_FULL: tl.constexpr,
):
    chan = tl.arange(0, BLOCK_FULL)
    chan_ok = chan < D
    mean_sq = tl.sum(x * x, axis=0) / D
    w = tl.load(norm_w_ptr + chan, mask=chan_ok, other=0.0)
    y = x * tl.rsqrt(mean_sq + eps) * w
    # Interleaved RoPE: split the row into its (2i, 2i+1) pairs, rotate the trailing ROPE/2 pairs.
    even, odd = tl.split(tl.reshape(y, [BLOCK_FULL // 2, 2]))
    pair = tl.arange(0, BLOCK_FULL // 2)
    rope_pair = pair - (D - ROPE) // 2
    is_rope = (rope_pair >= 0) & (pair < D // 2)
    cos = tl.load(cos_ptr + rope_pair, mask=is_rope, other=1.0)
    sin = tl.load(sin_ptr + rope_pair, mask=is_rope, other=0.0)
    y = tl.reshape(tl.join(even * cos - odd * sin, odd * cos + even * sin), [BLOCK_FULL])
    tl.store(out_ptr + out_row * D + chan, y.to(out_ptr.dtype.element_ty), mask=chan_ok)


@triton.jit
def _compress_kernel(
    kv_ptr,  # *f32 [R, C*D] state kv pool, contiguous
    gate_ptr,  # *f32 [R, C*D] state gate pool, contiguous
    src_rows_ptr,  # *int [E, M] state rows of each closing window
    prev_rows_ptr,  # *int [E, M] state rows of the previous window (read only when C == 2)
    has_prev_ptr,  # *u8 [E] nonzero when the previous window exists (read only when C == 2)
    ape_ptr,  # *f32 [M, C*D] position bias
    norm_w_ptr,  # *f32 [D] RMSNorm weight
    cos_ptr,  # *f32 [E, ROPE // 2]
    sin_ptr,  # *f32 [E, ROPE // 2]
    out_ptr,  # *T [Rc, D] compressed pool (bf16 / fp16 / fp32)
    out_rows_ptr,  # *int [E] pool row of each entry
    scratch_ptr,  # *f32 [E, D] un-normalised rows (SPLIT > 1 only)
    count_ptr,  # *i32 [E] arrival counters, zero, left zero (`common.arrivals`; SPLIT > 1 only)
    code_ptr,  # *u8 [Rp, C_WIDTH] pool of code bytes (CODE != PLAIN only)
    code_rows_ptr,  # *int [E] its row of each entry (CODE != PLAIN only)
    eps,
    D: tl.constexpr,
    M: tl.constexpr,
    C: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_FULL: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SPLIT: tl.constexpr,
    CODE: tl.constexpr,  # PLAIN, FP8_ROWS or FP4_KEYS
    # The code layout (kv_codes `fp8_row_constexprs` / `fp4_key_constexprs`; 1 where unused).
    C_NOPE: tl.constexpr,
    C_NB: tl.constexpr,
    C_NB_PAD: tl.constexpr,
    C_ROPE_PAD: tl.constexpr,
    C_ROPE_AT: tl.constexpr,
    C_LOG2N: tl.constexpr,
    C_SCALE: tl.constexpr,
    C_BLOCK: tl.constexpr,
    C_WIDTH: tl.constexpr,
    C_PAD: tl.constexpr,
):
    e = tl.program_id(0)
    chan = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    chan_ok = chan < D
    row_width = C * D
    run_max = tl.full([BLOCK_D], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    if C == 2:
        # Window w-1's first half; window -1 contributes nothing (kv = 0, gate = -inf).
        if tl.load(has_prev_ptr + e) != 0:
            run_max, run_sum, acc = _fold_window(
                kv_ptr, gate_ptr, prev_rows_ptr + e * M, ape_ptr, chan, chan_ok, 0, row_width,
                run_max, run_sum, acc, M, BLOCK_S,
            )
        col0 = D
    else:
        col0 = 0
    run_max, run_sum, acc = _fold_window(
        kv_ptr, gate_ptr, src_rows_ptr + e * M, ape_ptr, chan, chan_ok, col0, row_width,
        run_max, run_sum, acc, M, BLOCK_S,
    )
    x = tl.where(chan_ok, acc / tl.where(chan_ok, run_sum, 1.0), 0.0)
    out_row = tl.load(out_rows_ptr + e).to(tl.int64)
    half = ROPE // 2
    if SPLIT == 1:
        row = x
    else:
        tl.store(scratch_ptr + e * D + chan, x, mask=chan_ok)
        if not arrive(count_ptr + e, SPLIT):
            return  # the last program to arrive finishes the entry
        finish_arrivals(count_ptr + e)
        full = tl.arange(0, BLOCK_FULL)
        # .cg: read through L2, where the other programs' tiles are, not a stale L1 line.
        row = tl.load(scratch_ptr + e * D + full, mask=full < D, other=0.0, cache_modifier=".cg")
    _norm_rope_store(row, out_ptr, out_row, norm_w_ptr, cos_ptr + e * half, sin_ptr + e * half, eps,
                     D, ROPE, BLOCK_FULL)
    _encode(out_ptr + out_row * D, code_ptr, code_rows_ptr + e, D, ROPE, CODE, C_NOPE, C_NB, C_NB_PAD,
            C_ROPE_PAD, C_ROPE_AT, C_LOG2N, C_SCALE, C_BLOCK, C_WIDTH, C_PAD)


@triton.jit
def _encode(
    entry_ptr,  # pointer to the entry just stored [D], the model dtype
    code_ptr,
    code_row_ptr,  # pointer to the entry's code row index
    D: tl.constexpr,
    ROPE: tl.constexpr,
    CODE: tl.constexpr,
    C_NOPE: tl.constexpr,
    C_NB: tl.constexpr,
    C_NB_PAD: tl.constexpr,
    C_ROPE_PAD: tl.constexpr,
    C_ROPE_AT: tl.constexpr,
    C_LOG2N: tl.constexpr,
    C_SCALE: tl.constexpr,
    C_BLOCK: tl.constexpr,
    C_WIDTH: tl.constexpr,
    C_PAD: tl.constexpr,
):
    """Encode the staged entry into its code row (nothing for PLAIN)."""
    if CODE != PLAIN_CODE:
        tl.debug_barrier()  # the entry's stores, by every thread, precede its reads below
        base = code_ptr + tl.load(code_row_ptr).to(tl.int64) * C_WIDTH
        if CODE == FP8_CODE:
            encode_fp8_row(entry_ptr, base, D, C_NOPE, C_NB, C_NB_PAD, ROPE, C_ROPE_PAD, C_ROPE_AT, C_WIDTH,
                           C_PAD)
        else:
            encode_fp4_key(entry_ptr, base, D, C_LOG2N, C_SCALE, C_BLOCK, C_NB, C_WIDTH, C_PAD)


def plan_split(num_events: int, head_dim: int, num_sms: int) -> int:
    """Channel tiles per event: enough programs for about two per SM (`num_sms`; 0 = not a GPU,
    one tile), tiles of at least 64 channels."""
    if num_sms <= 0:
        return 1
    want = host_math.cdiv(2 * num_sms, max(num_events, 1))
    split = 1
    while split * 2 <= want and head_dim // (split * 2) >= 64:
        split *= 2
    return split


def step_events(num_tokens: int, rate: int) -> int:
    """The event count a general step of T tokens plans its split for: the windows one chunk of
    next_power_of_2(T) tokens closes. The real count depends on where the step's tokens sit in
    their windows (data); planning on it would compile a variant per count."""
    return host_math.cdiv(host_math.next_power_of_2(max(num_tokens, 1)), rate)


_NO_CODE = dict(C_NOPE=1, C_NB=1, C_NB_PAD=1, C_ROPE_PAD=1, C_ROPE_AT=1, C_LOG2N=1, C_SCALE=1.0, C_BLOCK=1,
                C_WIDTH=1, C_PAD=1)


def code_constexprs(layout: Fp8Rows | Fp4Keys | None, dtype: torch.dtype) -> dict[str, Any]:
    """CODE and the code layout's constexprs for entries of `dtype` encoded into `layout` (None: plain)."""
    if layout is None:
        return dict(CODE=PLAIN, **_NO_CODE)
    consts: dict[str, int | float]
    if isinstance(layout, Fp8Rows):
        code, consts = FP8_ROWS, dict(fp8_row_constexprs(layout, dtype))
    else:
        code, consts = FP4_KEYS, fp4_key_constexprs(layout)
    # The encoders' widths (D / N, ROPE) are the compressor's own D and ROPE; the rest take a C_ prefix.
    layout_consts = {f"C_{k}": v for k, v in consts.items() if k not in ("D", "N", "ROPE")}
    assert set(layout_consts) <= set(_NO_CODE), sorted(layout_consts)
    return dict(_NO_CODE, CODE=code, **layout_consts)


def compress_constexprs(head_dim: int, rate: int, overlap: int, rope_dim: int, split: int) -> dict[str, Any]:
    """-> the kernel's constexprs and launch options for `split` channel tiles per event (also
    returned as SPLIT: the tiles the head width needs at that tile width), for plain entries."""
    block_full = max(host_math.next_power_of_2(head_dim), 16)
    block_d = max(host_math.next_power_of_2(host_math.cdiv(head_dim, split)), 16)
    # Enough slots per step to keep ~4K elements of each operand in flight, never past the window.
    block_s = min(host_math.next_power_of_2(rate), max(1, 4096 // block_d))
    return dict(
        D=head_dim, M=rate, C=overlap, ROPE=rope_dim, BLOCK_D=block_d, BLOCK_FULL=block_full, BLOCK_S=block_s,
        SPLIT=host_math.cdiv(head_dim, block_d), num_warps=min(8, max(1, block_s * block_d // 512)),
        **code_constexprs(None, torch.float32),
    )


def compress_windows(
    state_kv: Tensor,
    state_gate: Tensor,
    src_rows: Tensor,
    prev_rows: Tensor | None,
    has_prev: Tensor | None,
    position_bias: Tensor,
    norm_weight: Tensor,
    eps: float,
    cos: Tensor,
    sin: Tensor,
    out: Tensor,
    out_rows: Tensor,
    *,
    split: int | None = None,
    plan_events: int | None = None,
    codes: tuple[Tensor, Tensor, Fp8Rows | Fp4Keys] | None = None,
) -> Tensor:
    """Close E windows and store their entries in `out` (in place; also returned).

    Same contract as `compress_reference`:
    state_kv, state_gate: [R, c*d] float32, contiguous (c = 2 with overlap, else 1).
    src_rows: [E, m] int32/int64; prev_rows: [E, m] and has_prev: [E] bool, required when c = 2.
    position_bias: [m, c*d] float32; norm_weight: [d] float32; cos, sin: [E, rope_dim // 2] float32.
    out: [Rc, d] float pool, contiguous; out_rows: [E] int32/int64. All tensors on one device.
    split: channel tiles per event (None = `plan_split` for `plan_events`, E when None; 1 = one
    program per event, no scratch). Pass `plan_events` when E depends on the data (which tokens
    close windows): the launch shape, hence the compiled variant, then follows it instead.
    codes: (pool [Rp, width] uint8, rows [E] int, layout): also encode entry e into pool row rows[e],
    as `kv_codes.store_fp8_rows` / `store_fp4_keys` of `out[out_rows]` would (module docstring).
    """
    num_events, rate = src_rows.shape
    d = out.shape[1]
    width = state_kv.shape[1]
    overlap = width // d
    half = cos.shape[-1]
    assert overlap in (1, 2) and width == overlap * d, f"state width {width} is not c*d for d={d}"
    assert state_kv.dtype == state_gate.dtype == torch.float32, "state pools must be float32"
    assert state_gate.shape == state_kv.shape and state_kv.is_contiguous() and state_gate.is_contiguous()
    assert position_bias.shape == (rate, width) and position_bias.dtype == torch.float32
    assert norm_weight.shape == (d,) and norm_weight.dtype == torch.float32
    assert cos.shape == sin.shape == (num_events, half) and cos.dtype == sin.dtype == torch.float32
    assert 0 < 2 * half <= d and d % 2 == 0 and d <= MAX_HEAD_DIM, f"rope_dim {2 * half} / head_dim {d}"
    assert out.dim() == 2 and out.is_contiguous() and out.is_floating_point()
    assert out_rows.shape == (num_events,) and not out_rows.is_floating_point()
    assert not src_rows.is_floating_point()
    if overlap == 2:
        assert prev_rows is not None and has_prev is not None, "overlap needs prev_rows and has_prev"
        assert prev_rows.shape == src_rows.shape and has_prev.shape == (num_events,)
        assert has_prev.dtype == torch.bool
        prev_rows = prev_rows.contiguous()
        has_prev_u8 = has_prev.contiguous().view(torch.uint8)
    else:
        prev_rows, has_prev_u8 = src_rows, src_rows  # never read
    if num_events == 0:
        return out
    src_rows, out_rows = src_rows.contiguous(), out_rows.contiguous()
    position_bias, norm_weight = position_bias.contiguous(), norm_weight.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()

    if split is None:
        events = num_events if plan_events is None else plan_events
        split = plan_split(events, d, multiprocessor_count(out.device, off_gpu=0))
    consts = compress_constexprs(d, rate, overlap, 2 * half, split)
    if codes is not None:
        code_pool, code_rows, layout = codes
        assert code_pool.dtype == torch.uint8 and code_pool.is_contiguous()
        assert code_pool.shape[1] == layout.width
        assert code_rows.shape == (num_events,) and not code_rows.is_floating_point()
        assert layout.head_dim == d and (not isinstance(layout, Fp8Rows) or layout.rope_dim == 2 * half)
        consts.update(code_constexprs(layout, out.dtype))
        code_rows = code_rows.contiguous()
    else:
        code_pool, code_rows = out, out_rows  # never read
    if consts["SPLIT"] > 1:
        scratch = _empty(num_events, d, dtype=torch.float32, device=out.device)
        counters = arrival_counters(out.device, num_events)
    else:
        scratch, counters = out, out  # never read
    _compress_kernel[(num_events, consts["SPLIT"])](
        state_kv, state_gate, src_rows, prev_rows, has_prev_u8, position_bias, norm_weight, cos, sin,
        out, out_rows, scratch, counters, code_pool, code_rows, float(eps), **consts,
    )
    return out
