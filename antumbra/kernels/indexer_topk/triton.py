"""Lightning-indexer scores fused with an exact top-k, as Triton kernels.

Semantics: `reference.indexer_topk_reference` (scores, then the k best valid candidates
as pool rows, -1 padded).

Two launches per call, B query rows of N candidate slots, k picks:

1. Score (`_indexer_score_kernel`, grid (B, G)). Each program owns a run of
   BLOCK_N-candidate blocks of one row: it gathers the candidates' key rows [BLOCK_N, di],
   multiplies them by the row's queries [di, Hi] (one tensor-core product for all heads),
   applies ReLU, the head weights and the scale, and writes each score as an
   order-preserving uint32 key (4 bytes per candidate, against 2 * di bytes of key row
   read). It also histograms a coarse bucket of every valid score (below) in registers
   and adds that histogram once per program into a per-row global histogram.
   `topk_rows` runs `_score_keys_kernel` instead: the same keys and histogram from
   precomputed fp32 scores.
2. Filter (`_topk_filter_kernel`, grid (B, G)). Every program reads its row's finished
   coarse histogram and derives the same threshold bucket t: buckets above t hold fewer
   than k candidates, buckets >= t at least k. It then streams its slice of keys:
   candidates in buckets > t are certainly chosen and are appended to the row's
   selection list; candidates in bucket t are appended, with their exact keys, to the
   row's tie list. The last program of the row to finish (an atomic counter; no
   program ever waits for another) resolves the tie list exactly, sorts the selection by
   candidate index, writes the pool rows, and zeroes the row's histogram and counters for
   the next call. A tie list of up to `finish_regs` entries is loaded once and resolved in
   registers by `kth_largest` (at the smallest of four capacities that holds it); a longer
   one is streamed from memory once per byte-wise radix pass.

FP4 keys (release numerics, `fp4_keys`): the pool rows are e2m1 codes two a byte plus one UE8M0
byte per 32 channels (68 bytes at di = 128 against 256 in bf16). The score kernel gathers the
bytes, decodes the low nibbles (even channels) and the high nibbles (odd channels) in registers
and takes two products of di / 2, against the even and the odd query channels.

Coarse bucket: the top COARSE_BITS bits of the order-preserving 16-bit key of the score
rounded to fp16 (sign, 5 exponent bits, then mantissa bits: 4 buckets per binade at the
default 8 bits, 32 at 11). Rounding is monotone, so a higher bucket means a strictly
higher score and each bucket is an interval of scores; with fp32 keys alone, scores of
one binade would share a top byte and the tie list would hold most of the row.

Order-preserving keys: for an fp32 score with bits u, key = ~u if the sign is set, else
u | 0x80000000; larger key <=> larger score. Both zeros map to the key of +0.0, so -0.0
and +0.0 tie as they do under `torch.topk`. Finite scores get keys >= 2^23, so key 0
marks an invalid candidate.

Ties: among candidates whose score equals the k-th largest, the lowest candidate
indices j win (after the score bytes, the radix continues over the bytes of ~j).
Output order within a row: ascending candidate index, then -1 padding.

Cost notes: `tl.histogram` lowers to warp ballots whose cost grows with the bins each
lane owns, and every call then merges each warp's whole histogram into shared memory with
atomics, so a call costs about as much per bin as per element. With 2048 bins and blocks
of 64 candidates the merges dominated the score kernel, hence 256 bins and blocks of 256
(TUNING.md has the measurements). The tie list is
small when scores are spread out (~1-2% of the row at 8 bits); if most of a row shares
one fp16 value, the finishing program streams a long list (correct, slower).

A wide `tl.histogram` in one program is costly, which is why the finishing program searches with
32 bins a pass. One program selecting a whole row in registers (no atomics, no sort) was tried and
was slower everywhere: a single program's serial passes cost more than the second launch they
save. TUNING.md has the figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from antumbra.kernels.common import host_math
from antumbra.kernels.common.arrivals import arrival_counters
from antumbra.kernels.common.codecs import e2m1_times_2pow14
from antumbra.kernels.common.device import multiprocessor_count
from antumbra.kernels.common.interpreter import interpreting, prepare
from antumbra.kernels.kv_codes.layout import Fp4Keys

NUM_COUNTERS = 4  # per row: selection length, tie-list length, finished programs, spare


prepare()


@dataclass(frozen=True)
class TopkConfig:
    # Coarse histogram of 2^coarse_bits buckets (8..11). Each `tl.histogram` call merges every
    # warp's full histogram, so its cost grows with the bins: 8 bits keep the score kernel near
    # its memory time, at the price of longer tie lists for the finishing program.
    coarse_bits: int = 8
    score_block_n: int = 256  # candidates per score block
    score_warps: int = 8
    score_stages: int = 3
    filter_block_n: int = 1024  # keys per filter step
    filter_warps: int = 8
    finish_block_n: int = 2048  # tie-list entries per step of the finishing program
    programs_per_sm: int = 2  # score / filter programs per multiprocessor, over all rows
    keys_block_n: int = 256  # candidates per step of the keys kernel (`topk_rows`)
    # Tie lists up to this length (a power of two >= 256) are resolved by the finishing program in
    # registers (one load, radix passes without memory traffic); longer ones are streamed from
    # memory per pass.
    finish_regs: int = 4096
    tie_log_splits: int = 5  # bins per pass of the tie-list search (`kth_largest`)
    # The one-launch select (`onepass.topk_rows` on a GPU): `onepass` turns it on;
    # `onepass_slice` is the candidate slots per program (0: by the row's length, `onepass.auto_slice`).
    # Tie lists of at most `rank_own_max` entries, or of more than `rank_all` (a power of two, or 0),
    # are ranked by their owners (a third barrier), `rank_tie_block` entries against
    # `rank_list_block` at once; the others are searched whole by every program.
    onepass: bool = True
    onepass_slice: int = 0
    rank_all: int = 2048
    rank_own_max: int = 256
    rank_tie_block: int = 64
    rank_list_block: int = 128


DEFAULT_CONFIG = TopkConfig()


@dataclass
class TopkWorkspace:
    """Scratch of one call; keep one per shape to launch without allocations or memsets
    (CUDA graphs). `hist` and `counters` must be zero when a call starts; the finishing
    programs zero them again, so a kept workspace is ready for the next call."""

    keys: torch.Tensor  # [B, N] int32 order-preserving score keys, 0 = invalid
    tie_keys: torch.Tensor  # [B, N] int32 keys of the candidates in the threshold bucket
    tie_index: torch.Tensor  # [B, N] int32 their candidate indices
    selected: torch.Tensor  # [B, K_PAD] int32 chosen candidate indices
    hist: torch.Tensor  # [B, 2^coarse_bits] int32 coarse-bucket histogram of valid keys
    counters: torch.Tensor  # [B, 4] int32 see NUM_COUNTERS

    @staticmethod
    def allocate(
        rows: int,
        num_candidates: int,
        k: int,
        device: torch.device | str,
        coarse_bits: int = DEFAULT_CONFIG.coarse_bits,
    ) -> TopkWorkspace:
        def scratch(width: int) -> torch.Tensor:
            return torch.empty(rows, width, dtype=torch.int32, device=device)

        # hist and counters come from the stream's zeroed buffer (the finishing programs leave it
        # zero), so a call needs no fill: two launches a call at decode sizes otherwise.
        bins = 1 << coarse_bits
        zeroed = arrival_counters(torch.device(device), rows * (bins + NUM_COUNTERS), purpose="indexer_topk")
        return TopkWorkspace(
            keys=scratch(num_candidates),
            tie_keys=scratch(num_candidates),
            tie_index=scratch(num_candidates),
            selected=scratch(host_math.next_power_of_2(k)),
            hist=zeroed[: rows * bins].view(rows, bins),
            counters=zeroed[rows * bins :].view(rows, NUM_COUNTERS),
        )


# ----------------------------------------------------------------------------- helpers


@triton.jit
def sortable_key(score):
    """fp32 [BLOCK] -> uint32 [BLOCK], monotone in the score; both zeros share one key."""
    bits = score.to(tl.uint32, bitcast=True)
    bits = tl.where(score == 0.0, 0, bits)
    return tl.where((bits & 0x80000000) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _score_of_key(key):
    """Inverse of `sortable_key` for valid keys: uint32 [BLOCK] -> fp32 [BLOCK]."""
    bits = tl.where((key & 0x80000000) != 0, key & 0x7FFFFFFF, key ^ 0xFFFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def coarse_bucket(score, COARSE_BITS: tl.constexpr):
    """fp32 [BLOCK] -> int32 [BLOCK] in [0, 2^COARSE_BITS), monotone in the score: the top
    bits of the order-preserving key of the score rounded to fp16."""
    half = score.to(tl.float16)
    bits = half.to(tl.uint16, bitcast=True).to(tl.uint32)
    bits = tl.where(half == 0.0, 0, bits)
    key16 = tl.where((bits & 0x8000) != 0, bits ^ 0xFFFF, bits | 0x8000)
    return (key16 >> (16 - COARSE_BITS)).to(tl.int32)


@triton.jit
def pick_bucket(hist, k_rem, NUM_BINS: tl.constexpr):
    """hist: [NUM_BINS] int32 counts of still-undecided candidates per bucket, with
    1 <= k_rem <= sum(hist) of them still wanted.
    -> (bucket holding the k_rem-th largest, count strictly above it, count in it)."""
    bins = tl.arange(0, NUM_BINS)
    at_or_above = tl.cumsum(hist, 0, reverse=True)  # candidates in buckets >= bin
    bucket = tl.max(tl.where(at_or_above >= k_rem, bins, -1), 0)
    above = tl.sum(tl.where(bins > bucket, hist, 0), 0)
    in_bucket = tl.sum(tl.where(bins == bucket, hist, 0), 0)
    return bucket, above, in_bucket


@triton.jit
def _append(list_ptr, counter_ptr, flags, values, list2_ptr, values2, PAIR: tl.constexpr):
    """Append values[flags] (and values2[flags] at the same places of a second list when
    PAIR) at the end of a list shared by all programs of a row: one atomic reserves the
    range, a scan places each entry. list_ptr / list2_ptr: [capacity] int32;
    counter_ptr: int32 length of the list."""
    n = tl.sum(flags.to(tl.int32), 0)
    if n > 0:
        base = tl.atomic_add(counter_ptr, n, sem="relaxed")
        pos = base + tl.cumsum(flags.to(tl.int32), 0) - 1
        tl.store(list_ptr + pos, values, mask=flags)
        if PAIR:
            tl.store(list2_ptr + pos, values2, mask=flags)


@triton.jit
def row_limit(ncand_ptr, b, N, HAS_NCAND: tl.constexpr):
    """Valid prefix length of row b: its count when counts are given, else N."""
    limit = N
    if HAS_NCAND:
        limit = tl.minimum(tl.load(ncand_ptr + b), N)
    return limit


@triton.jit
def _live_blocks(limit, g, blocks_per_prog, BLOCK_N: tl.constexpr):
    """Blocks of program g's run that start below `limit`, the row's valid prefix.

    A run's blocks past the prefix are skipped: the score and keys kernels leave their keys
    unwritten and the filter never reads them (it stops at the same prefix). A causal prefill's rows
    hold from none to all of the step's N slots, so this skips about a third of a 16K prompt's score
    work in 8192-token steps, and in a decode graph sized for the longest context, every slot past
    each row's own context."""
    first = g * blocks_per_prog * BLOCK_N
    return tl.minimum(tl.maximum(tl.cdiv(limit - first, BLOCK_N), 0), blocks_per_prog)


