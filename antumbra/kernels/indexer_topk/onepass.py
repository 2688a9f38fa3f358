"""Exact top-k of each row in one launch: a row's programs meet at grid barriers.

Semantics: `reference.topk_rows_reference`, with the output contract of `triton.topk_rows`:
the pool rows of the k best valid candidates in candidate order, then -1; among equal scores
the lowest candidate index wins.

Why a second design: the two-launch path's fixed cost at batch 1 is a second launch, then one
finishing program that resolves the tie list in serial passes and sorts the selection
(TUNING.md has the figures). Here each program holds
its slice of the row in registers for the whole call and the serial parts are spread over
the programs; what remains serial is two or three grid barriers.

Program p of row b owns the candidate slots [p * S, (p + 1) * S) (S = `slice_len`, one
register tile). Stages:

1. Coarse histogram of its valid keys (the fp16 buckets of `triton.coarse_bucket`) added
   to the row's histogram. [barrier 1]
2. From the finished histogram every program derives the same threshold bucket t:
   candidates above t are chosen, those in t are the ties. When the whole of bucket t is
   wanted (or the row has at most k valid candidates) nothing is left to resolve.
   Otherwise the program appends its ties (key, index) to the row's tie list. It publishes
   its count of candidates chosen above t. [barrier 2]
3. Only when ties are to be resolved. The tie list has M entries and W of them are wanted.
   An entry's rank is the number of entries with a larger key, or an equal key and a lower
   candidate index (ranks are distinct); the entries of rank < W are chosen, and the one of
   rank W - 1 is the row's threshold pair (kth key, kth index): a tie is chosen iff
   (key, -index) >= (kth key, -kth index).
   * RANK_OWN_MAX < M <= RANK_ALL: every program loads the whole list at once and finds the threshold pair
     itself in registers (`triton.kth_largest`'s interval search: the W-th largest key, then
     the lowest indices among the entries holding it), and with it how many chosen ties lie
     below its slice. No barrier.
   * otherwise (short lists, where one more barrier costs less than the search, or lists too
     long for registers) each program ranks only its own entries (its count times M comparisons),
     publishes its chosen count, and the owner of rank W - 1 publishes the pair. [barrier 3]
4. Offset = the chosen counts of the lower programs; each chosen candidate is stored at the
   offset plus its rank among the slice's chosen (an exclusive scan), so the output is in
   candidate order without a sort. The last program of the row zeroes its histogram and
   counters for the next call.

Grid barrier: each program adds 1 to the row's arrival counter (release, after a CTA
barrier so that every thread's writes precede it) and spins until the counter reaches
`barrier number x programs per row` (acquire); reads of shared scratch bypass L1 (`.cg`).
A spinning program only waits for programs of its own launch, and the launch asks for at
most one program per multiprocessor over all rows, so all of them can be resident at once
even beside other kernels (those finish and free their multiprocessors). `topk_rows` here
falls back to the two-launch path when rows x programs would exceed that.

The CPU interpreter runs programs one after another, so a barrier between two programs of
a row would never open. There each stage is its own launch (STAGE 1..4, state kept in
`state` and the counters) and the barriers fall away; the one-launch form (STAGE 0) runs on
the CPU with one program per row, where every barrier opens at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from antumbra.kernels.common import host_math
from antumbra.kernels.common.device import multiprocessor_count
from antumbra.kernels.common.interpreter import interpreting, prepare

from .triton import (
    DEFAULT_CONFIG,
    TopkConfig,
    TopkWorkspace,
    check_candidates,
    coarse_bucket,
    kth_largest,
    pick_bucket,
    prepare_out,
    row_limit,
    sortable_key,
)
from .triton import topk_rows as topk_rows_two_launches

prepare()

# Per row: [0] barrier arrivals, [1] tie-list length, [2] programs finished,
# [3] kth key, [4] kth candidate index, [5..7] spare.
NUM_COUNTERS = 8
# Per program: [0] tie-list base, [2] chosen above t, [3] chosen count or (STAGE 3 with RANK_ALL)
# chosen ties below the slice, [4] kth key, [5] kth index (STAGE 3 with RANK_ALL); [1], [6], [7] spare.
STATE_WIDTH = 8
SLICE_MAX = 4096  # slots a program holds in registers


@dataclass
class SelectWorkspace:
    """Scratch of one call for one plan (programs per row, slots per program); keep one per
    shape for CUDA graphs. `hist` and `counters` must be zero when a call starts; the last
    program of each row zeroes them again."""

    programs: int
    slice_len: int
    hist: torch.Tensor  # [B, 2^coarse_bits] int32
    counters: torch.Tensor  # [B, NUM_COUNTERS] int32
    state: torch.Tensor  # [B, programs, STATE_WIDTH] int32
    tie_keys: torch.Tensor  # [B, N] int32 tie-list keys
    tie_index: torch.Tensor  # [B, N] int32 their candidate indices

    @staticmethod
    def allocate(rows: int, num_candidates: int, plan: tuple[int, int], device: torch.device | str,
                 coarse_bits: int = DEFAULT_CONFIG.coarse_bits) -> SelectWorkspace:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int32, device=device)

        return SelectWorkspace(
            programs=plan[0],
            slice_len=plan[1],
            hist=zeros(rows, 1 << coarse_bits),
            counters=zeros(rows, NUM_COUNTERS),
            state=zeros(rows, plan[0], STATE_WIDTH),
            tie_keys=torch.empty(rows, num_candidates, dtype=torch.int32, device=device),
            tie_index=torch.empty(rows, num_candidates, dtype=torch.int32, device=device),
        )


# ----------------------------------------------------------------------------- device side


@triton.jit
def _grid_barrier(arrivals_ptr, target):
    """Wait until `target` arrivals on the row's counter, this program's included."""
    tl.debug_barrier()
    tl.atomic_add(arrivals_ptr, 1, sem="release")
    seen = tl.atomic_add(arrivals_ptr, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(arrivals_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _rank_entries(tk_ptr, ti_ptr, first, count, M, TIE_BLOCK: tl.constexpr, LIST_BLOCK: tl.constexpr):
    """Ranks of list entries [first, first + TIE_BLOCK) (those below `count` of them) among the M
    entries: how many have a larger key, or an equal key and a lower index.
    -> (rank [TIE_BLOCK] int32, key [TIE_BLOCK] uint32, index [TIE_BLOCK] int32, live [TIE_BLOCK])."""
    ri = tl.arange(0, TIE_BLOCK)
    live = ri < count
    key = tl.load(tk_ptr + first + ri, mask=live, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
    idx = tl.load(ti_ptr + first + ri, mask=live, other=0, cache_modifier=".cg")
    rank = tl.zeros([TIE_BLOCK], tl.int32)
    for j0 in range(0, M, LIST_BLOCK):
        rj = j0 + tl.arange(0, LIST_BLOCK)
        inside = rj < M
        kj = tl.load(tk_ptr + rj, mask=inside, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
        ij = tl.load(ti_ptr + rj, mask=inside, other=0, cache_modifier=".cg")
        beats = (kj[None, :] > key[:, None]) | ((kj[None, :] == key[:, None]) & (ij[None, :] < idx[:, None]))
        rank += tl.sum((beats & inside[None, :]).to(tl.int32), 1)
    return rank, key, idx, live


@triton.jit
def _threshold_of_list(tk_ptr, ti_ptr, M, wanted, start, CAP: tl.constexpr, LOG_SPLITS: tl.constexpr):
    """The whole tie list (M <= CAP entries) in registers: the threshold pair of the `wanted` best
    (the wanted-th largest key by `kth_largest`, then among the entries holding it the lowest
    indices) and how many chosen entries lie below candidate `start`.
    -> (kth key uint32, kth index int32, chosen below start int32)."""
    r = tl.arange(0, CAP)
    live = r < M
    key = tl.load(tk_ptr + r, mask=live, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
    idx = tl.load(ti_ptr + r, mask=live, other=0, cache_modifier=".cg")
    key64 = key.to(tl.int64)
    kth = kth_largest(key64, live, wanted, LOG_SPLITS)
    above = live & (key64 > kth)
    at_kth = live & (key64 == kth)
    need = wanted - tl.sum(above.to(tl.int32), 0)  # >= 1 of the entries at kth, the lowest indices
    rank = (idx.to(tl.uint32) ^ 0xFFFFFFFF).to(tl.int64)  # larger for a lower index
    kth_rank = tl.min(tl.where(at_kth, rank, 1 << 40), 0)  # all of them wanted
    if tl.sum(at_kth.to(tl.int32), 0) > need:
        kth_rank = kth_largest(rank, at_kth, need, LOG_SPLITS)
    chosen = above | (at_kth & (rank >= kth_rank))
    below = tl.sum((chosen & (idx < start)).to(tl.int32), 0)
    kth_idx = (kth_rank.to(tl.uint32) ^ 0xFFFFFFFF).to(tl.int32, bitcast=True)
    return kth.to(tl.uint32), kth_idx, below


@triton.jit
def _sum_below(slot_ptr, p, MAX_P: tl.constexpr):
    """Sum of one state slot over the programs of the row below program p (stride STATE_WIDTH)."""
    pv = tl.arange(0, MAX_P)
    return tl.sum(tl.load(slot_ptr + pv * 8, mask=pv < p, other=0, cache_modifier=".cg"), 0)


@triton.jit(do_not_specialize=["N", "k", "slice_len"])
def _select_kernel(
    scores_ptr,  # [B, N] fp32 scores
    cand_ptr,  # [B, N] int32 candidate pool rows, -1 = not a candidate
    ncand_ptr,  # [B] int32 valid prefix of each row (read only when HAS_NCAND)
    hist_ptr,  # [B, NUM_BINS] int32 coarse histogram, zero on entry; zeroed at the end
    counter_ptr,  # [B, NUM_COUNTERS] int32, zero on entry; zeroed at the end
    state_ptr,  # [B, P, STATE_WIDTH] int32 per-program state
    tie_key_ptr,  # [B, N] int32 tie-list keys
    tie_idx_ptr,  # [B, N] int32 tie-list candidate indices
    out_ptr,  # [B, k] int32 out: chosen pool rows in candidate order, then -1
    N,
    k,
    slice_len,  # candidate slots per program
    BLOCK: tl.constexpr,  # next_power_of_2(slice_len)
    MAX_P: tl.constexpr,  # next_power_of_2(programs per row)
    K_PAD: tl.constexpr,  # next_power_of_2(k)
    COARSE_BITS: tl.constexpr,
    RANK_ALL: tl.constexpr,  # a power of two, or 0
    RANK_OWN_MAX: tl.constexpr,  # tie lists this short are ranked by their owners
    LOG_SPLITS: tl.constexpr,
    TIE_BLOCK: tl.constexpr,
    LIST_BLOCK: tl.constexpr,
    HAS_NCAND: tl.constexpr,
    STAGE: tl.constexpr,  # 0: all stages with grid barriers; 1..4: that stage alone
):
    NUM_BINS: tl.constexpr = 1 << COARSE_BITS
    b = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    P = tl.num_programs(1)
    row_ctr = counter_ptr + b * 8
    my_state = state_ptr + (b * P + p) * 8
    start = p * slice_len
    limit = row_limit(ncand_ptr, b, N, HAS_NCAND)
    j = tl.arange(0, BLOCK)
    offs = start + j
    inside = (j < slice_len) & (offs < limit)
    rows = tl.load(cand_ptr + b * N + offs, mask=inside, other=-1)
    valid = rows >= 0
    score = tl.load(scores_ptr + b * N + offs, mask=valid, other=0.0)
    key = tl.where(valid, sortable_key(score), 0)
    bucket = coarse_bucket(score, COARSE_BITS)
    bins = tl.arange(0, NUM_BINS)

    # Stage 1: the coarse histogram.
    if (STAGE == 0) | (STAGE == 1):
        hist = tl.histogram(bucket, NUM_BINS, mask=valid)
        tl.atomic_add(hist_ptr + b * NUM_BINS + bins, hist, mask=hist > 0, sem="relaxed")
    if STAGE == 0:
        _grid_barrier(row_ctr, P)

    if (STAGE == 0) | (STAGE >= 2):
        # Stage 2: the threshold bucket, chosen above it, ties in it.
        hist = tl.load(hist_ptr + b * NUM_BINS + bins, cache_modifier=".cg")
        n_valid = tl.sum(hist, 0)
        n_take = tl.minimum(n_valid, k)
        t = n_valid * 0 - 1
        wanted = n_valid * 0
        in_t = n_valid * 0
        if n_valid > k:
            t, above, in_t = pick_bucket(hist, k, NUM_BINS)
            wanted = k - above
        resolve = wanted < in_t  # some but not all of bucket t are wanted
        tie = valid & (bucket == t)
        upper = (valid & (bucket > t)) | (tie & (wanted == in_t))
        tie = tie & resolve
        a_p = tl.sum(upper.to(tl.int32), 0)
        n_own = tl.sum(tie.to(tl.int32), 0)
        base = n_own * 0
        tk_ptr = tie_key_ptr + b * N
        ti_ptr = tie_idx_ptr + b * N
        if (STAGE == 0) | (STAGE == 2):
            if n_own > 0:
                base = tl.atomic_add(row_ctr + 1, n_own, sem="relaxed")
                pos = base + tl.cumsum(tie.to(tl.int32), 0) - 1
                tl.store(tk_ptr + pos, key.to(tl.int32, bitcast=True), mask=tie)
                tl.store(ti_ptr + pos, offs, mask=tie)
            tl.store(my_state + 0, base)
            tl.store(my_state + 2, a_p)
            tl.store(my_state + 3, a_p)  # the chosen count when no tie is resolved
        if STAGE == 0:
            _grid_barrier(row_ctr, 2 * P)

        # Stage 3: resolve the ties exactly.
        M = tl.load(row_ctr + 1, cache_modifier=".cg")
        kth_key = tl.full([], 0, tl.uint32)
        kth_idx = n_valid * 0
        below = n_valid * 0  # chosen ties below this slice (RANK_ALL)
        if STAGE >= 3:
            base = tl.load(my_state + 0)
        rank_all = M < 0  # every list ranked by its owners when RANK_ALL is 0
        if RANK_ALL > 0:
            rank_all = (M <= RANK_ALL) & (M > RANK_OWN_MAX)
        if (STAGE == 0) | (STAGE == 3):
            if resolve:
                if rank_all:
                    if RANK_ALL > 0:  # (no code for a zero-width list)
                        kth_key, kth_idx, below = _threshold_of_list(tk_ptr, ti_ptr, M, wanted, start,
                                                                     RANK_ALL, LOG_SPLITS)
                    if STAGE == 3:
                        tl.store(my_state + 3, below)
                        tl.store(my_state + 4, kth_key.to(tl.int32, bitcast=True))
                        tl.store(my_state + 5, kth_idx)
                else:
                    c_own = n_valid * 0
                    for i0 in range(0, n_own, TIE_BLOCK):
                        rank, ek, ei, live = _rank_entries(tk_ptr, ti_ptr, base + i0, n_own - i0, M,
                                                           TIE_BLOCK, LIST_BLOCK)
                        c_own += tl.sum((live & (rank < wanted)).to(tl.int32), 0)
                        last = live & (rank == wanted - 1)
                        if tl.sum(last.to(tl.int32), 0) > 0:
                            tl.store(row_ctr + 3, tl.max(tl.where(last, ek, 0), 0).to(tl.int32, bitcast=True))
                            tl.store(row_ctr + 4, tl.max(tl.where(last, ei, 0), 0))
                    tl.store(my_state + 3, a_p + c_own)
                    if STAGE == 0:
                        _grid_barrier(row_ctr, 3 * P)

        if (STAGE == 0) | (STAGE == 4):
            # Stage 4: offsets, the ordered store, the reset.
            if resolve:
                if rank_all:
                    if STAGE == 4:
                        below = tl.load(my_state + 3)
                        kth_key = tl.load(my_state + 4).to(tl.uint32, bitcast=True)
                        kth_idx = tl.load(my_state + 5)
                    offset = _sum_below(state_ptr + b * P * 8 + 2, p, MAX_P) + below
                else:
                    offset = _sum_below(state_ptr + b * P * 8 + 3, p, MAX_P)
                    kth_key = tl.load(row_ctr + 3, cache_modifier=".cg").to(tl.uint32, bitcast=True)
                    kth_idx = tl.load(row_ctr + 4, cache_modifier=".cg")
            else:
                offset = _sum_below(state_ptr + b * P * 8 + 2, p, MAX_P)
            chosen = upper | (tie & ((key > kth_key) | ((key == kth_key) & (offs <= kth_idx))))
            pos = offset + tl.cumsum(chosen.to(tl.int32), 0) - 1
            tl.store(out_ptr + b * k + pos, rows, mask=chosen)
            if p == P - 1:
                pad = tl.arange(0, K_PAD)
                padding = (pad >= n_take) & (pad < k)
                tl.store(out_ptr + b * k + pad, tl.full([K_PAD], -1, tl.int32), mask=padding)
            tl.debug_barrier()
            finished = tl.atomic_add(row_ctr + 2, 1, sem="acq_rel")
            if finished == P - 1:
                tl.store(hist_ptr + b * NUM_BINS + bins, tl.zeros([NUM_BINS], tl.int32))
                tl.store(row_ctr + tl.arange(0, 8), tl.zeros([8], tl.int32))


# ----------------------------------------------------------------------------- host side


def auto_slice(n: int) -> int:
    """Slots per program by the row's length, from the H200 sweep at batch 1 (TUNING.md): short rows
    gain from more programs, long ones from fewer (a program's serial reductions then cover more of
    the row and fewer programs meet at each barrier)."""
    return 256 if n <= 8192 else 2048


def plan_programs(rows: int, n: int, device: torch.device, config: TopkConfig = DEFAULT_CONFIG,
                  staged: bool = False) -> tuple[int, int] | None:
    """-> (programs per row, slots per program), or None when the one-launch form does not fit.

    A grid barrier needs every program of a row resident: on a GPU the launch takes at most one
    program per multiprocessor over all rows (slices grow, up to SLICE_MAX slots, to fit), on the
    CPU interpreter one program per row (programs run one after another). Staged launches have no
    barrier: any count fits."""
    slice_len = max(16, config.onepass_slice or auto_slice(n))
    programs = max(1, host_math.cdiv(n, slice_len))
    if staged:
        return programs, slice_len
    budget = multiprocessor_count(device) // max(rows, 1) if device.type == "cuda" else 1
    if budget < 1:
        return None
    if programs > budget:
        slice_len = max(slice_len, host_math.next_power_of_2(host_math.cdiv(n, budget)))
        if slice_len > SLICE_MAX:
            return None
        programs = host_math.cdiv(n, slice_len)
    return programs, slice_len


def select_constexprs(k: int, workspace: SelectWorkspace,
                      config: TopkConfig = DEFAULT_CONFIG) -> dict[str, int]:
    """Constexprs and launch options of the select kernel, less HAS_NCAND and STAGE."""
    block = host_math.next_power_of_2(workspace.slice_len)
    return dict(
        BLOCK=block, MAX_P=host_math.next_power_of_2(workspace.programs), K_PAD=host_math.next_power_of_2(k),
        COARSE_BITS=config.coarse_bits, RANK_ALL=config.rank_all, RANK_OWN_MAX=config.rank_own_max,
        LOG_SPLITS=config.tie_log_splits,
        TIE_BLOCK=config.rank_tie_block,
        LIST_BLOCK=config.rank_list_block, num_warps=4 if block <= 1024 else 8,
    )


def select_rows(
    scores: torch.Tensor,
    cand_rows: torch.Tensor,
    k: int,
    out: torch.Tensor,
    workspace: SelectWorkspace,
    num_candidates: torch.Tensor | None = None,
    *,
    config: TopkConfig = DEFAULT_CONFIG,
    staged: bool | None = None,
) -> torch.Tensor:
    """Top-k of each row in one launch (staged: one launch a stage). scores [B, N] fp32;
    cand_rows [B, N] int32 (-1 = none); out [B, k] int32; num_candidates [B] int32 or None.
    Staged defaults to the interpreter's need (more than one program a row)."""
    rows, n = cand_rows.shape
    if staged is None:
        staged = interpreting() and workspace.programs > 1
    assert workspace.state.shape[:2] == (rows, workspace.programs), "workspace rows / plan"
    assert workspace.counters.shape == (rows, NUM_COUNTERS)
    assert workspace.hist.shape == (rows, 1 << config.coarse_bits), "workspace.hist vs config.coarse_bits"
    assert workspace.tie_keys.shape == (rows, n) and workspace.tie_index.shape == (rows, n)
    assert workspace.programs * workspace.slice_len >= n, "the plan does not cover the row"
    args = (scores, cand_rows, num_candidates if num_candidates is not None else cand_rows, workspace.hist,
            workspace.counters, workspace.state, workspace.tie_keys, workspace.tie_index, out, n, k,
            workspace.slice_len)
    consts = select_constexprs(k, workspace, config)
    for stage in (1, 2, 3, 4) if staged else (0,):
        _select_kernel[(rows, workspace.programs)](
            *args, HAS_NCAND=num_candidates is not None, STAGE=stage, **consts)
    return out


