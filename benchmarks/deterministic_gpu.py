"""What batch-invariant mode costs on the GPU: decode throughput of the V4-Flash slice with
`deterministic=True` against the default plan (MXFP4 experts, FP8 linears, CUDA graphs).

Batch-invariant mode runs every token as a one-token PyTorch forward of its own on dense weights
(plan.py), so a batch of B decoding requests costs B forwards a step instead of one graph replay.
Each mode decodes B independent prompts of `--ctx` tokens; decode tokens/s is measured as
B * new_tokens over (time of `1 + new_tokens` tokens - time of 1 token), nothing cached, so the
prefill cancels out. A check run first: the deterministic engine gives the same greedy tokens for
a prompt alone and inside a batch of B (bitwise the same logprobs), or no ratio is written.

    python -m benchmarks.deterministic_gpu            # on the H200
    python -m benchmarks.deterministic_gpu --smoke    # small widths, CPU (kernels interpreted)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from typing import Any

import torch

from .common import environment, write_result
from .engine_gpu import SMOKE_SLICE, SliceSpec, build_engine, build_hf


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _prompts(vocab: int, batch: int, ctx: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, vocab, (ctx,), generator=g).tolist() for _ in range(batch)]


def _timed(engine: Any, prompts: list[list[int]], max_tokens: int, device: str) -> float:
    from antumbra import SamplingParams

    engine.clear_cache()
    _sync(device)
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    _sync(device)
    return time.perf_counter() - start


def decode_tokens_per_s(
    engine: Any, prompts: list[list[int]], new_tokens: int, device: str
) -> dict[str, float]:
    _timed(engine, prompts, 2, device)  # warms whatever the first run compiles or captures
    prefill_s = _timed(engine, prompts, 1, device)
    whole_s = _timed(engine, prompts, 1 + new_tokens, device)
    decode_s = max(whole_s - prefill_s, 1e-9)
    return {"prefill_and_first_s": prefill_s, "whole_s": whole_s,
            "decode_tokens_per_s": len(prompts) * new_tokens / decode_s,
            "decode_step_ms": decode_s * 1e3 / new_tokens}


def invariance_check(engine: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """The first prompt alone and inside the batch: identical tokens and bitwise-equal logprobs."""
    from antumbra import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    engine.clear_cache()
    alone = engine.generate([prompts[0]], params)[0]
    engine.clear_cache()
    together = engine.generate(prompts, params)[0]
    same_tokens = alone.token_ids == together.token_ids
    same_logprobs = alone.logprobs == together.logprobs
    return {"same_tokens": same_tokens, "bitwise_same_logprobs": same_logprobs,
            "passed": bool(same_tokens and same_logprobs)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = SMOKE_SLICE if args.smoke else SliceSpec()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    result: dict[str, Any] = {**environment(), "ctx": args.ctx, "new_tokens": args.new_tokens,
                              "batches": args.batches, "slice": "smoke" if args.smoke else "v4-flash-4-layer"}
    hf = build_hf(spec, device, dtype)
    max_len = args.ctx + args.new_tokens + 8
    for mode in ("default", "deterministic"):
        engine = build_engine(hf, device, str(dtype).removeprefix("torch."), max_len, max(args.batches),
                              num_virtual_tokens=max_len * max(args.batches) * 2,
                              deterministic=mode == "deterministic")
        plan = engine.plan
        result[mode] = {"plan": {"decode": plan.decode.value, "experts": plan.expert_format.value}}
        for batch in args.batches:
            prompts = _prompts(spec.vocab_size, batch, args.ctx)
            result[mode][f"B{batch}"] = decode_tokens_per_s(engine, prompts, args.new_tokens, device)
        if mode == "deterministic":
            prompts = _prompts(spec.vocab_size, max(args.batches), args.ctx)
            result["invariance_check"] = invariance_check(engine, prompts, min(args.new_tokens, 16))
        del engine
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    if result["invariance_check"]["passed"]:
        result["ratios"] = {
            f"deterministic_vs_default_decode_throughput_B{b}":
                result["deterministic"][f"B{b}"]["decode_tokens_per_s"]
                / result["default"][f"B{b}"]["decode_tokens_per_s"]
            for b in args.batches
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    result = run(args)
    name = "h200-deterministic" if torch.cuda.is_available() else "cpu-deterministic-smoke"
    print(json.dumps({k: result.get(k) for k in ("invariance_check", "ratios")}, indent=1))
    print(write_result(name, result))


if __name__ == "__main__":
    main()
