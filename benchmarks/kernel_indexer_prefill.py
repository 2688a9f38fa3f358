"""The indexer's score launch at a prefill step's shape: per-row programs against row groups.

One sequence's 8192-token step at the end of a 64K prompt (the last of eight steps): row t reads the
first c_t = (56K + t + 1) // 4 of the step's N = 16384 C4 entries, all rows one list, as
`Indexer._select_kernel` passes them. V4-Flash indexer widths (64 heads x 128 channels, bf16), k = 512.

Variants, each checked on sampled rows against the float32 reference scores (`kernel_topk.check_selection`:
every pick reaches the reference's k-th score less 1e-3 of the row's range; the launches sum the heads
in different orders, so near-ties may swap), its rows' picks compared with the default launch's
(the fraction of rows picking the same set is reported), and then timed:
* `per_row`: the decode launch, one row a program (`score_block_n` tiles), with counts;
* `per_row_no_counts`: the same without counts (every row walks all N: before the prefix cut);
* `grouped`: `spans` given, `group_rows` rows a program sharing each gathered key tile, over a sweep of
  (rows, block_n, warps, stages).

Reported: the score launch alone (us, and TFLOP/s on the causal products: 2 * 64 * 128 per counted
candidate) and the whole `indexer_topk` call for the default and the best grouped tile. Eager timing
(the step's candidate lists alone are 512 MB).

    python -m benchmarks.kernel_indexer_prefill [--smoke]
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from .common import standalone_main
from .gpu_measure import time_us as _time_us
from .kernel_topk import check_selection

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


def _grouped_sweep(smoke: bool) -> list[dict[str, int]]:
    if smoke:
        return [dict(group_rows=2, group_block_n=16, group_warps=4, group_stages=2)]
    # (rows, block_n, warps, stages): register-bound shapes (2 x 256 and 4 x 128 at 8 warps hold 237 and
    # 254 registers a thread for sm_90; 4 x 64 at 4 warps spills) sampled around the defaults.
    shapes = [(2, 64, 4, 2), (2, 64, 4, 3), (2, 64, 8, 3), (2, 128, 4, 2), (2, 128, 8, 2), (2, 128, 8, 3),
              (2, 256, 8, 2), (4, 64, 8, 2), (4, 64, 8, 3), (4, 128, 8, 2), (4, 128, 8, 3)]
    return [dict(group_rows=r, group_block_n=bn, group_warps=w, group_stages=s) for r, bn, w, s in shapes]


def run(device: str, smoke: bool = False) -> dict[str, Any]:
    from antumbra.kernels.indexer_topk import indexer_scores_reference, topk_rows_reference
    from antumbra.kernels.indexer_topk import triton as K

    rows, n, first = (12, 40, 100) if smoke else (8192, 16384, 57344)
    g = torch.Generator().manual_seed(7)
    x = _inputs(rows, n, first, device, g)
    args = (x["q"], x["weights"], x["keys"], x["cand"])
    spans = ((0, rows),)
    products = 2 * HEADS * HEAD_DIM * int(x["counts"].sum())
    base = K.TopkConfig(score_block_n=16, filter_block_n=64, keys_block_n=64) if smoke else K.DEFAULT_CONFIG
    k = min(TOPK, n)
    want = K.indexer_topk(*args, k, x["counts"], config=base)
    sample = torch.linspace(0, rows - 1, 4 if smoke else 24).long().unique().to(device)
    ref_scores = indexer_scores_reference(x["q"][sample], x["weights"][sample], x["keys"], x["cand"][sample],
                                          x["counts"][sample])
    ref = topk_rows_reference(ref_scores, x["cand"][sample], k)
    workspace = K.TopkWorkspace.allocate(rows, n, k, device, base.coarse_bits)
    reps = 1 if smoke else 5

    def scores_us(config: K.TopkConfig, counts: torch.Tensor | None, with_spans: bool) -> float:
        call = functools.partial(K.launch_scores, *args, counts, workspace, HEAD_DIM**-0.5, config,
                                 spans=spans if with_spans else None)

        def clean() -> None:  # the filter, which zeroes the histogram, does not run here
            call()
            workspace.hist.zero_()

        return _time_us([clean], device, reps=reps, graph=False)

    table, checks = [], []

    def record(label: str, config: K.TopkConfig, counts: torch.Tensor | None, with_spans: bool) -> None:
        got = K.indexer_topk(*args, k, counts, config=config, spans=spans if with_spans else None)
        same_rows = float((got.sort(1).values == want.sort(1).values).all(1).float().mean())
        check = check_selection(got[sample], ref, ref_scores, x["cand"][sample], tol=1e-3)
        checks.append({"variant": label, "config": dataclasses.asdict(config),
                       "rows_same_as_default": same_rows, **check})
        us = scores_us(config, counts, with_spans)
        table.append({"variant": label, "config": dataclasses.asdict(config), "scores_us": us,
                      "tflops": products / (us * 1e6), "ok": check["ok"], "rows_same_as_default": same_rows})

    record("per_row", base, x["counts"], False)
    record("per_row_no_counts", base, None, False)
    for tiles in _grouped_sweep(smoke):
        record("grouped", dataclasses.replace(base, **tiles), x["counts"], True)
    ok = [row for row in table if row["ok"]]
    grouped_ok = [row for row in ok if row["variant"] == "grouped"]
    best = min(grouped_ok, key=lambda row: row["scores_us"], default=None)
    result: dict[str, Any] = {
        "rows": rows, "n": n, "first_position": first, "k": k, "causal_tflop": products / 1e12,
        "table": table, "checks": checks, "all_checks_ok": all(c["ok"] for c in checks),
        "indexer_prefill_counts_vs_no_counts": table[1]["scores_us"] / table[0]["scores_us"],
    }
    if best is not None:
        best_config = K.TopkConfig(**best["config"])
        whole = {label: _time_us([functools.partial(K.indexer_topk, *args, k, x["counts"], config=config,
                                                    spans=spans if grouped else None)],
                                 device, reps=reps, graph=False)
                 for label, config, grouped in (("per_row", base, False), ("grouped", best_config, True))}
        result.update(best_grouped=best["config"], whole_call_us=whole,
                      indexer_prefill_grouped_vs_per_row=table[0]["scores_us"] / best["scores_us"])
    return result


def _report(result: dict[str, Any]) -> list[str]:
    lines = []
    for row in result["table"]:
        c = row["config"]
        tile = f"{c['group_rows']}/{c['group_block_n']}/{c['group_warps']}/{c['group_stages']}"
        lines.append(f"{row['variant']:18s} {row['scores_us']:10.1f} us  {row['tflops']:6.1f} TFLOP/s  "
                     f"ok={row['ok']} same={row['rows_same_as_default']:.3f}  {tile}")
    return lines


def main() -> None:
    headline = ("all_checks_ok", "indexer_prefill_grouped_vs_per_row", "indexer_prefill_counts_vs_no_counts")
    standalone_main("kernel-indexer-prefill", run, _report, headline)


if __name__ == "__main__":
    main()
