"""Where the release step's time goes against exact's, and where a 16K prefill's goes (issue 15).

For each numerics mode, one slice engine at 4K (the packed formats, CUDA graphs): the B1 step
timed on its graphs, then the fixed-shape step run eagerly under the profiler (kernel time and
launches per step, per kernel name). The per-name difference release - exact says which launches
the release step adds and which of its kernels are slower. Then, on the exact engine, a 16K
prefill under the profiler at each `--chunks` token budget (device busy time against wall time).

    python -m benchmarks.step_profile_gpu [--smoke] [--ctx 4096] [--prefill-ctx 16384] [--chunks 2048,8192]
        [--no-decode]

Results: `results/<date>-h200-step-profile.json` (`cpu-...-smoke` on the CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

from . import engine_round2 as r2
from .common import environment, write_result
from .engine_gpu import (
    SMOKE_SLICE,
    SliceSpec,
    _guarded,
    _prompts,
    _release,
    build_engine,
    build_hf,
    engine_decode_ms,
    engine_prefill_s,
    prefill_profile,
    profile_fast_step,
)


def _by_name(profile: dict[str, Any]) -> dict[str, tuple[float, float]]:
    return {row["name"]: (row["us_per_step"], row["calls_per_step"]) for row in profile.get("top", [])}


def step_difference(exact: dict[str, Any], release: dict[str, Any]) -> list[dict[str, Any]]:
    """Per kernel name: release's and exact's microseconds and calls per step, largest gap first."""
    a, b = _by_name(exact), _by_name(release)
    rows = []
    for name in set(a) | set(b):
        (ea, ec), (ra, rc) = a.get(name, (0.0, 0.0)), b.get(name, (0.0, 0.0))
        rows.append({"name": name, "release_us": ra, "exact_us": ea, "gap_us": ra - ea,
                     "release_calls": rc, "exact_calls": ec})
    rows.sort(key=lambda r: abs(r["gap_us"]), reverse=True)
    return rows


def decode_profiles(hf: Any, spec: Any, device: str, ctx: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    prompt = _prompts(spec.vocab_size, 1, ctx, seed=ctx + 1, shared=0)[0]
    for numerics in ("exact", "release"):
        def one(numerics: str = numerics) -> dict[str, Any]:
            engine = build_engine(hf, device, "bfloat16" if device == "cuda" else "float32",
                                  max_model_len=ctx + 256, max_num_seqs=2, num_virtual_tokens=2 * ctx + 8192,
                                  numerics=numerics)
            row = {"plan_decode": engine.plan.decode.value,
                   "decode_B1": engine_decode_ms(engine, [prompt], device, steps=12),
                   "profile": profile_fast_step(engine, prompt, device)}
            _release(engine)
            return row
        out[numerics] = _guarded(one)
        print(numerics, out[numerics].get("decode_B1", {}).get("step_ms"),
              out[numerics].get("profile", {}).get("kernel_us_per_step"),
              out[numerics].get("profile", {}).get("launches_per_step"), flush=True)
    if all("profile" in out[m] for m in ("exact", "release")):
        out["difference"] = step_difference(out["exact"]["profile"], out["release"]["profile"])
        for row in out["difference"][:25]:
            print(f"{row['gap_us']:8.1f} us  {row['release_calls']:5.1f} vs {row['exact_calls']:5.1f} calls  "
                  f"{row['name']}", flush=True)
    return out


def prefill_profiles(hf: Any, spec: Any, device: str, ctx: int, chunks: list[int]) -> dict[str, Any]:
    engine = build_engine(hf, device, "bfloat16" if device == "cuda" else "float32", max_model_len=ctx + 256,
                          max_num_seqs=2, num_virtual_tokens=2 * ctx + 8192)
    sched = engine.core.scheduler
    base = sched.cfg
    prompt = _prompts(spec.vocab_size, 1, ctx, seed=ctx, shared=0)[0]
    out: dict[str, Any] = {"flops": r2.prefill_flops(hf, spec, ctx)}
    for chunk in chunks:
        sched.cfg = dataclasses.replace(base, max_num_batched_tokens=chunk)
        engine_prefill_s(engine, prompt[:chunk], device)  # compiles this chunk's variants
        row = _guarded(lambda: prefill_profile(engine, prompt, device))
        row["s"] = _guarded(lambda: {"s": engine_prefill_s(engine, prompt, device)}).get("s")
        out[f"chunk{chunk}"] = row
        print("prefill", ctx, "chunk", chunk, row.get("s"), "busy", row.get("device_busy_s"), flush=True)
    sched.cfg = base
    _release(engine)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="the small slice (CPU check of the script)")
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--prefill-ctx", type=int, default=16384)
    parser.add_argument("--chunks", default="2048,8192")
    parser.add_argument("--no-decode", action="store_true", help="only the prefill profiles")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = SMOKE_SLICE if args.smoke else SliceSpec()
    hf = build_hf(spec, device, torch.bfloat16 if device == "cuda" else torch.float32)
    name = ("h200" if device == "cuda" else "cpu") + "-step-profile" + ("-smoke" if args.smoke else "")
    result: dict[str, Any] = {**environment(), "ctx": args.ctx}
    if not args.no_decode:
        result["decode"] = decode_profiles(hf, spec, device, args.ctx)
        write_result(name, result)
    if args.prefill_ctx:
        chunks = [int(c) for c in args.chunks.split(",") if c]
        result["prefill"] = _guarded(lambda: prefill_profiles(hf, spec, device, args.prefill_ctx, chunks))
    write_result(name, result)


if __name__ == "__main__":
    main()
