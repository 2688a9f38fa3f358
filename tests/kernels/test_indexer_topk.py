"""Indexer scores + radix-select top-k: Triton kernels (CPU interpreter) vs reference,
reference vs the model's `Indexer.select`.

Outputs are poisoned with -2 (never a valid answer: rows are >= 0 or -1 padding).
Selections are compared as sets, and through the scores of the chosen candidates.
"""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import pytest
import torch

import antumbra.kernels.indexer_topk.triton as triton_kernels  # noqa: E402
from antumbra.cachestore.row_format import RowFormat
from antumbra.kernels.indexer_topk.reference import (
    indexer_scores_reference,
    indexer_topk_reference,
    topk_rows_reference,
)
from antumbra.replicas.model.compressor import Indexer

# Small blocks so that the tiny rows still spread over several programs and steps; SMALL resolves tie
# lists longer than 256 by streaming them from memory, the others in registers; NARROW_SEARCH resolves
# them in registers with 4 bins a search pass instead of 32 (more passes, the same choice).
SMALL = triton_kernels.TopkConfig(score_block_n=32, filter_block_n=64, finish_block_n=32, keys_block_n=64,
                                  finish_regs=256)
FINISH_IN_ONE_STEP = triton_kernels.TopkConfig(score_block_n=32, filter_block_n=64, finish_block_n=512,
                                               keys_block_n=64)
NARROW_SEARCH = triton_kernels.TopkConfig(score_block_n=32, filter_block_n=64, finish_block_n=512,
                                          keys_block_n=64, tie_log_splits=2)
WIDE_BUCKETS = triton_kernels.TopkConfig(coarse_bits=11, score_block_n=32, filter_block_n=64, keys_block_n=64)
CONFIGS = {"small": SMALL, "wide": WIDE_BUCKETS, "narrow-search": NARROW_SEARCH}
POISON = -2


def _assert_same_selection(
    out: torch.Tensor, ref: torch.Tensor, scores: torch.Tensor, cand: torch.Tensor
) -> None:
    """out, ref: [B, k] pool rows; scores: [B, N] reference scores (-inf = invalid)."""
    assert not (out == POISON).any(), "output left unwritten"
    for b in range(out.shape[0]):
        got = out[b][out[b] >= 0]
        want = ref[b][ref[b] >= 0]
        assert got.numel() == want.numel(), f"row {b}: {got.numel()} picks, expected {want.numel()}"
        assert torch.equal(out[b, got.numel() :], torch.full_like(out[b, got.numel() :], -1))
        assert got.unique().numel() == got.numel(), f"row {b}: duplicate picks"
        score_of = {
            int(r): float(s) for r, s in zip(cand[b].tolist(), scores[b].tolist(), strict=True) if r >= 0
        }
        got_scores = torch.tensor(sorted(score_of[int(r)] for r in got))
        want_scores = torch.tensor(sorted(score_of[int(r)] for r in want))
        torch.testing.assert_close(got_scores, want_scores, rtol=1e-5, atol=1e-6)
        assert set(got.tolist()) == set(want.tolist()), f"row {b}: different candidates"


def _indexer_inputs(seed: int, dtype: torch.dtype, rows: int, heads: int, head_dim: int, pool: int, n: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, head_dim, generator=gen).to(dtype)
    weights = torch.randn(rows, heads, generator=gen) * heads**-0.5
    keys_pool = torch.randn(pool, head_dim, generator=gen).to(dtype)
    cand = torch.stack([torch.randperm(pool, generator=gen)[:n] for _ in range(rows)]).to(torch.int32)
    cand[1, 9:] = -1  # fewer valid candidates than k
    cand[2, ::3] = -1  # holes
    return q, weights, keys_pool, cand


