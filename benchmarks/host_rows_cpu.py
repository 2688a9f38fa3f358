"""The host's work per step while prompts arrive as fixed-shape rows, on the CPU, the forward made
trivial (`host_step_cpu._stub_forward`).

    python -m benchmarks.host_rows_cpu [--decodes 32] [--rows 32,96] [--steps 200] [--reps 3] [--profile]

The tiny checkpoint runs with the fixed-shape step, `prefill_rows` R and a step budget of
decodes + R tokens. `--decodes` requests decode while long prompts wait, so every step carries the
decodes and R prompt tokens (a step of prompt rows, `runner.py`); a finished prompt is replaced by
a new one. Measured, each the median over `--reps` runs of `--steps` steps driven by hand:
`rows_step_us` (such a step: scheduling, the rows' inputs, sampling the decode rows outside the
graph, applying), `rows_step_cpu_us` (its thread's CPU time), and `decode_step_us`, the same
requests' pure decode step (overlapped) after the prompts are gone, for scale. The split of a rows
step by part: `parts_us` (`rows_forward`: the stubbed step and the gather of the sampling rows'
logits; `sample`: the sampler, on the CPU its torch reference over the whole vocabulary, which the
GPU runs as a kernel), and `host_us_besides_vocab`, the step less those two: what the host adds
per step on any device. Writes benchmarks/results/host-rows.json.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .host_step_cpu import _stub_forward
from .lib.records import RESULTS_DIR, provenance
from .lib.timing import Parts

PROMPT_TOKENS = 2048
DECODE_PROMPT = list(range(1000, 1100))


def _engine(path: Path, decodes: int, rows: int, steps: int) -> Any:
    from antumbra import Engine
    from antumbra.config import CacheConfig, FastPathConfig, SchedulerConfig

    max_len = PROMPT_TOKENS + steps + 256
    return Engine.from_pretrained(
        path, device="cpu", dtype="float32", warmup="off",
        scheduler=SchedulerConfig(max_model_len=max_len, max_num_seqs=decodes + 2,
                                  max_num_batched_tokens=decodes + rows),
        cache=CacheConfig(num_virtual_tokens=(decodes + 4) * max_len),
        fast=FastPathConfig(decode="on", cuda_graph_batch_sizes=(1, 2, 4, 8, 16, 32, 64), prefill_rows=rows),
    )


def _prompt(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2000, 20000, (PROMPT_TOKENS,), generator=g).tolist()


def _run(engine: Any, decodes: int, steps: int, parts: Parts, prof: cProfile.Profile | None,
         seed: int) -> dict[str, Any]:
    """One run (`parts` wraps the engine's parts; its rows steps' share is returned). Prompts are new
    to the cache each run (seeds from `seed`), so no chunk replays a cached prefix's window."""
    from antumbra import SamplingParams

    core = engine.core
    params = SamplingParams(max_tokens=10 * steps, temperature=0.0, ignore_eos=True)
    rids = [core.add_request(DECODE_PROMPT, params) for _ in range(decodes)]
    while not all(core.requests[r].output_token_ids for r in rids):
        core.step()
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    waiting = [core.add_request(_prompt(seed + s), one) for s in range(2)]
    seed += 2
    row_steps = engine.runner.num_prompt_row_steps
    before = dict(parts.seconds)
    if prof is not None:
        prof.enable()
    start, start_cpu = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        core.step()
        for i, rid in enumerate(waiting):  # keep two prompts waiting
            if rid not in core.requests:
                waiting[i] = core.add_request(_prompt(seed), one)
                seed += 1
    wall, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
    per_part = {k: (v - before.get(k, 0.0)) * 1e6 / steps for k, v in parts.seconds.items()}
    if prof is not None:
        prof.disable()
    ran_rows = engine.runner.num_prompt_row_steps - row_steps
    for rid in waiting:
        core.abort(rid)
    core.drain()
    for _ in range(5):  # into the overlapped pure decode state
        core.step()
    decode_start = time.perf_counter()
    for _ in range(steps):
        core.step()
    decode_us = (time.perf_counter() - decode_start) * 1e6 / steps
    for rid in rids:
        core.abort(rid)
    core.drain()
    core.stash = []
    vocab_us = per_part.get("rows_forward", 0.0) + per_part.get("sample", 0.0)
    return {"rows_step_us": wall * 1e6 / steps, "rows_step_cpu_us": cpu * 1e6 / steps,
            "decode_step_us": decode_us, "rows_steps": ran_rows,
            "host_us_besides_vocab": wall * 1e6 / steps - vocab_us, "parts_us": per_part}


def _instrument(engine: Any, parts: Parts) -> None:
    core, runner = engine.core, engine.runner
    fast = runner.fast
    core.scheduler.schedule = parts.wrap("schedule", core.scheduler.schedule)
    fast._prepare = parts.wrap("write_inputs", fast._prepare)
    runner._prompt_rows = parts.wrap("rows_forward", runner._prompt_rows)
    runner._forward = parts.wrap("general_forward", runner._forward)
    runner.sampler.sample_tokens = parts.wrap("sample", runner.sampler.sample_tokens)
    core.scheduler.update_from_output = parts.wrap("update_from_output", core.scheduler.update_from_output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decodes", type=int, default=32)
    parser.add_argument("--rows", default="32,96")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    from antumbra.replicas.model.tiny import make_tiny_checkpoint

    torch.set_num_threads(1)
    by_rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "tiny")
        for rows in (int(r) for r in args.rows.split(",")):
            engine = _engine(path, args.decodes, rows, args.steps)
            _stub_forward(engine)
            parts = Parts()
            _instrument(engine, parts)
            prof = cProfile.Profile() if args.profile else None
            runs = [_run(engine, args.decodes, args.steps, parts, prof if r == 0 else None, seed=10_000 * r)
                    for r in range(args.reps)]
            engine.shutdown()
            names = sorted({k for r in runs for k in r["parts_us"]})
            by_rows[f"R{rows}"] = {
                **{k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "parts_us"},
                "parts_us": {k: statistics.median(r["parts_us"].get(k, 0.0) for r in runs) for k in names},
            }
            print(f"R{rows}", json.dumps(by_rows[f"R{rows}"]), flush=True)
            if prof is not None:
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    result = {**provenance("cpu"), "decodes": args.decodes, "steps": args.steps, "reps": args.reps,
              "prompt_tokens": PROMPT_TOKENS, "by_rows": by_rows}
    out = RESULTS_DIR / "host-rows.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
