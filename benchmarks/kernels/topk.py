"""Indexer scores + top-512 kernels vs PyTorch, at V4-Flash indexer shapes.

64 indexer heads x 128 dims, bf16 queries and keys, fp32 head weights, k = 512; candidates are
rows of a C4 indexer-key pool (random rows of a pool of up to 2 GB, several row sets rotated
through so that key rows come from HBM), the output is pool rows.

Two comparisons, reported separately:

* fused: `indexer_topk` (score kernel + filter kernel) vs the PyTorch chain
  `indexer_topk_reference(stable=False)`: gather key rows, fp32 einsum, ReLU, head-weighted sum,
  `torch.topk(k=512)`, gather pool rows. Headline `topk_vs_torch_B1_N65536`.
* top-k only: `topk_rows` on precomputed fp32 scores vs bare `torch.topk(k=512)` on the same
  scores (headline `topk_only_vs_torch_topk_B1_N65536`), and vs `torch.topk` followed by the
  gather of pool rows that `topk_rows` also does (`topk_only_vs_torch_topk_rows_B1_N65536`).
  `onepass.topk_rows` takes the one-launch select where the rows fit one wave, else the
  two launches (`triton.topk_rows`); both are timed (`topk_onepass_us`, `topk_two_launch_us`),
  and `onepass_sweep` times the one-launch select's slice and ranking shapes at batch 1 and 8.

Correctness for every timed shape, on fresh random inputs with poisoned outputs (-2): the
kernel's picks must be distinct valid candidates, as many as the reference's, and every pick's
reference score must reach the reference's k-th score (less a bf16-rounding tolerance: the
kernel multiplies bf16 on tensor cores, the reference in fp32); `topk_rows` must pick exactly
the reference's set (the same fp32 scores; ties to the lowest index), in candidate order, on
normal scores and on integer scores of 50 values (long tie lists across programs), by each path.

Counted bytes: fused = B*N*(di*2 + 4) (key rows, candidate rows) + q, weights, output;
top-k only = B*N*(4 + 4) (scores, candidate rows) + output. Reported as a fraction of the
copy bandwidth measured in the same run.

    python -m benchmarks run kernels --only topk [--smoke]
"""

from __future__ import annotations

import functools
import itertools
import os
from typing import Any

import torch

from ..lib.context import Context
from ..lib.timing import time_us

POISON = -2
TORCH_CHAIN_MAX_ELEMS = 2**22  # B*N above this: the PyTorch chain's fp32 gather would need > 2 GB
CHECK_MAX_ELEMS = 2**21  # the fused check compares the first rows up to this many candidates


# ----- measurement helpers -----


def exact_selection(topk_rows: Any, scores: torch.Tensor, cand: torch.Tensor, k: int, workspace: Any,
                    poison: int) -> bool:
    """topk_rows on a poisoned output: exactly the reference's rows, in candidate order, -1 after."""
    from antumbra.kernels.indexer_topk.reference import topk_rows_reference

    out = torch.full((scores.shape[0], k), poison, dtype=torch.int32, device=scores.device)
    topk_rows(scores, cand, k, out=out, workspace=workspace)
    ref = topk_rows_reference(scores, cand, k)
    if not torch.equal(out.sort(1).values, ref.sort(1).values):
        return False
    # Candidate order: each output row's candidate positions ascend.
    position = torch.full((int(cand.max()) + 2,), -1, dtype=torch.long, device=cand.device)
    for b in range(cand.shape[0]):
        position[cand[b].long()] = torch.arange(cand.shape[1], device=cand.device)
        picked = position[out[b][out[b] >= 0].long()]
        if bool((picked[1:] <= picked[:-1]).any()):
            return False
        position[cand[b].long()] = -1
    return True