@pytest.mark.parametrize("path", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("use_count", [False, True], ids=["padded", "counts"])
def test_indexer_topk_matches_reference(dtype: torch.dtype, use_count: bool, path: str) -> None:
    rows, heads, head_dim, pool, n, k = 3, 4, 32, 500, 301, 16
    q, weights, keys_pool, cand = _indexer_inputs(3 + use_count + 2 * (dtype == torch.float32), dtype, rows,
                                                  heads, head_dim, pool, n)
    counts = torch.tensor([n, n, 200], dtype=torch.int32) if use_count else None
    out = torch.full((rows, k), POISON, dtype=torch.int32)
    triton_kernels.indexer_topk(q, weights, keys_pool, cand, k, counts, out=out, config=CONFIGS[path])
    ref = indexer_topk_reference(q, weights, keys_pool, cand, k, counts)
    scores = indexer_scores_reference(q, weights, keys_pool, cand, counts)
    _assert_same_selection(out, ref, scores, cand)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # fp16 buckets saturate
@pytest.mark.parametrize("path", ["parallel", "narrow-search"])
@pytest.mark.parametrize("case", ["few-values", "signed-zeros", "one-fp16-value", "spread"])
def test_topk_rows_ties_and_distributions(case: str, path: str) -> None:
    """Exact ties resolve to the lowest candidate indices; tie lists that need every byte
    of the key (and of the index) resolve exactly; k below the valid count and above it
    for the row with fewer valid candidates."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    rows, n = 3, 300
    cand = torch.stack([torch.randperm(1000, generator=gen)[:n] for _ in range(rows)]).to(torch.int32)
    if case == "few-values":
        scores = torch.randint(0, 5, (rows, n), generator=gen).float()
    elif case == "signed-zeros":
        scores = torch.zeros(rows, n)
        scores[:, ::2] = -0.0
        scores[0, :10] = torch.rand(10, generator=gen)
    elif case == "one-fp16-value":
        scores = 1.0 + torch.rand(rows, n, generator=gen) * 1e-4  # one fp16 bucket: long tie list
    else:
        scores = torch.randn(rows, n, generator=gen) * torch.tensor([1e-20, 1.0, 1e20])[:, None]
    cand[2, 20:] = -1  # fewer valid candidates than the larger k
    # Parallel filter: long tie lists are streamed in steps of 32 in one case, resolved in registers in the
    # others.
    config = SMALL if case == "one-fp16-value" else FINISH_IN_ONE_STEP
    if path == "narrow-search" and case != "one-fp16-value":
        config = NARROW_SEARCH
    for k in (7, 40):
        out = torch.full((rows, k), POISON, dtype=torch.int32)
        triton_kernels.topk_rows(scores, cand, k, out=out, config=config)
        ref = topk_rows_reference(scores, cand, k)  # stable sort: the lowest index wins ties
        assert not (out == POISON).any()
        for b in range(rows):
            assert sorted(out[b].tolist()) == sorted(ref[b].tolist()), f"{case} k={k} row {b}"
            position = {int(r): j for j, r in enumerate(cand[b].tolist())}
            picked = [position[int(r)] for r in out[b].tolist() if r >= 0]
            assert picked == sorted(picked), f"{case} k={k} row {b}: not in candidate order"


@pytest.mark.parametrize("path", ["small", "narrow-search"])
def test_workspace_reuse_is_clean_and_deterministic(path: str) -> None:
    rows, n, k = 2, 200, 32
    gen = torch.Generator().manual_seed(5)
    cand = torch.stack([torch.randperm(400, generator=gen)[:n] for _ in range(rows)]).to(torch.int32)
    counts = torch.tensor([n, 150], dtype=torch.int32)
    workspace = triton_kernels.TopkWorkspace.allocate(rows, n, k, "cpu", SMALL.coarse_bits)
    workspace.keys.fill_(POISON)
    workspace.tie_keys.fill_(POISON)
    workspace.tie_index.fill_(POISON)
    workspace.selected.fill_(POISON)
    config = CONFIGS[path]
    scores = torch.randn(rows, n, generator=gen)
    first = triton_kernels.topk_rows(scores, cand, k, counts, workspace=workspace, config=config)
    again = triton_kernels.topk_rows(scores, cand, k, counts, workspace=workspace, config=config)
    assert torch.equal(first, again), "same input, same output order"
    assert torch.equal(first.sort(1).values, topk_rows_reference(scores, cand, k, counts).sort(1).values)
    assert not workspace.hist.any() and not workspace.counters.any(), "workspace left dirty"
    other = torch.randn(rows, n, generator=gen)
    third = triton_kernels.topk_rows(other, cand, k, counts, workspace=workspace, config=config)
    assert torch.equal(third.sort(1).values, topk_rows_reference(other, cand, k, counts).sort(1).values)


@pytest.mark.parametrize("fused", [True, False], ids=["scores", "keys"])
def test_counts_cut_rows_whole_blocks_past_their_prefix(fused: bool) -> None:
    """A causal prefill's rows: counts from none to all of N, each row's slots past its count holding
    live-looking pool rows, and a reused workspace whose keys hold valid-looking garbage (the kernels
    skip the blocks past a row's count and must never read those keys): the picks equal the
    reference's on the counted prefixes, for programs whose runs start past the count, inside the
    last block and at a block boundary."""
    rows, heads, head_dim, pool, n, k = 6, 4, 32, 700, 640, 24
    q, weights, keys_pool, _ = _indexer_inputs(41, torch.float32, rows, heads, head_dim, pool, n)
    gen = torch.Generator().manual_seed(43)
    cand = torch.stack([torch.randperm(pool, generator=gen)[:n] for _ in range(rows)]).to(torch.int32)
    counts = torch.tensor([0, 1, 31, 64, 333, n], dtype=torch.int32)
    workspace = triton_kernels.TopkWorkspace.allocate(rows, n, k, "cpu", SMALL.coarse_bits)
    workspace.keys.fill_(0x7F000000)  # the key of a large positive score
    scores = indexer_scores_reference(q, weights, keys_pool, cand, counts)
    out = torch.full((rows, k), POISON, dtype=torch.int32)
    if fused:
        triton_kernels.indexer_topk(q, weights, keys_pool, cand, k, counts, out=out, workspace=workspace,
                                    config=SMALL)
    else:
        triton_kernels.topk_rows(scores, cand, k, counts, out=out, workspace=workspace, config=SMALL)
    ref = indexer_topk_reference(q, weights, keys_pool, cand, k, counts)
    _assert_same_selection(out, ref, scores, cand)
    assert (out[0] == -1).all() and (out[1, 1:] == -1).all() and (out[1, 0] == cand[1, 0])


@pytest.mark.parametrize("path", ["small", "narrow-search"])
def test_reference_and_kernel_match_model_select(path: str) -> None:
    """`Indexer.select` of the model, on a prefill of two sequences, picks the same rows."""
    torch.manual_seed(13)
    hidden, q_rank, heads, head_dim, rate, topk = 32, 16, 4, 32, 4, 8
    indexer = Indexer(hidden, q_rank, heads, head_dim, rate, topk, 1e-6).eval()
    lengths, starts, entries_per_seq = [6, 5], [60, 40], 20
    t = sum(lengths)
    x, q_residual = torch.randn(t, hidden), torch.randn(t, q_rank)
    cos, sin = torch.ones(t, 4), torch.zeros(t, 4)  # identity RoPE
    pool = SimpleNamespace(
        rows=torch.randn(64, head_dim), row_format=RowFormat.plain(head_dim, torch.float32)
    )
    entry_rows, entry_valid, spans, row0 = [], [], [], 0
    for seq, (count, start) in enumerate(zip(lengths, starts, strict=True)):
        for pos in range(start, start + count):
            w = torch.arange(entries_per_seq)
            entry_valid.append(w < (pos + 1) // rate)
            entry_rows.append(torch.where(entry_valid[-1], 30 * seq + w, 0))
        spans.append((row0, row0 + count))
        row0 += count
    index = SimpleNamespace(entry_rows=torch.stack(entry_rows), entry_valid=torch.stack(entry_valid))
    with torch.no_grad():
        model_rows, model_valid = indexer.select(x, q_residual, cos, sin, index, pool, tuple(spans))
        q = indexer.q_b_proj(q_residual).view(t, heads, head_dim).float().contiguous()
        weights = (indexer.scorer.weights_proj(x).float() * heads**-0.5).contiguous()
    cand = torch.where(index.entry_valid, index.entry_rows, -1).to(torch.int32)
    k = model_rows.shape[1]
    ref = indexer_topk_reference(q, weights, pool.rows, cand, k)
    out = torch.full((t, k), POISON, dtype=torch.int32)
    triton_kernels.indexer_topk(q, weights, pool.rows, cand, k, out=out, config=CONFIGS[path])
    counts = index.entry_valid.sum(1).to(torch.int32)  # causal prefixes, as Indexer._select_kernel passes
    counted = triton_kernels.indexer_topk(q, weights, pool.rows, cand, k, counts, config=CONFIGS[path])
    for row in range(t):
        want = set(model_rows[row][model_valid[row]].tolist())
        assert set(ref[row][ref[row] >= 0].tolist()) == want, f"reference row {row}"
        assert set(out[row][out[row] >= 0].tolist()) == want, f"kernel row {row}"
        assert set(counted[row][counted[row] >= 0].tolist()) == want, f"kernel row {row} with counts"


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("seed", range(6))
def test_topk_rows_random_shapes(seed: int) -> None:
    """The selection at random row lengths, picks and score spreads (narrow spreads make the
    search take many passes; integer scores make ties at the k-th), in candidate order, against the
    stable reference; with and without a count cut."""
    gen = torch.Generator().manual_seed(100 + seed)
    rows = 2
    n = int(torch.randint(1, 3000, (1,), generator=gen))
    k = int(torch.randint(1, 700, (1,), generator=gen))
    spread = [1e-6, 1.0, 1e6, 0.0][seed % 4]
    scores = 1.0 + torch.randn(rows, n, generator=gen) * spread
    if seed % 4 == 3:
        scores = torch.randint(-3, 3, (rows, n), generator=gen).float()
    cand = torch.stack([torch.randperm(2 * n + 5, generator=gen)[:n] for _ in range(rows)]).to(torch.int32)
    cand[1, torch.rand(n, generator=gen) < 0.3] = -1
    counts = torch.tensor([n, max(0, n - 7)], dtype=torch.int32) if seed % 2 else None
    out = torch.full((rows, k), POISON, dtype=torch.int32)
    triton_kernels.topk_rows(scores, cand, k, counts, out=out, config=NARROW_SEARCH if seed % 2 else SMALL)
    ref = topk_rows_reference(scores, cand, k, counts)
    for b in range(rows):
        assert sorted(out[b].tolist()) == sorted(ref[b].tolist()), f"n={n} k={k} row {b}"
        position = {int(r): j for j, r in enumerate(cand[b].tolist()) if r >= 0}
        picked = [position[int(r)] for r in out[b].tolist() if r >= 0]
        assert picked == sorted(picked), "not in candidate order"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp4_keys_decode_in_the_score_kernel(dtype: torch.dtype) -> None:
    """Release numerics: keys stored by the model's codec (rotated, FP4), queries rotated and FP4
    round-tripped; the kernel's selection against the reference's on the decoded keys (tolerance:
    the two half products sum in another order than one product)."""
    from antumbra.replicas.model.kv_rows import decode_index, encode_index, fp4_keys, index_row_format
    from antumbra.replicas.model.numerics import RELEASE

    rows, heads, head_dim, pool, n, k = 3, 4, 64, 400, 301, 16
    q, weights, values, cand = _indexer_inputs(29, dtype, rows, heads, head_dim, pool, n)
    fmt = index_row_format(RELEASE, head_dim, dtype)
    keys_pool = encode_index(fmt, values * torch.logspace(-2, 1, head_dim).to(dtype), RELEASE)
    assert keys_pool.dtype == torch.uint8 and keys_pool.shape[1] == 36  # 32 code bytes + 2 exponents, padded
    q = RELEASE.indexer(q)
    out = torch.full((rows, k), POISON, dtype=torch.int32)
    triton_kernels.indexer_topk(q, weights, keys_pool, cand, k, out=out, config=SMALL, fp4_keys=fp4_keys(fmt))
    plain = decode_index(fmt, keys_pool).contiguous()
    ref = indexer_topk_reference(q, weights, plain, cand, k)
    _assert_same_selection(out, ref, indexer_scores_reference(q, weights, plain, cand), cand)