@triton.jit
def _tie_histogram(
    tie_key_ptr,  # [M] int32 tie-list keys of this row
    tie_idx_ptr,  # [M] int32 tie-list candidate indices of this row
    M,  # tie-list length
    key_mask,  # uint32: decided bits of the key
    key_prefix,  # uint32: their value
    rank_mask,  # uint32: decided bits of ~index
    rank_prefix,  # uint32: their value
    SHIFT: tl.constexpr,  # byte of the field to histogram
    ON_INDEX: tl.constexpr,  # histogram ~index instead of the key
    BLOCK: tl.constexpr,
):
    hist = tl.zeros([256], tl.int32)
    for start in range(0, M, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < M
        key = tl.load(tie_key_ptr + offs, mask=inside, other=0, cache_modifier=".cg").to(
            tl.uint32, bitcast=True
        )
        rank = (
            tl.load(tie_idx_ptr + offs, mask=inside, other=0, cache_modifier=".cg").to(tl.uint32) ^ 0xFFFFFFFF
        )
        live = inside & ((key & key_mask) == key_prefix) & ((rank & rank_mask) == rank_prefix)
        if ON_INDEX:
            field = rank
        else:
            field = key
        hist += tl.histogram(((field >> SHIFT) & 0xFF).to(tl.int32), 256, mask=live)
    return hist


@triton.jit
def _resolve_ties_in_registers(
    tk_ptr,  # [M] int32 tie-list keys of this row
    ti_ptr,  # [M] int32 tie-list candidate indices of this row
    sel_row_ptr,  # [K_PAD] int32 selection list of this row; chosen entries go to n_sel, n_sel + 1, ...
    M,  # tie-list length, <= CAP
    n_sel,  # entries already in the selection list
    k_rem,  # entries still wanted from the tie list, 0 < k_rem < M
    CAP: tl.constexpr,
    LOG_SPLITS: tl.constexpr,
):
    """Exact choice of the k_rem largest (key, ~index) pairs of a tie list held in registers: one load,
    the k_rem-th largest key by `kth_largest`, then, among the entries holding it, the lowest
    candidate indices (the list is in no particular order: a second search, over ~index)."""
    offs = tl.arange(0, CAP)
    inside = offs < M
    key = tl.load(tk_ptr + offs, mask=inside, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
    idx = tl.load(ti_ptr + offs, mask=inside, other=0, cache_modifier=".cg")
    key64 = key.to(tl.int64)
    kth = kth_largest(key64, inside, k_rem, LOG_SPLITS)
    chosen = inside & (key64 > kth)
    tied = inside & (key64 == kth)
    wanted = k_rem - tl.sum(chosen.to(tl.int32), 0)  # >= 1
    if tl.sum(tied.to(tl.int32), 0) > wanted:
        rank = (idx.to(tl.uint32) ^ 0xFFFFFFFF).to(tl.int64)
        chosen = chosen | (tied & (rank >= kth_largest(rank, tied, wanted, LOG_SPLITS)))
    else:
        chosen = chosen | tied
    flags = chosen.to(tl.int32)
    pos = n_sel + tl.cumsum(flags, 0) - 1
    tl.store(sel_row_ptr + pos, idx, mask=chosen)


@triton.jit
def _finish_row(
    b,  # row
    tie_key_ptr,  # [B, N] int32 tie-list keys
    tie_idx_ptr,  # [B, N] int32 tie-list candidate indices
    sel_ptr,  # [B, K_PAD] int32 selection list (candidate indices)
    hist_ptr,  # [B, NUM_BINS] int32 coarse histogram, zeroed here
    counter_ptr,  # [B, 4] int32 counters, zeroed here
    cand_ptr,  # [B, N] int32 candidate pool rows
    out_ptr,  # [B, k] int32 output pool rows
    N,
    k,
    n_take,  # picks this row will get: min(k, valid candidates)
    NUM_BINS: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    REGS: tl.constexpr,  # tie lists up to this long are resolved in registers
    LOG_SPLITS: tl.constexpr,
):
    """Resolve the tie list exactly, then write the sorted selection; run by the last
    program of row b, after every program of the row has appended its candidates."""
    n_sel = tl.load(counter_ptr + b * 4, cache_modifier=".cg")
    M = tl.load(counter_ptr + b * 4 + 1, cache_modifier=".cg")
    k_rem = n_take - n_sel  # still wanted from the tie list; 0 <= k_rem <= M
    tk_ptr = tie_key_ptr + b * N
    ti_ptr = tie_idx_ptr + b * N
    # Register resolution at the smallest of four capacities that holds the list (its cost
    # grows with the capacity, not with M).
    open_regs = (k_rem > 0) & (k_rem < M)
    if open_regs & (M <= REGS // 16):
        _resolve_ties_in_registers(tk_ptr, ti_ptr, sel_ptr + b * K_PAD, M, n_sel, k_rem, REGS // 16,
                                   LOG_SPLITS)
        open_regs = False
        k_rem = 0  # done: skip the streaming paths below
        M = 0
    if open_regs & (M <= REGS // 4):
        _resolve_ties_in_registers(tk_ptr, ti_ptr, sel_ptr + b * K_PAD, M, n_sel, k_rem, REGS // 4,
                                   LOG_SPLITS)
        open_regs = False
        k_rem = 0
        M = 0
    if open_regs & (M <= REGS // 2):
        _resolve_ties_in_registers(tk_ptr, ti_ptr, sel_ptr + b * K_PAD, M, n_sel, k_rem, REGS // 2,
                                   LOG_SPLITS)
        open_regs = False
        k_rem = 0
        M = 0
    if open_regs & (M <= REGS):
        _resolve_ties_in_registers(tk_ptr, ti_ptr, sel_ptr + b * K_PAD, M, n_sel, k_rem, REGS,
                                   LOG_SPLITS)
        k_rem = 0
        M = 0

    # Lexicographic threshold on (key, ~index); entries matching the decided bits are
    # still tied. ~index makes the lowest candidate index the largest.
    key_mask = tl.full([], 0, tl.uint32)
    key_prefix = tl.full([], 0, tl.uint32)
    rank_mask = tl.full([], 0, tl.uint32)
    rank_prefix = tl.full([], 0, tl.uint32)
    open_ = (k_rem > 0) & (k_rem < M)
    if open_:
        # Bytes on which every tie-list key agrees need no pass.
        k_min = tl.full([], 0xFFFFFFFF, tl.uint32)
        k_max = tl.full([], 0, tl.uint32)
        for start in range(0, M, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            key = tl.load(tk_ptr + offs, mask=offs < M, other=0, cache_modifier=".cg").to(
                tl.uint32, bitcast=True
            )
            k_min = tl.minimum(k_min, tl.min(tl.where(offs < M, key, 0xFFFFFFFF), 0))
            k_max = tl.maximum(k_max, tl.max(key, 0))
        for field in tl.static_range(2):  # 0: the key's bytes, 1: the bytes of ~index
            for byte in tl.static_range(4):
                if open_:
                    constant = False
                    if field == 0:
                        constant = ((k_min >> (24 - 8 * byte)) & 0xFF) == ((k_max >> (24 - 8 * byte)) & 0xFF)
                    if constant:
                        digit = ((k_min >> (24 - 8 * byte)) & 0xFF).to(tl.int32)
                        above = tl.full([], 0, tl.int32)
                    else:
                        hist = _tie_histogram(
                            tk_ptr,
                            ti_ptr,
                            M,
                            key_mask,
                            key_prefix,
                            rank_mask,
                            rank_prefix,
                            24 - 8 * byte,
                            field == 1,
                            BLOCK,
                        )
                        digit, above, in_bucket = pick_bucket(hist, k_rem, 256)
                        open_ = in_bucket > k_rem - above
                    if field == 1:
                        rank_prefix = rank_prefix | (digit.to(tl.uint32) << (24 - 8 * byte))
                        rank_mask = rank_mask | tl.full([], 0xFF << (24 - 8 * byte), tl.uint32)
                    else:
                        key_prefix = key_prefix | (digit.to(tl.uint32) << (24 - 8 * byte))
                        key_mask = key_mask | tl.full([], 0xFF << (24 - 8 * byte), tl.uint32)
                    k_rem = k_rem - above
        # Chosen: (key, ~index) at or above the decided prefix. The walk stops only when
        # the entries tied at the prefix are exactly the ones still wanted.
        written = n_sel
        for start in range(0, M, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < M
            key = tl.load(tk_ptr + offs, mask=inside, other=0, cache_modifier=".cg").to(
                tl.uint32, bitcast=True
            )
            idx = tl.load(ti_ptr + offs, mask=inside, other=0, cache_modifier=".cg")
            rank = idx.to(tl.uint32) ^ 0xFFFFFFFF
            kt = key & key_mask
            rt = rank & rank_mask
            chosen = inside & ((kt > key_prefix) | ((kt == key_prefix) & (rt >= rank_prefix)))
            flags = chosen.to(tl.int32)
            pos = written + tl.cumsum(flags, 0) - 1
            tl.store(sel_ptr + b * K_PAD + pos, idx, mask=chosen)
            written += tl.sum(flags, 0)
    else:
        if k_rem > 0:  # the whole tie list is wanted
            for start in range(0, M, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                idx = tl.load(ti_ptr + offs, mask=offs < M, other=0, cache_modifier=".cg")
                tl.store(sel_ptr + b * K_PAD + n_sel + offs, idx, mask=offs < M)

    tl.debug_barrier()  # the selection list is re-read by other threads below
    offs_k = tl.arange(0, K_PAD)
    picked = tl.load(
        sel_ptr + b * K_PAD + offs_k, mask=offs_k < n_take, other=0x7FFFFFFF, cache_modifier=".cg"
    )
    picked = tl.sort(picked)
    rows = tl.load(cand_ptr + b * N + picked, mask=offs_k < n_take, other=-1)
    tl.store(out_ptr + b * k + offs_k, rows, mask=offs_k < k)  # K_PAD >= k: -1 past n_take

    bins = tl.arange(0, NUM_BINS)
    tl.store(hist_ptr + b * NUM_BINS + bins, tl.zeros([NUM_BINS], tl.int32))
    tl.store(counter_ptr + b * 4 + tl.arange(0, 4), tl.zeros([4], tl.int32))


@triton.jit
def kth_largest(values, live, want, LOG_SPLITS: tl.constexpr):
    """values: [BLOCK] int64 in [0, 2^32); live: [BLOCK] bool; 1 <= want <= count(live).
    -> the want-th largest live value (int64 scalar).

    A search on an interval [lo, hi] that holds the answer: count(live, v >= lo) >= want and
    count(live, v > hi) < want. Each pass splits it into SPLITS bins of 2^shift values, counts the
    bins with one small histogram, keeps the bin holding the want-th largest and shrinks to the live
    values inside it, so the interval narrows by SPLITS / 2 or more a pass (at most 8 passes over
    32-bit keys at 32 splits, typically 3-5) and no pass needs a histogram of more than SPLITS bins
    (`tl.histogram`'s cost grows with its bins)."""
    SPLITS: tl.constexpr = 1 << LOG_SPLITS
    far = tl.full([], 1 << 40, tl.int64)
    lo = tl.min(tl.where(live, values, far), 0)
    hi = tl.max(tl.where(live, values, -1), 0)
    above = tl.full([], 0, tl.int32)  # live values > hi
    bins = tl.arange(0, SPLITS)
    while lo < hi:
        width = hi - lo
        shift = tl.maximum(tl.log2(width.to(tl.float32)).to(tl.int32) + 1 - LOG_SPLITS, 0).to(tl.int64)
        shift = tl.where((width >> shift) >= SPLITS, shift + 1, shift)
        in_range = live & (values >= lo) & (values <= hi)
        hist = tl.histogram(((values - lo) >> shift).to(tl.int32), SPLITS, mask=in_range)
        at_or_above = tl.cumsum(hist, 0, reverse=True) + above  # live values >= lo + (bin << shift)
        pick = tl.max(tl.where(at_or_above >= want, bins, -1), 0)
        above += tl.sum(tl.where(bins > pick, hist, 0), 0)
        bin_lo = lo + (pick.to(tl.int64) << shift)
        bin_hi = tl.minimum(hi, bin_lo + (tl.full([], 1, tl.int64) << shift) - 1)
        in_bin = live & (values >= bin_lo) & (values <= bin_hi)
        lo = tl.min(tl.where(in_bin, values, far), 0)
        hi = tl.max(tl.where(in_bin, values, -1), 0)
    return lo


@triton.jit
def _fp4_key_halves(
    keys_pool_ptr, rows, valid, offs_j, KEY_W: tl.constexpr, HALF: tl.constexpr, VDT: tl.constexpr
):
    """Gathered FP4 keys -> (even channels [BLOCK_N, HALF], odd channels [BLOCK_N, HALF]) in VDT.

    Byte j of a key holds channels 2j (low nibble) and 2j + 1 (high); both share the exponent byte
    of their 32-channel block, at HALF + 2j // 32. Decoded exactly (e2m1 times a power of two), so
    the values equal `kv_rows.decode_index` of the rows."""
    row_off = rows.to(tl.int64)[:, None] * KEY_W
    packed = tl.load(keys_pool_ptr + row_off + offs_j[None, :], mask=valid[:, None], other=0).to(tl.int32)
    exp_at = HALF + (2 * offs_j[None, :]) // 32
    exps = tl.load(keys_pool_ptr + row_off + exp_at, mask=valid[:, None], other=127)
    scale = (exps.to(tl.int32) << 23).to(tl.float32, bitcast=True) * 16384.0  # codes come times 2^-14
    even = (e2m1_times_2pow14(packed & 15) * scale).to(VDT)
    odd = (e2m1_times_2pow14(packed >> 4) * scale).to(VDT)
    return even, odd


@triton.jit
def _dot_keys(k_tile, q_tile, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """[BLOCK_N, C] x [BLOCK_HI, C] -> [BLOCK_N, BLOCK_HI] fp32 logits."""
    if DOT_F32:
        # fp32 inputs, and the CPU interpreter, whose dot does not understand bf16.
        logits = tl.dot(k_tile.to(tl.float32), tl.trans(q_tile.to(tl.float32)), input_precision=PRECISION)
    else:
        logits = tl.dot(k_tile, tl.trans(q_tile), input_precision=PRECISION)
    return logits


# ----------------------------------------------------------------------------- kernels


# Candidate counts, picks and trip counts follow the request's context: not specialised (they
# bound loops and masks), so only the model's widths and the bucketed tiles pick a variant.
@triton.jit(do_not_specialize=["N", "blocks_per_prog"])
def _indexer_score_kernel(
    q_ptr,  # [B, HI, DI] indexer queries, contiguous (bf16 or fp32)
    w_ptr,  # [B, HI] fp32 head weights, contiguous
    keys_pool_ptr,  # [Rc, DI] indexer key pool, contiguous, q's dtype; [Rc, KEY_W] bytes with KEYS_FP4
    cand_ptr,  # [B, N] int32 candidate pool rows, -1 = not a candidate
    ncand_ptr,  # [B] int32 valid prefix length of each row (read only when HAS_NCAND)
    skey_ptr,  # [B, N] int32 out: order-preserving key of each score, 0 = invalid
    hist_ptr,  # [B, NUM_BINS] int32 in/out: coarse-bucket histogram, accumulated atomically
    N,  # candidate slots per row
    blocks_per_prog,  # BLOCK_N blocks each program walks
    scale,  # index_head_dim^-0.5
    HI: tl.constexpr,
    DI: tl.constexpr,
    BLOCK_HI: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COARSE_BITS: tl.constexpr,
    HAS_NCAND: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    KEYS_FP4: tl.constexpr = False,  # keys as packed e2m1 codes + UE8M0 bytes (`kv_codes.Fp4Keys`)
    KEY_W: tl.constexpr = 0,  # FP4 keys: bytes a key
):
    NUM_BINS: tl.constexpr = 1 << COARSE_BITS
    HALF: tl.constexpr = DI // 2
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_HI)
    h_mask = offs_h < HI
    offs_d = tl.arange(0, DI)
    offs_j = tl.arange(0, HALF)
    q_row = q_ptr + b * HI * DI + offs_h[:, None] * DI
    if KEYS_FP4:
        # The key bytes hold channel pairs: the even and odd query channels are loaded apart (two
        # strided loads of a small resident tile) and the two halves summed, never interleaved back.
        q_tile = tl.load(q_row + 2 * offs_j[None, :], mask=h_mask[:, None], other=0.0)
        q_odd = tl.load(q_row + 2 * offs_j[None, :] + 1, mask=h_mask[:, None], other=0.0)
    else:
        q_tile = tl.load(q_row + offs_d[None, :], mask=h_mask[:, None], other=0.0)
        q_odd = q_tile  # unused
    w_row = tl.load(w_ptr + b * HI + offs_h, mask=h_mask, other=0.0)  # 0 for padded heads
    limit = row_limit(ncand_ptr, b, N, HAS_NCAND)
    num_blocks = _live_blocks(limit, g, blocks_per_prog, BLOCK_N)

    hist = tl.zeros([NUM_BINS], tl.int32)
    for i in range(0, num_blocks):
        offs = (g * blocks_per_prog + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.load(cand_ptr + b * N + offs, mask=offs < limit, other=-1)
        valid = rows >= 0
        if KEYS_FP4:
            vdt = q_ptr.dtype.element_ty
            even, odd = _fp4_key_halves(keys_pool_ptr, rows, valid, offs_j, KEY_W, HALF, vdt)
            logits = _dot_keys(even, q_tile, DOT_F32, PRECISION) + _dot_keys(odd, q_odd, DOT_F32, PRECISION)
        else:
            k_tile = tl.load(
                keys_pool_ptr + rows.to(tl.int64)[:, None] * DI + offs_d[None, :], mask=valid[:, None],
                other=0.0,
            )  # [BLOCK_N, DI] gathered key rows
            logits = _dot_keys(k_tile, q_tile, DOT_F32, PRECISION)  # [BLOCK_N, BLOCK_HI]
        score = tl.sum(tl.maximum(logits, 0.0) * w_row[None, :], 1) * scale
        key = tl.where(valid, sortable_key(score), 0)
        tl.store(skey_ptr + b * N + offs, key.to(tl.int32, bitcast=True), mask=offs < limit)
        hist += tl.histogram(coarse_bucket(score, COARSE_BITS), NUM_BINS, mask=valid)
    bins = tl.arange(0, NUM_BINS)
    tl.atomic_add(hist_ptr + b * NUM_BINS + bins, hist, mask=hist > 0, sem="relaxed")


@triton.jit(do_not_specialize=["N", "blocks_per_prog"])
def _score_keys_kernel(
    scores_ptr,  # [B, N] fp32 precomputed scores, contiguous
    cand_ptr,  # [B, N] int32 candidate pool rows, -1 = not a candidate
    ncand_ptr,  # [B] int32 valid prefix length of each row (read only when HAS_NCAND)
    skey_ptr,  # [B, N] int32 out: order-preserving key of each score, 0 = invalid
    hist_ptr,  # [B, NUM_BINS] int32 in/out: coarse-bucket histogram, accumulated atomically
    N,  # candidate slots per row
    blocks_per_prog,  # BLOCK_N blocks each program walks
    BLOCK_N: tl.constexpr,
    COARSE_BITS: tl.constexpr,
    HAS_NCAND: tl.constexpr,
):
    NUM_BINS: tl.constexpr = 1 << COARSE_BITS
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    limit = row_limit(ncand_ptr, b, N, HAS_NCAND)
    num_blocks = _live_blocks(limit, g, blocks_per_prog, BLOCK_N)
    hist = tl.zeros([NUM_BINS], tl.int32)
    for i in range(0, num_blocks):
        offs = (g * blocks_per_prog + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.load(cand_ptr + b * N + offs, mask=offs < limit, other=-1)
        valid = rows >= 0
        score = tl.load(scores_ptr + b * N + offs, mask=valid, other=0.0)
        key = tl.where(valid, sortable_key(score), 0)
        tl.store(skey_ptr + b * N + offs, key.to(tl.int32, bitcast=True), mask=offs < N)
        hist += tl.histogram(coarse_bucket(score, COARSE_BITS), NUM_BINS, mask=valid)
    bins = tl.arange(0, NUM_BINS)
    tl.atomic_add(hist_ptr + b * NUM_BINS + bins, hist, mask=hist > 0, sem="relaxed")


@triton.jit(do_not_specialize=["N", "k", "blocks_per_prog"])
def _topk_filter_kernel(
    skey_ptr,  # [B, N] int32 order-preserving keys, 0 = invalid
    tie_key_ptr,  # [B, N] int32 out: tie-list keys (first counters[b, 1] entries)
    tie_idx_ptr,  # [B, N] int32 out: tie-list candidate indices
    sel_ptr,  # [B, K_PAD] int32 out: selection list (candidate indices)
    hist_ptr,  # [B, NUM_BINS] int32 finished coarse histogram; zeroed by the finishing program
    counter_ptr,  # [B, 4] int32 zero on entry: selected, tie-list length, finished programs
    cand_ptr,  # [B, N] int32 candidate pool rows
    ncand_ptr,  # [B] int32 valid prefix length of each row (read only when HAS_NCAND)
    out_ptr,  # [B, k] int32 out: chosen pool rows in candidate order, then -1
    N,  # candidate slots per row
    k,  # picks per row
    blocks_per_prog,  # BLOCK_N blocks each program walks
    COARSE_BITS: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FINISH_BLOCK: tl.constexpr,
    FINISH_REGS: tl.constexpr,
    LOG_SPLITS: tl.constexpr,
    HAS_NCAND: tl.constexpr,
):
    NUM_BINS: tl.constexpr = 1 << COARSE_BITS
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    hist = tl.load(hist_ptr + b * NUM_BINS + tl.arange(0, NUM_BINS), cache_modifier=".cg")
    n_valid = tl.sum(hist, 0)
    n_take = tl.minimum(n_valid, k)
    threshold = tl.full([], -1, tl.int32)  # every valid candidate is chosen
    if n_valid > k:
        threshold, _above, _in_bucket = pick_bucket(hist, k, NUM_BINS)

    limit = row_limit(ncand_ptr, b, N, HAS_NCAND)
    num_blocks = _live_blocks(limit, g, blocks_per_prog, BLOCK_N)
    for i in range(0, num_blocks):
        offs = (g * blocks_per_prog + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        key = tl.load(skey_ptr + b * N + offs, mask=offs < limit, other=0).to(tl.uint32, bitcast=True)
        valid = key != 0
        bucket = coarse_bucket(_score_of_key(key), COARSE_BITS)
        _append(
            sel_ptr + b * K_PAD, counter_ptr + b * 4, valid & (bucket > threshold), offs, sel_ptr, offs, False
        )
        _append(
            tie_key_ptr + b * N,
            counter_ptr + b * 4 + 1,
            valid & (bucket == threshold),
            key.to(tl.int32, bitcast=True),
            tie_idx_ptr + b * N,
            offs,
            True,
        )

    # Every thread's appends are done before the program reports in; the last program
    # of the row sees all of them through the acquire-release counter.
    tl.debug_barrier()
    finished = tl.atomic_add(counter_ptr + b * 4 + 2, 1, sem="acq_rel")
    if finished == tl.num_programs(1) - 1:
        _finish_row(
            b,
            tie_key_ptr,
            tie_idx_ptr,
            sel_ptr,
            hist_ptr,
            counter_ptr,
            cand_ptr,
            out_ptr,
            N,
            k,
            n_take,
            NUM_BINS,
            K_PAD,
            FINISH_BLOCK,
            FINISH_REGS,
            LOG_SPLITS,
        )


# ----------------------------------------------------------------------------- host side


def _grid_split(rows: int, num_blocks: int, programs_per_sm: int, device: torch.device) -> tuple[int, int]:
    """-> (programs per row, blocks per program): about programs_per_sm programs per
    multiprocessor over all rows, each walking an equal run of blocks."""
    want = max(1, host_math.cdiv(programs_per_sm * multiprocessor_count(device), max(rows, 1)))
    per_prog = host_math.cdiv(num_blocks, min(want, num_blocks))
    return host_math.cdiv(num_blocks, per_prog), per_prog


def check_candidates(cand_rows: torch.Tensor, num_candidates: torch.Tensor | None, rows: int) -> None:
    assert cand_rows.dtype == torch.int32 and cand_rows.dim() == 2 and cand_rows.is_contiguous()
    assert cand_rows.shape[0] == rows, f"cand_rows must have {rows} rows, got {cand_rows.shape[0]}"
    assert cand_rows.shape[1] < 2**31 - 1
    if num_candidates is not None:
        assert num_candidates.dtype == torch.int32 and num_candidates.shape == (rows,)
        assert num_candidates.is_contiguous() and num_candidates.device == cand_rows.device


def prepare_out(rows: int, k: int, device: torch.device, out: torch.Tensor | None) -> torch.Tensor:
    """The [rows, k] int32 output of a top-k call: `out` checked, or a new one."""
    assert k >= 1, "k must be positive"
    if out is None:
        out = torch.empty(rows, k, dtype=torch.int32, device=device)
    assert out.shape == (rows, k) and out.dtype == torch.int32 and out.is_contiguous()
    return out


def _prepare(
    rows: int,
    n: int,
    k: int,
    device: torch.device,
    out: torch.Tensor | None,
    workspace: TopkWorkspace | None,
    config: TopkConfig,
) -> tuple[torch.Tensor, TopkWorkspace]:
    assert 8 <= config.coarse_bits <= 11, "coarse_bits must lie in 8..11"
    out = prepare_out(rows, k, device, out)
    if workspace is None:
        workspace = TopkWorkspace.allocate(rows, n, k, device, config.coarse_bits)
    for name in ("keys", "tie_keys", "tie_index"):
        t = getattr(workspace, name)
        assert t.shape == (rows, n) and t.dtype == torch.int32 and t.is_contiguous(), f"workspace.{name}"
    assert workspace.selected.shape == (rows, host_math.next_power_of_2(k)), "workspace.selected"
    assert workspace.hist.shape == (rows, 1 << config.coarse_bits), "workspace.hist vs config.coarse_bits"
    assert workspace.counters.shape == (rows, NUM_COUNTERS), "workspace.counters"
    return out, workspace


def score_constexprs(heads: int, head_dim: int, config: TopkConfig = DEFAULT_CONFIG) -> dict[str, Any]:
    """Constexprs and launch options of the score kernel, less HAS_NCAND and the dtype-dependent
    DOT_F32 / PRECISION: model constants only, whatever the candidate count."""
    return dict(
        HI=heads, DI=head_dim, BLOCK_HI=max(16, host_math.next_power_of_2(heads)),
        BLOCK_N=config.score_block_n,
        COARSE_BITS=config.coarse_bits, num_warps=config.score_warps, num_stages=config.score_stages,
    )


def keys_constexprs(n: int, config: TopkConfig = DEFAULT_CONFIG) -> dict[str, Any]:
    """Constexprs of the keys kernel (`topk_rows`), less HAS_NCAND, for N candidate slots: the
    tile is next_power_of_2(N), capped."""
    return dict(
        BLOCK_N=min(config.keys_block_n, max(16, host_math.next_power_of_2(n))),
        COARSE_BITS=config.coarse_bits,
        num_warps=4,
    )


def filter_constexprs(n: int, k: int, config: TopkConfig = DEFAULT_CONFIG) -> dict[str, Any]:
    """Constexprs and launch options of the filter kernel for N candidate slots and k picks: each
    a capped power of two of N or k, so they change only when next_power_of_2(N) or
    next_power_of_2(k) does, and not at all past the caps."""
    bucket = host_math.next_power_of_2(n)
    return dict(
        COARSE_BITS=config.coarse_bits,
        K_PAD=host_math.next_power_of_2(k),
        BLOCK_N=min(config.filter_block_n, max(16, bucket)),
        FINISH_BLOCK=min(config.finish_block_n, max(16, bucket)),
        FINISH_REGS=max(256, min(config.finish_regs, bucket)),
        LOG_SPLITS=config.tie_log_splits,
        num_warps=config.filter_warps,
    )


def _launch_filter(
    workspace: TopkWorkspace, cand_rows: torch.Tensor, num_candidates: torch.Tensor | None, out: torch.Tensor,
    k: int, config: TopkConfig,
) -> None:
    rows, n = cand_rows.shape
    consts = filter_constexprs(n, k, config)
    num_blocks = max(1, host_math.cdiv(n, consts["BLOCK_N"]))
    programs, per_prog = _grid_split(rows, num_blocks, config.programs_per_sm, cand_rows.device)
    _topk_filter_kernel[(rows, programs)](
        workspace.keys,
        workspace.tie_keys,
        workspace.tie_index,
        workspace.selected,
        workspace.hist,
        workspace.counters,
        cand_rows,
        num_candidates if num_candidates is not None else cand_rows,
        out,
        n,
        k,
        per_prog,
        HAS_NCAND=num_candidates is not None,
        **consts,
    )


def launch_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys_pool: torch.Tensor,
    cand_rows: torch.Tensor,
    num_candidates: torch.Tensor | None,
    workspace: TopkWorkspace,
    scale: float,
    config: TopkConfig = DEFAULT_CONFIG,
    fp4_keys: Fp4Keys | None = None,
) -> None:
    """The score launch of `indexer_topk` (arguments as there, checked by it): every valid candidate's
    key into workspace.keys and its coarse bucket into workspace.hist."""
    rows, heads, head_dim = q.shape
    n = cand_rows.shape[1]
    consts = score_constexprs(heads, head_dim, config)
    num_blocks = host_math.cdiv(n, consts["BLOCK_N"])
    programs, per_prog = _grid_split(rows, num_blocks, config.programs_per_sm, q.device)
    fp32 = q.dtype == torch.float32
    _indexer_score_kernel[(rows, programs)](
        q,
        weights,
        keys_pool,
        cand_rows,
        num_candidates if num_candidates is not None else cand_rows,
        workspace.keys,
        workspace.hist,
        n,
        per_prog,
        scale,
        HAS_NCAND=num_candidates is not None,
        DOT_F32=fp32 or interpreting(),
        PRECISION="ieee" if fp32 else "tf32",
        **consts,
        **({} if fp4_keys is None else dict(KEYS_FP4=True, KEY_W=fp4_keys.width)),
    )


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys_pool: torch.Tensor,
    cand_rows: torch.Tensor,
    k: int,
    num_candidates: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    workspace: TopkWorkspace | None = None,
    config: TopkConfig = DEFAULT_CONFIG,
    fp4_keys: Fp4Keys | None = None,
) -> torch.Tensor:
    """Fused indexer scores + top-k (two launches).

    q: [B, Hi, di] bf16/fp32 contiguous (di a power of two >= 16); weights: [B, Hi] fp32;
    keys_pool: [Rc, di] contiguous, q's dtype; cand_rows: [B, N] int32 (-1 = none);
    num_candidates: [B] int32 or None; all on one device
    -> [B, k] int32 pool rows of the k best candidates (candidate order, -1 padded).
    fp4_keys: the pool holds FP4 keys of this layout instead ([Rc, width] uint8), decoded in the
    score kernel to q's dtype (the queries are expected rotated and FP4-rounded already).
    """
    assert q.dim() == 3 and q.is_contiguous() and q.dtype in (torch.bfloat16, torch.float32)
    rows, heads, head_dim = q.shape
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "index_head_dim must be a power of two >= 16"
    assert weights.shape == (rows, heads) and weights.dtype == torch.float32 and weights.is_contiguous()
    key_width = head_dim if fp4_keys is None else fp4_keys.width
    assert keys_pool.dim() == 2 and keys_pool.shape[1] == key_width and keys_pool.is_contiguous()
    if fp4_keys is None:
        assert keys_pool.dtype == q.dtype, "keys_pool and q must share one dtype"
    else:
        assert keys_pool.dtype == torch.uint8 and fp4_keys.head_dim == head_dim, "FP4 keys: uint8, q's width"
    check_candidates(cand_rows, num_candidates, rows)
    assert q.device == weights.device == keys_pool.device == cand_rows.device
    scale = head_dim**-0.5 if scale is None else float(scale)
    n = cand_rows.shape[1]
    out, workspace = _prepare(rows, n, k, q.device, out, workspace, config)
    if rows == 0:
        return out
    if n == 0:
        return out.fill_(-1)

    launch_scores(q, weights, keys_pool, cand_rows, num_candidates, workspace, scale, config, fp4_keys)
    _launch_filter(workspace, cand_rows, num_candidates, out, k, config)
    return out


def topk_rows(
    scores: torch.Tensor,
    cand_rows: torch.Tensor,
    k: int,
    num_candidates: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    workspace: TopkWorkspace | None = None,
    config: TopkConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """Top-k alone on precomputed scores (two launches): scores [B, N] fp32 contiguous;
    cand_rows [B, N] int32 (-1 = none); num_candidates [B] int32 or None
    -> [B, k] int32 pool rows (candidate order, -1 padded). `onepass.topk_rows` takes the
    one-launch select where it fits and this path elsewhere."""
    assert scores.dim() == 2 and scores.dtype == torch.float32 and scores.is_contiguous()
    rows, n = scores.shape
    check_candidates(cand_rows, num_candidates, rows)
    assert cand_rows.shape == scores.shape and cand_rows.device == scores.device
    out, workspace = _prepare(rows, n, k, scores.device, out, workspace, config)
    if rows == 0:
        return out
    if n == 0:
        return out.fill_(-1)
    consts = keys_constexprs(n, config)
    num_blocks = host_math.cdiv(n, consts["BLOCK_N"])
    programs, per_prog = _grid_split(rows, num_blocks, config.programs_per_sm, scores.device)
    _score_keys_kernel[(rows, programs)](
        scores,
        cand_rows,
        num_candidates if num_candidates is not None else cand_rows,
        workspace.keys,
        workspace.hist,
        n,
        per_prog,
        HAS_NCAND=num_candidates is not None,
        **consts,
    )
    _launch_filter(workspace, cand_rows, num_candidates, out, k, config)
    return out
