"""What batch-invariant mode costs on the GPU: decode throughput of the V4-Flash slice with
`deterministic=True` against the default plan (MXFP4 experts, FP8 linears, CUDA graphs).

Batch-invariant mode runs every token as a one-token PyTorch forward of its own on dense weights
(plan.py), so a batch of B decoding requests costs B forwards a step instead of one graph replay.
Each mode decodes B independent prompts of `--ctx` tokens; decode tokens/s counts the tokens
made by the steps after every prompt has its first token (the prefill is not timed). A check
runs too: the deterministic engine gives the same greedy tokens for a prompt alone and inside a
batch of B (bitwise the same logprobs), or no ratio is written.

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


def decode_tokens_per_s(
    engine: Any, prompts: list[list[int]], new_tokens: int, device: str
) -> dict[str, float]:
    """Decode tokens/s with every prompt decoding: the prompts are computed and have their first
    token before the clock starts, then steps run until `new_tokens` more tokens each (counted, so
    a mode whose step yields one token of one request is timed the same way as a batched one)."""
    from antumbra import SamplingParams

    engine.clear_cache()
    params = SamplingParams(max_tokens=new_tokens + 2, temperature=0.0, ignore_eos=True)
    core = engine.core
    ids = [core.add_request(p, params) for p in prompts]

    def generated() -> int:
        return sum(len(core.requests[r].output_token_ids) for r in ids if r in core.requests)

    while any(r in core.requests and not core.requests[r].output_token_ids for r in ids):
        core.step()
    _sync(device)
    before, start = generated(), time.perf_counter()
    target = before + len(prompts) * new_tokens
    steps = 0
    while generated() < target and all(r in core.requests for r in ids):
        core.step()
        steps += 1
    _sync(device)
    seconds = time.perf_counter() - start
    tokens = generated() - before
    if tokens <= 0:
        left = [r for r in ids if r in core.requests]
        raise RuntimeError(f"no decode tokens were made (requests left: {left})")
    for r in ids:
        if r in core.requests:
            core.abort(r)
    return {"decode_tokens": tokens, "decode_s": seconds, "steps": steps,
            "decode_tokens_per_s": tokens / seconds,
            "ms_per_token_per_request": seconds * 1e3 * len(prompts) / tokens}


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
                              num_virtual_tokens=(max_len + 256) * max(args.batches) * 2,
                              deterministic=mode == "deterministic")
        plan = engine.plan
        result[mode] = {"plan": {"decode": plan.decode.value, "experts": plan.expert_format.value}}
        for batch in args.batches:
            prompts = _prompts(spec.vocab_size, batch, args.ctx)
            decode_tokens_per_s(engine, prompts, 2, device)  # compiles / captures what the mode needs
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