def onepass_sweep(device: str, k: int, g: torch.Generator, reps: int) -> dict[str, Any]:
    """The one-launch select at batch 1 (N 4096, 65536) and 8 (N 65536) over slices and tie policies
    (owners rank every list; every program searches every list; the default split at rank_own_max):
    each checked exact on normal and on integer (tie-heavy) scores, then timed over rotated inputs."""
    from antumbra.kernels.indexer_topk import onepass
    from antumbra.kernels.indexer_topk import triton as kernels

    rows_out = []
    for batch, n in ((1, 4096), (1, 65536), (8, 65536)):
        sets = [torch.randn(batch, n, device=device, generator=g) for _ in range(4)]
        cands = [torch.stack([torch.randperm(4 * n, device=device, generator=g)[:n] for _ in range(batch)])
                 .to(torch.int32) for _ in range(4)]
        for slice_len, bits, (rank_all, own_max) in itertools.product(
                (256, 2048, 4096), (8,), ((0, 0), (2048, 0), (2048, 256))):
            config = kernels.TopkConfig(onepass_slice=slice_len, rank_all=rank_all, rank_own_max=own_max,
                                        coarse_bits=bits)
            plan = onepass.plan_programs(batch, n, torch.device(device), config)
            if plan is None or plan[1] != slice_len:
                continue
            ws = onepass.SelectWorkspace.allocate(batch, n, plan, device, bits)
            row: dict[str, Any] = {"batch": batch, "n": n, "slice": slice_len, "rank_all": rank_all,
                                   "rank_own_max": own_max, "coarse_bits": bits, "programs": plan[0]}
            topk = functools.partial(onepass.topk_rows, config=config)
            row["exact"] = all(exact_selection(topk, s, cands[0], k, ws, POISON)
                               for s in (sets[0], sets[1].mul(8).round().clamp(-25, 24)))
            outs = [torch.empty(batch, k, dtype=torch.int32, device=device) for _ in sets]
            calls = [functools.partial(onepass.topk_rows, sets[i], cands[i], k, out=outs[i], workspace=ws,
                                       config=config) for i in range(len(sets))]
            row["us"] = time_us(calls, device, reps=reps)
            rows_out.append(row)
    best = {}
    for batch, n in ((1, 4096), (1, 65536), (8, 65536)):
        ok = [r for r in rows_out if (r["batch"], r["n"]) == (batch, n) and r["exact"]]
        if ok:
            best[f"B{batch}_N{n}"] = min(ok, key=lambda r: r["us"])
    return {"rows": rows_out, "best": best, "all_exact": all(r["exact"] for r in rows_out)}


def _torch_topk_rows(scores: torch.Tensor, cand: torch.Tensor, k: int) -> torch.Tensor:
    """The PyTorch top-k with the pool-row lookup `topk_rows` also does."""
    return cand.gather(1, torch.topk(scores, k, dim=1).indices)


# ----- checks -----
def check_selection(
    out: torch.Tensor, ref: torch.Tensor, scores: torch.Tensor, cand: torch.Tensor, tol: float
) -> dict[str, Any]:
    """out, ref: [B, k] pool rows; scores: [B, N] reference scores (-inf = invalid); cand: [B, N].

    A pick is acceptable when its reference score reaches the reference's k-th score less
    `tol` (relative to the row's score range), so that near-ties may swap."""
    worst_gap, overlap, problems = 0.0, [], []
    for b in range(out.shape[0]):
        row_out, row_ref = out[b], ref[b]
        if bool((row_out == POISON).any()):
            problems.append(f"row {b}: unwritten output")
            continue
        got, want = row_out[row_out >= 0], row_ref[row_ref >= 0]
        if got.numel() != want.numel() or got.unique().numel() != got.numel():
            problems.append(
                f"row {b}: {got.numel()} picks (distinct {got.unique().numel()}), want {want.numel()}"
            )
            continue
        if got.numel() == 0:
            continue
        position = torch.full((int(cand[b].max()) + 1,), -1, dtype=torch.long, device=cand.device)
        valid = cand[b] >= 0
        position[cand[b][valid].long()] = torch.nonzero(valid).flatten()
        if bool((position[got.long()] < 0).any()):
            problems.append(f"row {b}: a pick is not a candidate")
            continue
        got_scores = scores[b][position[got.long()]]
        kth = scores[b][position[want.long()]].min()
        finite = scores[b][scores[b].isfinite()]
        spread = float((finite.max() - finite.min()).clamp(min=1e-30))
        gap = float((kth - got_scores.min()).clamp(min=0)) / spread
        worst_gap = max(worst_gap, gap)
        overlap.append(len(set(got.tolist()) & set(want.tolist())) / want.numel())
        if gap > tol:
            problems.append(f"row {b}: a pick scores {gap:.2e} (of the range) below the k-th")
    return {
        "ok": not problems,
        "problems": problems[:4],
        "worst_gap_below_kth": worst_gap,
        "min_set_overlap": min(overlap) if overlap else 1.0,
    }


