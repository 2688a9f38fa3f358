"""The host's block-table writes of a fixed-shape step, on the CPU: one write per row against one per
chunk (`replicas/host_tables.py`).

    python -m benchmarks.host_tables_cpu [--steps 200] [--reps 5]   # -> benchmarks/results/host-tables.json

A step of 32 decoding requests (32 pages each) beside one prompt chunk of R rows (R = 32, 96) of a
request holding 256 pages that gains a page every step, as a prompt computed R tokens a step does:
every row of the chunk changes each step. `per_row_us`: each changed row written on its own (the
writer before shared chunk tables); `per_chunk_us`: `HostTables`. Medians over `--reps` runs of
`--steps` steps; the ratio `host_tables_per_row_vs_per_chunk_R{R}` is per_row / per_chunk.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace
from typing import Any

import torch

from antumbra.replicas.decode_rows import DecodeRow
from antumbra.replicas.host_tables import HostTables

from .lib.records import RESULTS_DIR, provenance

DECODES = 32
PROMPT_ROWS = (32, 96)
GRAPH_ROWS = 160
WIDTH = 1024


class PerRowTables:
    """The peer: each row compared and, when its pages changed, written on its own."""

    def __init__(self, tables: torch.Tensor) -> None:
        self.tables = tables
        self._row_pages: dict[int, list[int]] = {}

    def write(self, rows: list[DecodeRow], size: int) -> None:
        for b in range(size):
            self._write_row(b, rows[b].request.kv.vpages if b < len(rows) else [])

    def _write_row(self, row: int, pages: list[int]) -> None:
        if self._row_pages.get(row) == pages:
            return
        self._row_pages[row] = list(pages)
        table = self.tables[row]
        table.fill_(-1)
        if pages:
            table[: len(pages)] = torch.tensor(pages, dtype=torch.long)


def one_run(writer_cls: Any, prompt_rows: int, steps: int) -> float:
    """-> microseconds per step."""
    decodes = [SimpleNamespace(kv=SimpleNamespace(vpages=list(range(i * 40, i * 40 + 32))))
               for i in range(DECODES)]
    prompt = SimpleNamespace(kv=SimpleNamespace(vpages=list(range(5000, 5256))))
    writer = writer_cls(torch.zeros(GRAPH_ROWS, WIDTH, dtype=torch.long))
    total_s = 0.0
    for step in range(steps):
        prompt.kv.vpages.append(6000 + step)
        rows = [DecodeRow(d, 0, 0) for d in decodes] + [DecodeRow(prompt, p, 0) for p in range(prompt_rows)]
        start = time.perf_counter()
        writer.write(rows, GRAPH_ROWS)
        total_s += time.perf_counter() - start
    return total_s / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    median: dict[str, dict[str, float]] = {}
    for rows in PROMPT_ROWS:
        runs: dict[str, list[float]] = {"per_row_us": [], "per_chunk_us": []}
        for _ in range(args.reps):  # alternating, so drift of the machine reaches both alike
            runs["per_row_us"].append(one_run(PerRowTables, rows, args.steps))
            runs["per_chunk_us"].append(one_run(HostTables, rows, args.steps))
        median[f"R{rows}"] = {k: statistics.median(v) for k, v in runs.items()}
    result: dict[str, Any] = {
        **provenance("cpu"), "decodes": DECODES, "prompt_rows": list(PROMPT_ROWS), "steps": args.steps,
        "reps": args.reps, "median": median,
        "ratios": {f"host_tables_per_row_vs_per_chunk_{r}": m["per_row_us"] / m["per_chunk_us"]
                   for r, m in median.items()},
    }
    out = RESULTS_DIR / "host-tables.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(median, indent=2))
    print(json.dumps(result["ratios"], indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
