"""One side of the decode A/B (`decode_ab.py`): time decode steps through the public engine API only.

Run as a script with PYTHONPATH naming the tree under test, so the same timing code measures any
build of the engine (this tree's, or an earlier commit's unpacked beside it):

    PYTHONPATH=TREE python benchmarks/engine/decode_ab_worker.py --ckpt DIR --batches 1,32 --ctx 4096

A decode step is the difference of two `generate` calls of 1 and 1 + N tokens over cached prompts,
divided by N (what a user of the API sees, start-up and prefill excluded). Prints one JSON line.

With `--serve` it loads the engine, prints one JSON line (`start_s`), then answers each line on stdin
(a batch size) with one JSON line: that batch's step, timed once (`--reps` pairs), so a controller can
alternate two builds' measurements in one run (`decode_ab.py`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def _prompts(batch: int, ctx: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Ids well inside any V4 vocabulary and clear of the special tokens.
    return [torch.randint(1000, 60000, (ctx,), generator=g).tolist() for _ in range(batch)]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed_generate(engine, prompts, params) -> float:  # type: ignore[no-untyped-def]
    _sync()
    start = time.perf_counter()
    engine.generate(prompts, params)
    _sync()
    return time.perf_counter() - start


def decode_step_ms(engine, batch: int, ctx: int, new_tokens: int, reps: int) -> dict:  # type: ignore[no-untyped-def]
    from antumbra import SamplingParams

    prompts = _prompts(batch, ctx, seed=batch)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    many = SamplingParams(max_tokens=1 + new_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, one)  # computes and caches the prompts
    engine.generate(prompts, many)  # warms every graph size the batch passes through
    steps = []
    for _ in range(reps):
        short = _timed_generate(engine, prompts, one)
        long = _timed_generate(engine, prompts, many)
        steps.append((long - short) * 1e3 / new_tokens)
    return {"step_ms": statistics.median(steps), "step_ms_all": steps}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--serve", action="store_true")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    import antumbra
    from antumbra import Engine
    from antumbra.config import CacheConfig, FastPathConfig, SchedulerConfig

    batches = [int(b) for b in args.batches.split(",")]
    max_len = args.ctx + args.new_tokens + 256
    started = time.perf_counter()
    engine = Engine.from_pretrained(
        args.ckpt, device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32",
        scheduler=SchedulerConfig(max_num_seqs=max(batches), max_model_len=max_len),
        cache=CacheConfig(num_virtual_tokens=(max(batches) + 2) * max_len),
        # The release's formats kept packed on the device, as the slice's published decode figures run.
        fast=FastPathConfig(expert_format="mxfp4", linear_format="fp8"),
    )
    start_s = time.perf_counter() - started
    out = {"package": antumbra.__file__, "start_s": start_s, "ctx": args.ctx, "steps": {}}
    if args.serve:
        print(json.dumps(out), flush=True)
        for line in sys.stdin:
            batch = int(line)
            print(json.dumps(decode_step_ms(engine, batch, args.ctx, args.new_tokens, args.reps)), flush=True)
        return
    for batch in batches:
        out["steps"][str(batch)] = decode_step_ms(engine, batch, args.ctx, args.new_tokens, args.reps)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