# ----- inputs -----
class Problem:
    """One shape: `sets` independent inputs over one shared key pool."""

    def __init__(
        self,
        batch: int,
        n: int,
        heads: int,
        head_dim: int,
        pool: torch.Tensor,
        sets: int,
        g: torch.Generator,
        holes: bool,
    ):
        device = pool.device
        self.batch, self.n = batch, n
        self.q = [
            torch.randn(batch, heads, head_dim, device=device, generator=g).to(pool.dtype)
            for _ in range(sets)
        ]
        self.w = [torch.randn(batch, heads, device=device, generator=g) * heads**-0.5 for _ in range(sets)]
        self.cand = []
        for _ in range(sets):
            # Distinct rows per request, as a request's compressed entries are.
            rows = torch.stack(
                [torch.randperm(pool.shape[0], device=device, generator=g)[:n] for _ in range(batch)]
            ).to(torch.int32)
            if holes:
                rows[0, n // 3 :] = -1  # a request with fewer entries than the widest one
                if batch > 1:
                    rows[1, ::7] = -1
            self.cand.append(rows)
        self.scores = [torch.randn(batch, n, device=device, generator=g) for _ in range(sets)]
        self.pool = pool


def run(ctx: Context) -> dict[str, Any]:
    """Correctness at real shapes, then kernel vs PyTorch timings. Returns a JSON-able dict."""
    device, smoke = ctx.device, ctx.smoke
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
    from antumbra.kernels.indexer_topk import onepass
    from antumbra.kernels.indexer_topk import triton as kernels
    from antumbra.kernels.indexer_topk.reference import (
        indexer_scores_reference,
        indexer_topk_reference,
        topk_rows_reference,
    )

    g = torch.Generator(device=device).manual_seed(0)
    if smoke:
        heads, head_dim, k = 4, 32, 16
        batches, sizes, headline = [1, 2], [300, 1000], (1, 1000)
        pool_rows, rotate, reps = 4096, 1, 1
    else:
        heads, head_dim, k = 64, 128, 512
        batches, sizes, headline = [1, 8, 32, 64], [4096, 16384, 65536, 262144], (1, 65536)
        pool_rows, rotate, reps = 2**23, 4, 20  # 8M rows x 256 B = 2 GB of bf16 keys
    copy_gbps = ctx.rates.copy_gbps
    bw = copy_gbps
    pool = torch.randn(pool_rows, head_dim, device=device, generator=g).to(torch.bfloat16)

    checks, table = [], []
    for batch in batches:
        for n in sizes:
            prob = Problem(batch, n, heads, head_dim, pool, rotate, g, holes=False)
            fresh = Problem(batch, n, heads, head_dim, pool, 1, g, holes=True)
            q, w, cand = fresh.q[0], fresh.w[0], fresh.cand[0]

            # Correctness: fused path against fp32 scores of the same bf16 inputs (rows are
            # independent; the reference runs on as many leading rows as memory allows).
            out = torch.full((batch, k), POISON, dtype=torch.int32, device=device)
            kernels.indexer_topk(q, w, pool, cand, k, out=out)
            m = max(1, min(batch, CHECK_MAX_ELEMS // n))
            ref_scores = indexer_scores_reference(q[:m], w[:m], pool, cand[:m])
            ref = topk_rows_reference(ref_scores, cand[:m], k)
            fused_check = {"rows_checked": m, **check_selection(out[:m], ref, ref_scores, cand[:m], tol=1e-3)}
            fused_check["ok"] = fused_check["ok"] and not bool((out == POISON).any())
            # Top-k only: exact, on the very same fp32 scores, by each path (the default first).
            sel_plan = onepass.plan_programs(batch, n, torch.device(device)) if device == "cuda" else None
            paths: list[Any] = [None, kernels.TopkWorkspace.allocate(batch, n, k, device)]
            exact = True
            for scores in (fresh.scores[0], fresh.scores[0].mul(8).round().clamp(-25, 24)):
                for ws_path in paths:
                    exact = exact and exact_selection(onepass.topk_rows, scores, cand, k, ws_path, POISON)
            checks.append(
                {
                    "batch": batch,
                    "n": n,
                    "fused": fused_check,
                    "topk_only_exact": exact,
                    "ok": fused_check["ok"] and exact,
                }
            )

            # Timing, over rotating input sets; kept workspaces need no memset between calls.
            ws = kernels.TopkWorkspace.allocate(batch, n, k, device, kernels.DEFAULT_CONFIG.coarse_bits)
            sel_ws = None
            if sel_plan is not None:
                sel_ws = onepass.SelectWorkspace.allocate(batch, n, sel_plan, device)
            outs = [torch.empty(batch, k, dtype=torch.int32, device=device) for _ in range(rotate)]
            fused_calls = [
                functools.partial(
                    kernels.indexer_topk,
                    prob.q[i],
                    prob.w[i],
                    pool,
                    prob.cand[i],
                    k,
                    out=outs[i],
                    workspace=ws,
                )
                for i in range(rotate)
            ]
            two_calls = [
                functools.partial(
                    kernels.topk_rows, prob.scores[i], prob.cand[i], k, out=outs[i], workspace=ws
                )
                for i in range(rotate)
            ]
            one_calls = [
                functools.partial(
                    onepass.topk_rows, prob.scores[i], prob.cand[i], k, out=outs[i], workspace=sel_ws
                )
                for i in range(rotate)
            ]
            torch_topk_calls = [
                functools.partial(torch.topk, prob.scores[i], k, dim=1) for i in range(rotate)
            ]
            torch_rows_calls = [
                functools.partial(_torch_topk_rows, prob.scores[i], prob.cand[i], k) for i in range(rotate)
            ]
            row: dict[str, Any] = {"batch": batch, "n": n}
            row["fused_us"] = time_us(fused_calls, device, reps=reps)
            row["topk_two_launch_us"] = time_us(two_calls, device, reps=reps)
            if sel_ws is not None:
                row["topk_onepass_us"] = time_us(one_calls, device, reps=reps)
                row["onepass_plan"] = list(sel_plan or ())
            row["topk_only_us"] = row.get("topk_onepass_us", row["topk_two_launch_us"])
            row["torch_topk_us"] = time_us(torch_topk_calls, device, reps=reps)
            row["torch_topk_rows_us"] = time_us(torch_rows_calls, device, reps=reps)
            if batch * n <= TORCH_CHAIN_MAX_ELEMS:
                chain = [
                    functools.partial(
                        indexer_topk_reference, prob.q[i], prob.w[i], pool, prob.cand[i], k, stable=False
                    )
                    for i in range(rotate)
                ]
                row["torch_chain_us"] = time_us(chain, device, reps=reps)
                row["fused_vs_torch"] = row["torch_chain_us"] / row["fused_us"]
            row["topk_only_vs_torch_topk"] = row["torch_topk_us"] / row["topk_only_us"]
            row["topk_only_vs_torch_topk_rows"] = row["torch_topk_rows_us"] / row["topk_only_us"]
            fused_bytes = batch * n * (head_dim * 2 + 4) + batch * heads * (head_dim * 2 + 4) + batch * k * 4
            only_bytes = batch * n * 8 + batch * k * 4
            row["fused_frac_copy_bw"] = fused_bytes / (row["fused_us"] * 1e3) / bw
            row["topk_only_frac_copy_bw"] = only_bytes / (row["topk_only_us"] * 1e3) / bw
            table.append(row)

    head = next(r for r in table if (r["batch"], r["n"]) == headline)
    sweep = onepass_sweep(device, k, g, reps) if device == "cuda" and not smoke else {}
    alone = {f"topk_alone_vs_torch_B{r['batch']}_N{r['n']}": r["topk_only_vs_torch_topk"]
             for r in table if r["batch"] == 1}
    checks_ok = all(c["ok"] for c in checks)
    return {
        "benchmark": "kernel_topk",
        "smoke": smoke,
        "shape": {
            "index_heads": heads,
            "index_head_dim": head_dim,
            "k": k,
            "keys_dtype": "bfloat16",
            "config": kernels.DEFAULT_CONFIG.__dict__,
        },
        "copy_gbps_measured": copy_gbps,
        "all_checks_ok": checks_ok,
        "checks": checks,
        "table": table,
        "headline_shape": {"batch": headline[0], "n": headline[1]},
        "topk_vs_torch_B1_N65536": head.get("fused_vs_torch"),
        "topk_only_vs_torch_topk_B1_N65536": head["topk_only_vs_torch_topk"],
        "topk_only_vs_torch_topk_rows_B1_N65536": head["topk_only_vs_torch_topk_rows"],
        "fused_us_B1_N65536": head["fused_us"],
        "topk_only_us_B1_N65536": head["topk_only_us"],
        "onepass_sweep": sweep,
        # The names for top-k alone at batch 1 (every size), only from a run whose checks passed.
        **(alone if checks_ok else {}),
    }


# The ratios this benchmark puts in its suite's `ratios` table.
HEADLINE = ("topk_vs_torch_B1_N65536", "topk_only_vs_torch_topk_B1_N65536")
HEADLINE_PREFIXES = ("topk_alone_vs_torch_",)
