"""What batch-invariant mode costs on the GPU: decode throughput of the V4-Flash slice with
`deterministic=True` against the default plan (MXFP4 experts, FP8 linears, CUDA graphs).

Batch-invariant mode keeps the kernels, the packed weights and the graphs, but runs every step's
one-token chunks (decodes and prompt tokens alike) through the fixed-shape step at one padded size,
the largest graph size (plan.py): so at B8 of a B32-sized engine a step costs a B32 replay. Each
mode decodes B independent prompts of `--ctx` tokens; decode tokens/s counts the tokens made by the
steps after every prompt has its first token (the prefill is not timed). A check runs at every
batch size above one: the deterministic engine gives the same greedy tokens for the first prompt
alone and inside the batch of B, with bitwise the same logprobs, or no ratio is written.

    python -m benchmarks run engine --only deterministic_slice [--smoke]

Headline ratios: `batch_invariant_vs_default_B8` and `_B32` (decode tokens/s, deterministic over
default); the checks are under `invariance_check`.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..lib.context import Context
from ..lib.slices import SMOKE_SLICE, SliceSpec, build_engine, build_hf, free_engine, prompts
from ..lib.timing import sync

DEVICE = "cuda"


def decode_tokens_per_s(
    engine: Any, batch: list[list[int]], new_tokens: int, device: str
) -> dict[str, float]:
    """Decode tokens/s with every prompt decoding: the prompts are computed and have their first
    token before the clock starts, then steps run until `new_tokens` more tokens each (counted, so
    a mode whose step yields one token of one request is timed the same way as a batched one)."""
    from antumbra import SamplingParams

    engine.clear_cache()
    params = SamplingParams(max_tokens=new_tokens + 2, temperature=0.0, ignore_eos=True)
    core = engine.core
    ids = [core.add_request(p, params) for p in batch]

    counts = dict.fromkeys(ids, 0)  # each request's tokens, kept once it finishes and leaves the core

    def generated() -> int:
        for r in ids:
            if r in core.requests:
                counts[r] = len(core.requests[r].output_token_ids)
        return sum(counts.values())

    while any(r in core.requests and not core.requests[r].output_token_ids for r in ids):
        core.step()
    sync(device)
    before, start = generated(), time.perf_counter()
    target = before + len(batch) * new_tokens
    steps = 0
    while generated() < target and any(r in core.requests for r in ids):
        core.step()
        steps += 1
    sync(device)
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
            "ms_per_token_per_request": seconds * 1e3 * len(batch) / tokens}


def invariance_check(engine: Any, batch: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """The first prompt alone and inside the batch: identical tokens and bitwise-equal logprobs."""
    from antumbra import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, logprobs=2, ignore_eos=True)
    engine.clear_cache()
    alone = engine.generate([batch[0]], params)[0]
    engine.clear_cache()
    together = engine.generate(batch, params)[0]
    same_tokens = alone.token_ids == together.token_ids
    same_logprobs = alone.logprobs == together.logprobs
    return {"batch": len(batch), "same_tokens": same_tokens, "bitwise_same_logprobs": same_logprobs,
            "passed": bool(same_tokens and same_logprobs)}


def run(ctx: Context) -> dict[str, Any]:
    """Options: ctx (prompt tokens), new_tokens, batches."""
    device = ctx.device
    length = ctx.option("ctx", 64 if ctx.smoke else 512)
    new_tokens = ctx.option("new_tokens", 2 if ctx.smoke else 32)
    batches = ctx.option("batches", [1, 2] if ctx.smoke else [1, 8, 32])
    spec = SMOKE_SLICE if ctx.smoke else SliceSpec()
    dtype = torch.bfloat16 if ctx.on_gpu else torch.float32
    result: dict[str, Any] = {"ctx": length, "new_tokens": new_tokens, "batches": batches,
                              "slice": "smoke" if ctx.smoke else "v4-flash-4-layer"}
    hf = build_hf(spec, device, dtype)
    max_len = length + new_tokens + 8
    for mode in ("default", "deterministic"):
        engine = build_engine(hf, device, str(dtype).removeprefix("torch."), max_len, max(batches),
                              num_virtual_tokens=(max_len + 256) * max(batches) * 2,
                              deterministic=mode == "deterministic")
        plan = engine.plan
        graphs = engine.core.runner.fast
        result[mode] = {"plan": {"decode": plan.decode.value, "experts": plan.expert_format.value,
                                 "linears": plan.linear_format.value, "step_kernels": plan.step_kernels.value,
                                 "graph_sizes": list(graphs.batch_sizes) if graphs is not None else []}}
        for batch in batches:
            batch_prompts = prompts(spec.vocab_size, batch, length, seed=0)
            decode_tokens_per_s(engine, batch_prompts, 2, device)  # compiles / captures what the mode needs
            result[mode][f"B{batch}"] = decode_tokens_per_s(engine, batch_prompts, new_tokens, device)
        if mode == "deterministic":
            result["invariance_check"] = [
                invariance_check(engine, prompts(spec.vocab_size, batch, length, seed=0), min(new_tokens, 16))
                for batch in batches if batch > 1
            ]
        free_engine(engine)
    if all(check["passed"] for check in result["invariance_check"]):
        result["ratios"] = {
            f"batch_invariant_vs_default_B{b}":
                result["deterministic"][f"B{b}"]["decode_tokens_per_s"]
                / result["default"][f"B{b}"]["decode_tokens_per_s"]
            for b in batches
        }
    return result