def topk_rows(
    scores: torch.Tensor,
    cand_rows: torch.Tensor,
    k: int,
    num_candidates: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    workspace: TopkWorkspace | SelectWorkspace | None = None,
    config: TopkConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """Top-k alone on precomputed scores: scores [B, N] fp32 contiguous; cand_rows [B, N] int32
    (-1 = none); num_candidates [B] int32 or None -> [B, k] int32 pool rows (candidate order,
    -1 padded).

    One launch when given a `SelectWorkspace`, or given no workspace on a GPU where the rows fit
    its plan (`config.onepass`); else the two launches (`triton.topk_rows`)."""
    assert scores.dim() == 2 and scores.dtype == torch.float32 and scores.is_contiguous()
    rows, n = scores.shape
    if workspace is None and config.onepass and scores.is_cuda and rows and n:
        plan = plan_programs(rows, n, scores.device, config)
        if plan is not None:
            workspace = SelectWorkspace.allocate(rows, n, plan, scores.device, config.coarse_bits)
    if not isinstance(workspace, SelectWorkspace):
        return topk_rows_two_launches(scores, cand_rows, k, num_candidates, out=out, workspace=workspace,
                                      config=config)
    check_candidates(cand_rows, num_candidates, rows)
    assert cand_rows.shape == scores.shape and cand_rows.device == scores.device
    out = prepare_out(rows, k, scores.device, out)
    if rows == 0:
        return out
    if n == 0:
        return out.fill_(-1)
    return select_rows(scores, cand_rows, k, out, workspace, num_candidates, config=config)
