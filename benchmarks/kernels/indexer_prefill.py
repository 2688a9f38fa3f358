"""The indexer's score launch at a prefill step's shape, with and without each row's causal count.

One sequence's 8192-token step at the end of a 64K prompt (the last of eight steps): row t reads the
first c_t = (56K + t + 1) // 4 of the step's N = 16384 C4 entries, as `Indexer._select_kernel` passes
them. V4-Flash indexer widths (64 heads x 128 channels, bf16), k = 512.

Variants:
* `per_row`: counts given, so each row's blocks past its count are skipped (the engine's launch);
* `per_row_no_counts`: the same rows with the slots past each count marked -1 instead, which every
  row walks to N (the launch before the cut).
Each is checked on sampled rows against the float32 reference scores (`kernel_topk.check_selection`:
every pick reaches the reference's k-th score less 1e-3 of the row's range), with the fraction of rows
whose picks equal the counted launch's, then its score launch is timed alone (eager: the step's
candidate lists alone are 512 MB), with TFLOP/s on the causal products (2 * 64 * 128 per counted
candidate).

(Scoring two or four rows of a sequence a program against one gathered key tile, one product
[BLOCK_N, 128] x [128, rows * 64], was slower than one row a program and was removed; the figures
are in antumbra/kernels/indexer_topk/TUNING.md.)

    python -m benchmarks run kernels --only indexer_prefill [--smoke]
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from ..lib.context import Context
from ..lib.timing import time_us
from .topk import check_selection

HEADS, HEAD_DIM, TOPK = 64, 128, 512


def _inputs(rows: int, n: int, first: int, device: str, g: torch.Generator) -> dict[str, Any]:
    pool_rows = n + 1024
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=g).to(device=device, dtype=torch.bfloat16)
    weights = (torch.randn(rows, HEADS, generator=g) * HEADS**-0.5).to(device)
    keys = torch.randn(pool_rows, HEAD_DIM, generator=g).to(device=device, dtype=torch.bfloat16)
    listing = torch.randperm(pool_rows, generator=g)[:n].to(device=device, dtype=torch.int32)
    counts = torch.clamp((first + torch.arange(rows, device=device) + 1) // 4, max=n).to(torch.int32)
    valid = torch.arange(n, device=device)[None, :] < counts[:, None]
    cand = torch.where(valid, listing[None, :], -1).to(torch.int32).contiguous()
    return {"q": q, "weights": weights, "keys": keys, "cand": cand, "counts": counts}


def run(ctx: Context) -> dict[str, Any]:
    device, smoke = ctx.device, ctx.smoke
    from antumbra.kernels.indexer_topk import indexer_scores_reference, topk_rows_reference
    from antumbra.kernels.indexer_topk import triton as K

    rows, n, first = (12, 40, 100) if smoke else (8192, 16384, 57344)
    g = torch.Generator().manual_seed(7)
    x = _inputs(rows, n, first, device, g)
    args = (x["q"], x["weights"], x["keys"], x["cand"])
    products = 2 * HEADS * HEAD_DIM * int(x["counts"].sum())
    config = K.TopkConfig(score_block_n=16, filter_block_n=64, keys_block_n=64) if smoke else K.DEFAULT_CONFIG
    k = min(TOPK, n)
    want = K.indexer_topk(*args, k, x["counts"], config=config)
    sample = torch.linspace(0, rows - 1, 4 if smoke else 24).long().unique().to(device)
    ref_scores = indexer_scores_reference(x["q"][sample], x["weights"][sample], x["keys"], x["cand"][sample],
                                          x["counts"][sample])
    ref = topk_rows_reference(ref_scores, x["cand"][sample], k)
    workspace = K.TopkWorkspace.allocate(rows, n, k, device, config.coarse_bits)
    reps = 1 if smoke else 5
    table, checks = [], []
    for label, counts in (("per_row", x["counts"]), ("per_row_no_counts", None)):
        got = K.indexer_topk(*args, k, counts, config=config)
        same_rows = float((got.sort(1).values == want.sort(1).values).all(1).float().mean())
        check = check_selection(got[sample], ref, ref_scores, x["cand"][sample], tol=1e-3)
        checks.append({"variant": label, "rows_same_as_counted": same_rows, **check})
        call = functools.partial(K.launch_scores, *args, counts, workspace, HEAD_DIM**-0.5, config)

        def clean(call=call) -> None:  # the filter, which zeroes the histogram, does not run here
            call()
            workspace.hist.zero_()

        us = time_us([clean], device, reps=reps, graph=False)
        table.append({"variant": label, "scores_us": us, "tflops": products / (us * 1e6), "ok": check["ok"],
                      "rows_same_as_counted": same_rows})
    return {
        "rows": rows, "n": n, "first_position": first, "k": k, "causal_tflop": products / 1e12,
        "config": dataclasses.asdict(config), "table": table, "checks": checks,
        "all_checks_ok": all(c["ok"] for c in checks),
        "indexer_prefill_counts_vs_no_counts": table[1]["scores_us"] / table[0]["scores_us"],
    }


# The ratios this benchmark puts in its suite's `ratios` table.
HEADLINE = ("indexer_prefill_counts_vs_no_counts",)
