"""Lightning-indexer scores fused with a radix-select top-k, as Triton kernels.

Semantics: `reference.indexer_topk_reference` (scores, then the k best valid candidates
as pool rows, -1 padded).

Pipeline per call (B query rows, N candidate slots per row, k picks):

1. `_indexer_score_kernel`, grid (B, G): each program owns a run of BLOCK_N-candidate
   blocks of one row. It gathers the candidates' key rows [BLOCK_N, di], multiplies by
   the row's queries [di, Hi] (one tensor-core product for all heads), applies ReLU, the
   head weights and the scale, and turns each score into an order-preserving uint32 key
   (below). Keys go to a [B, N] scratch (4 bytes per candidate, against 2 * di bytes of
   key row read), and a histogram of their top byte is accumulated in registers and
   added once per program into a [B, 256] global histogram.
   (`topk_rows` runs `_score_keys_kernel` instead: the same key + histogram step on
   precomputed fp32 scores.)
2. `_radix_select_kernel`, grid (B,): one program per row finds the k-th largest key
   byte by byte, most significant first. The first byte comes from the global
   histogram; each further byte costs one pass over the row's keys that histograms the
   next byte of the keys still tied with the threshold's prefix. A pass ends early
   when the threshold's bin holds exactly the keys still wanted. A last pass writes
   the chosen candidates' pool rows.

Order-preserving keys: for an fp32 score with bits u, key = ~u if the sign is set, else
u | 0x80000000; larger key <=> larger score. Both zeros map to the key of +0.0, so
-0.0 and +0.0 tie as they do under `torch.topk`. Every finite score gets a key >= 2^23,
so key 0 marks an invalid candidate.

Ties: among candidates whose score equals the k-th largest, the lowest candidate
indices j win (the output pass takes tied keys in index order). Output order within a
row: ascending candidate index, then -1 padding.

Histograms use 256 bins (8-bit digits): Triton lowers `tl.histogram` to warp ballots
whose cost grows with the bins each lane owns, so wider digits cost more per element
than the pass they save.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

NUM_BINS = 256


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _patch_interpreter_scalar_index() -> None:
    """CPU-interpreter compatibility, no effect on GPU: triton 3.6's interpreter holds
    scalars as shape-[1] arrays and turns them into loop bounds with `int(array)`,
    which NumPy >= 2.4 rejects; index through the single element instead."""
    from triton.runtime import interpreter

    if getattr(interpreter, "_antumbra_scalar_index", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._antumbra_scalar_index = True


if _interpreting():
    _patch_interpreter_scalar_index()


@dataclass(frozen=True)
class TopkConfig:
    score_block_n: int = 64  # candidates per score block
    score_warps: int = 4
    score_stages: int = 3
    select_block_n: int = 4096  # keys per select-pass chunk (<= 32768: counts are packed in 16 bits)
    select_warps: int = 16
    programs_per_sm: int = 2  # score programs in flight per multiprocessor, over all rows


DEFAULT_CONFIG = TopkConfig()


@dataclass
class TopkWorkspace:
    """Scratch of one call; keep one per shape to launch without allocations (CUDA graphs).

    `hist` must be all zero when a call starts; the select kernel zeroes it again after
    reading it, so a kept workspace needs no memset between calls."""

    keys: torch.Tensor  # [B, N] int32 order-preserving score keys, 0 = invalid
    hist: torch.Tensor  # [B, 256] int32 top-byte histogram of the valid keys

    @staticmethod
    def allocate(rows: int, num_candidates: int, device: torch.device | str) -> TopkWorkspace:
        return TopkWorkspace(
            keys=torch.empty(rows, num_candidates, dtype=torch.int32, device=device),
            hist=torch.zeros(rows, NUM_BINS, dtype=torch.int32, device=device),
        )


@triton.jit
def _sortable_key(score):
    """fp32 [BLOCK] -> uint32 [BLOCK], monotone in the score; both zeros share one key."""
    bits = score.to(tl.uint32, bitcast=True)
    bits = tl.where(score == 0.0, 0, bits)
    return tl.where((bits & 0x80000000) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _score_block(
    q_tile,  # [BLOCK_HI, DI] queries of this row
    w_row,  # [BLOCK_HI] fp32 head weights (0 for padded heads)
    keys_ptr,  # pointer to keys_pool[0, 0]; [Rc, DI] contiguous
    rows,  # [BLOCK_N] int32 candidate pool rows, -1 = invalid
    scale,
    DI: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    valid = rows >= 0
    offs_d = tl.arange(0, DI)
    k_tile = tl.load(keys_ptr + rows.to(tl.int64)[:, None] * DI + offs_d[None, :], mask=valid[:, None], other=0.0)
    if DOT_F32:
        # fp32 inputs, and the CPU interpreter, whose dot does not understand bf16.
        logits = tl.dot(k_tile.to(tl.float32), tl.trans(q_tile.to(tl.float32)), input_precision=PRECISION)
    else:
        logits = tl.dot(k_tile, tl.trans(q_tile), input_precision=PRECISION)  # [BLOCK_N, BLOCK_HI]
    return tl.sum(tl.maximum(logits, 0.0) * w_row[None, :], 1) * scale


@triton.jit
def _indexer_score_kernel(
    q_ptr,  # [B, HI, DI] indexer queries, contiguous (bf16 or fp32)
    w_ptr,  # [B, HI] fp32 head weights, contiguous
    keys_ptr,  # [Rc, DI] indexer key pool, contiguous, q's dtype
    cand_ptr,  # [B, N] int32 candidate pool rows, -1 = not a candidate
    ncand_ptr,  # [B] int32 valid prefix length of each row (read only when HAS_NCAND)
    skey_ptr,  # [B, N] int32 out: order-preserving key bits of each score, 0 = invalid
    hist_ptr,  # [B, 256] int32 in/out: top-byte histogram of valid keys, accumulated atomically
    N,  # candidate slots per row
    blocks_per_prog,  # BLOCK_N blocks each program walks
    scale,  # index_head_dim^-0.5
    HI: tl.constexpr,
    DI: tl.constexpr,
    BLOCK_HI: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_NCAND: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_HI)
    h_mask = offs_h < HI
    offs_d = tl.arange(0, DI)
    q_tile = tl.load(q_ptr + b * HI * DI + offs_h[:, None] * DI + offs_d[None, :], mask=h_mask[:, None], other=0.0)
    w_row = tl.load(w_ptr + b * HI + offs_h, mask=h_mask, other=0.0)
    limit = N
    if HAS_NCAND:
        limit = tl.minimum(tl.load(ncand_ptr + b), N)

    hist = tl.zeros([256], tl.int32)
    for i in range(0, blocks_per_prog):
        offs = (g * blocks_per_prog + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.load(cand_ptr + b * N + offs, mask=offs < limit, other=-1)
        score = _score_block(q_tile, w_row, keys_ptr, rows, scale, DI, DOT_F32, PRECISION)
        valid = rows >= 0
        key = tl.where(valid, _sortable_key(score), 0)
        tl.store(skey_ptr + b * N + offs, key.to(tl.int32, bitcast=True), mask=offs < N)
        hist += tl.histogram((key >> 24).to(tl.int32), 256, mask=valid)
    bins = tl.arange(0, 256)
    tl.atomic_add(hist_ptr + b * 256 + bins, hist, mask=hist > 0, sem="relaxed")


@triton.jit
def _score_keys_kernel(
    scores_ptr,  # [B, N] fp32 precomputed scores, contiguous
    cand_ptr,  # [B, N] int32 candidate pool rows, -1 = not a candidate
    ncand_ptr,  # [B] int32 valid prefix length of each row (read only when HAS_NCAND)
    skey_ptr,  # [B, N] int32 out: order-preserving key bits, 0 = invalid
    hist_ptr,  # [B, 256] int32 in/out: top-byte histogram of valid keys, accumulated atomically
    N,  # candidate slots per row
    blocks_per_prog,  # BLOCK_N blocks each program walks
    BLOCK_N: tl.constexpr,
    HAS_NCAND: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    limit = N
    if HAS_NCAND:
        limit = tl.minimum(tl.load(ncand_ptr + b), N)
    hist = tl.zeros([256], tl.int32)
    for i in range(0, blocks_per_prog):
        offs = (g * blocks_per_prog + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.load(cand_ptr + b * N + offs, mask=offs < limit, other=-1)
        valid = rows >= 0
        score = tl.load(scores_ptr + b * N + offs, mask=valid, other=0.0)
        key = tl.where(valid, _sortable_key(score), 0)
        tl.store(skey_ptr + b * N + offs, key.to(tl.int32, bitcast=True), mask=offs < N)
        hist += tl.histogram((key >> 24).to(tl.int32), 256, mask=valid)
    bins = tl.arange(0, 256)
    tl.atomic_add(hist_ptr + b * 256 + bins, hist, mask=hist > 0, sem="relaxed")


@triton.jit
def _pick_digit(hist, k_rem):
    """hist: [256] int32 counts of the next byte among keys tied so far; k_rem >= 1 of them
    are still wanted and sum(hist) >= k_rem.
    -> (byte of the k_rem-th largest, count strictly above that byte, count in its bin)."""
    bins = tl.arange(0, 256)
    at_or_above = tl.cumsum(hist, 0, reverse=True)  # [256]: keys whose byte >= bin
    digit = tl.max(tl.where(at_or_above >= k_rem, bins, -1), 0)
    above = tl.sum(tl.where(bins > digit, hist, 0), 0)
    in_bin = tl.sum(tl.where(bins == digit, hist, 0), 0)
    return digit, above, in_bin


@triton.jit
def _radix_select_kernel(
    skey_ptr,  # [B, N] int32 order-preserving key bits, 0 = invalid
    hist_ptr,  # [B, 256] int32 top-byte histogram of valid keys; zeroed here after reading
    cand_ptr,  # [B, N] int32 candidate pool rows
    out_ptr,  # [B, k] int32 out: chosen pool rows in candidate order, then -1
    N,  # candidate slots per row
    k,  # picks per row
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    bins = tl.arange(0, 256)
    hist = tl.load(hist_ptr + b * 256 + bins)
    tl.store(hist_ptr + b * 256 + bins, tl.zeros([256], tl.int32))
    n_valid = tl.sum(hist, 0)
    n_take = tl.minimum(n_valid, k)

    # Threshold state: keys whose decided top bits (key & hi_mask) exceed `prefix` are
    # taken; keys equal to it are tied and the first k_rem of them (by index) are taken.
    # With every valid key wanted, the empty prefix already says "all valid keys tie".
    prefix = tl.full([], 0, tl.uint32)
    hi_mask = tl.full([], 0, tl.uint32)
    k_rem = n_take
    open_ = n_valid > k
    if open_:
        digit, above, in_bin = _pick_digit(hist, k_rem)
        prefix = digit.to(tl.uint32) << 24
        hi_mask = tl.full([], 0xFF000000, tl.uint32)
        k_rem = k_rem - above
        open_ = in_bin > k_rem
    for shift in tl.static_range(16, -1, -8):
        if open_:
            hist = tl.zeros([256], tl.int32)
            for start in range(0, N, BLOCK_N):
                offs = start + tl.arange(0, BLOCK_N)
                key = tl.load(skey_ptr + b * N + offs, mask=offs < N, other=0).to(tl.uint32, bitcast=True)
                tied = ((key & hi_mask) == prefix) & (key != 0)
                hist += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=tied)
            digit, above, in_bin = _pick_digit(hist, k_rem)
            prefix = prefix | (digit.to(tl.uint32) << shift)
            hi_mask = hi_mask | tl.full([], 0xFF << shift, tl.uint32)
            k_rem = k_rem - above
            open_ = in_bin > k_rem

    # Output pass. One packed inclusive scan gives, per key, how many strictly-above
    # keys (low 16 bits) and tied keys (high 16 bits) precede it in this chunk.
    written = tl.zeros([], tl.int32)  # outputs written so far
    tied_seen = tl.zeros([], tl.int32)  # tied keys met so far
    for start in range(0, N, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        key = tl.load(skey_ptr + b * N + offs, mask=offs < N, other=0).to(tl.uint32, bitcast=True)
        top = key & hi_mask
        above_t = (top > prefix) & (key != 0)
        tied = (top == prefix) & (key != 0)
        packed = above_t.to(tl.int32) + (tied.to(tl.int32) << 16)
        before = tl.cumsum(packed, 0) - packed
        above_before = before & 0xFFFF
        tied_before = before >> 16
        tied_left = tl.maximum(k_rem - tied_seen, 0)  # tied keys this chunk may still take
        take = above_t | (tied & (tied_before < tied_left))
        pos = written + above_before + tl.minimum(tied_before, tied_left)
        rows = tl.load(cand_ptr + b * N + offs, mask=take, other=-1)
        tl.store(out_ptr + b * k + pos, rows, mask=take)
        total = tl.sum(packed, 0)
        written += (total & 0xFFFF) + tl.minimum(total >> 16, tied_left)
        tied_seen += total >> 16
    for start in range(0, k, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + b * k + offs, tl.full([BLOCK_N], -1, tl.int32), mask=(offs >= n_take) & (offs < k))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _grid_split(rows: int, num_blocks: int, programs_per_sm: int, device: torch.device) -> tuple[int, int]:
    """-> (programs per row, blocks per program): about programs_per_sm programs per
    multiprocessor over all rows, each walking an equal run of blocks."""
    want = max(1, triton.cdiv(programs_per_sm * _num_sms(device), max(rows, 1)))
    per_prog = triton.cdiv(num_blocks, min(want, num_blocks))
    return triton.cdiv(num_blocks, per_prog), per_prog


def _check_candidates(cand_rows: torch.Tensor, num_candidates: torch.Tensor | None, rows: int) -> None:
    assert cand_rows.dtype == torch.int32 and cand_rows.dim() == 2 and cand_rows.is_contiguous()
    assert cand_rows.shape[0] == rows, f"cand_rows must have {rows} rows, got {cand_rows.shape[0]}"
    if num_candidates is not None:
        assert num_candidates.dtype == torch.int32 and num_candidates.shape == (rows,)
        assert num_candidates.is_contiguous() and num_candidates.device == cand_rows.device


def _prepare_outputs(
    rows: int, n: int, k: int, device: torch.device, out: torch.Tensor | None, workspace: TopkWorkspace | None
) -> tuple[torch.Tensor, TopkWorkspace]:
    if out is None:
        out = torch.empty(rows, k, dtype=torch.int32, device=device)
    assert out.shape == (rows, k) and out.dtype == torch.int32 and out.is_contiguous()
    if workspace is None:
        workspace = TopkWorkspace.allocate(rows, n, device)
    assert workspace.keys.shape == (rows, n) and workspace.keys.dtype == torch.int32
    assert workspace.hist.shape == (rows, NUM_BINS) and workspace.hist.dtype == torch.int32
    return out, workspace


def _launch_select(
    workspace: TopkWorkspace, cand_rows: torch.Tensor, out: torch.Tensor, k: int, config: TopkConfig
) -> None:
    rows, n = cand_rows.shape
    block_n = min(config.select_block_n, max(256, triton.next_power_of_2(max(n, k))))
    assert block_n <= 32768, "select_block_n above 32768 overflows the packed 16-bit counts"
    _radix_select_kernel[(rows,)](
        workspace.keys, workspace.hist, cand_rows, out, n, k, BLOCK_N=block_n, num_warps=config.select_warps,
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
) -> torch.Tensor:
    """Fused indexer scores + top-k.

    q: [B, Hi, di] bf16/fp32 contiguous (di a power of two >= 16); weights: [B, Hi] fp32;
    keys_pool: [Rc, di] contiguous, q's dtype; cand_rows: [B, N] int32 (-1 = none);
    num_candidates: [B] int32 or None; all on one device
    -> [B, k] int32 pool rows of the k best candidates (candidate order, -1 padded).
    """
    assert q.dim() == 3 and q.is_contiguous() and q.dtype in (torch.bfloat16, torch.float32)
    rows, heads, head_dim = q.shape
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "index_head_dim must be a power of two >= 16"
    assert weights.shape == (rows, heads) and weights.dtype == torch.float32 and weights.is_contiguous()
    assert keys_pool.dim() == 2 and keys_pool.shape[1] == head_dim and keys_pool.is_contiguous()
    assert keys_pool.dtype == q.dtype, "keys_pool and q must share one dtype"
    _check_candidates(cand_rows, num_candidates, rows)
    assert q.device == weights.device == keys_pool.device == cand_rows.device
    assert k >= 1
    scale = head_dim**-0.5 if scale is None else float(scale)
    n = cand_rows.shape[1]
    out, workspace = _prepare_outputs(rows, n, k, q.device, out, workspace)
    if rows == 0:
        return out

    block_n = config.score_block_n
    num_blocks = max(1, triton.cdiv(n, block_n))
    programs, per_prog = _grid_split(rows, num_blocks, config.programs_per_sm, q.device)
    fp32 = q.dtype == torch.float32
    _indexer_score_kernel[(rows, programs)](
        q, weights, keys_pool, cand_rows,
        num_candidates if num_candidates is not None else cand_rows,
        workspace.keys, workspace.hist, n, per_prog, scale,
        HI=heads, DI=head_dim, BLOCK_HI=max(16, triton.next_power_of_2(heads)), BLOCK_N=block_n,
        HAS_NCAND=num_candidates is not None, DOT_F32=fp32 or _interpreting(),
        PRECISION="ieee" if fp32 else "tf32",
        num_warps=config.score_warps, num_stages=config.score_stages,
    )
    _launch_select(workspace, cand_rows, out, k, config)
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
    """Top-k alone on precomputed scores: scores [B, N] fp32 contiguous; cand_rows [B, N]
    int32 (-1 = none); num_candidates [B] int32 or None -> [B, k] int32 pool rows."""
    assert scores.dim() == 2 and scores.dtype == torch.float32 and scores.is_contiguous()
    rows, n = scores.shape
    _check_candidates(cand_rows, num_candidates, rows)
    assert cand_rows.shape == scores.shape and cand_rows.device == scores.device
    assert k >= 1
    out, workspace = _prepare_outputs(rows, n, k, scores.device, out, workspace)
    if rows == 0:
        return out
    block_n = 1024
    num_blocks = max(1, triton.cdiv(n, block_n))
    programs, per_prog = _grid_split(rows, num_blocks, config.programs_per_sm, scores.device)
    _score_keys_kernel[(rows, programs)](
        scores, cand_rows, num_candidates if num_candidates is not None else cand_rows,
        workspace.keys, workspace.hist, n, per_prog,
        BLOCK_N=block_n, HAS_NCAND=num_candidates is not None, num_warps=4,
    )
    _launch_select(workspace, cand_rows, out, k, config)
    return out
