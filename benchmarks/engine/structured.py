"""Structured output's cost per decode step: every row constrained by a JSON schema against none.

On the V4-Flash 4-layer slice (`lib/slices.SliceSpec`, random weights, the release's packed
formats, CUDA-graph decode) with V4's tokenizer.json: B requests decode together, each either
free (`ignore_eos`) or constrained by a JSON schema (an array of at least 2000 small objects:
bounded strings, integers, enums, nested arrays, so no row completes while it is timed and rows
pass through every kind of JSON state). Timed: ms per engine step once all rows decode, the
engine's own plan for each (the free rows overlap their steps; constrained rows mask on a worker
thread while the forward runs and sample after it). Also recorded: the mask worker's fill time per
step over the timed steps (llguidance filling the batch's bitmasks at the states the rows pass
through), its time repeated at one state, and the mask kernel's time.

Ratios: `constrained_vs_plain_step_B1`, `_B8`, `_B32` (aim <= 1.10x at B8).

    python -m benchmarks run engine --only structured [--smoke]
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from typing import Any

import torch

from ..lib.context import Context
from ..lib.slices import SMOKE_SLICE, SliceSpec, build_engine, build_hf, free_engine, prompts
from ..lib.timing import time_us, timed_steps_ms

DEVICE = "cuda"

BATCHES = (1, 8, 32)
ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 2000}


def _decode_ms(engine: Any, prompts: list[list[int]], grammar: str | None, steps: int, device: str) -> dict:
    """ms per step with every prompt decoding under `grammar` (None: free)."""
    from antumbra import SamplingParams

    budget = engine.max_model_len - len(prompts[0]) - 1
    ids = [engine.core.add_request(p, SamplingParams(max_tokens=budget, temperature=1.0, seed=i,
                                                     ignore_eos=True, grammar=grammar))
           for i, p in enumerate(prompts)]
    while any(len(engine.core.requests[r].output_token_ids) < 1 for r in ids):
        engine.core.step()
    for _ in range(5):
        engine.core.step()
    masks = engine.core.masks
    fast = engine.runner.fast
    fast_before = fast.num_steps if fast is not None else 0
    fills = (masks.num_fills, masks.fill_seconds) if masks is not None else (0, 0.0)
    step_ms = timed_steps_ms(engine, steps, device)
    running = sum(1 for r in ids if r in engine.core.requests)
    fill_ms = None
    if grammar is not None and masks is not None and masks.num_fills > fills[0]:
        fill_ms = (masks.fill_seconds - fills[1]) * 1e3 / (masks.num_fills - fills[0])
    mask_ms = _mask_only_ms(engine, ids, steps) if grammar is not None and masks is not None else None
    for r in ids:
        engine.core.abort(r)
    engine.core.drain()
    engine.core.stash = []
    return {"step_ms": step_ms, "all_running": running == len(prompts), "mask_worker_ms": mask_ms,
            "mask_fill_in_step_ms": fill_ms,
            "fast_path_steps": (fast.num_steps - fast_before) if fast is not None else 0}


def _mask_only_ms(engine: Any, ids: list[str], steps: int) -> float:
    """The mask worker's time for the batch alone (no forward running beside it), per step, at one
    fixed state of the grammars (`mask_fill_in_step_ms` is the fill over the timed steps' states)."""
    masks = engine.core.masks
    matchers = [engine.core.requests[r].grammar for r in ids]
    start = time.perf_counter()
    for _ in range(steps):
        masks.start(matchers).result(torch.device("cpu"))
    return (time.perf_counter() - start) * 1e3 / steps



def _mask_kernel_us(batch: int, vocab: int, device: str) -> float:
    from antumbra.kernels.token_mask import apply_token_mask, words_for

    logits = torch.randn(batch, vocab, device=device)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, words_for(vocab)), dtype=torch.int32, device=device)
    return time_us([lambda: apply_token_mask(logits, bitmask, out=logits)], device)


def run(ctx: Context) -> dict[str, Any]:
    from antumbra.replicas.model.tokenizer import Tokenizer, save_tokenizer
    from antumbra.replicas.structured import json_schema_grammar

    device, smoke = ctx.device, ctx.smoke
    context_len, steps, batches = (64, 3, (1, 2)) if smoke else (ctx.option("ctx", 1024), 50, BATCHES)
    spec = dataclasses.replace(SMOKE_SLICE, vocab_size=SliceSpec().vocab_size) if smoke else SliceSpec()
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    hf = build_hf(spec, device, getattr(torch, dtype))
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = Tokenizer.from_dir(save_tokenizer(tmp))
    engine = build_engine(hf, device, dtype, max_model_len=context_len + 1024, max_num_seqs=max(batches),
                          num_virtual_tokens=(context_len + 1024) * (max(batches) + 2), tokenizer=tokenizer)
    del hf
    grammar = json_schema_grammar(SCHEMA)
    result: dict[str, Any] = {"slice": dataclasses.asdict(spec), "ctx": context_len, "timed_steps": steps,
                              "schema": SCHEMA, "by_batch": {}, "ratios": {}}
    for batch in batches:
        rows = prompts(spec.vocab_size, batch, context_len, seed=batch)
        plain = _decode_ms(engine, rows, None, steps, device)
        constrained = _decode_ms(engine, rows, grammar, steps, device)
        entry = {"plain": plain, "constrained": constrained,
                 "constrained_vs_plain": constrained["step_ms"] / plain["step_ms"]}
        if device.startswith("cuda"):
            entry["mask_kernel_us"] = _mask_kernel_us(batch, spec.vocab_size, device)
        result["by_batch"][f"B{batch}"] = entry
    result["checks_ok"] = all(e["plain"]["all_running"] and e["constrained"]["all_running"]
                              for e in result["by_batch"].values())
    if result["checks_ok"]:
        result["ratios"] = {f"constrained_vs_plain_step_B{b[1:]}": e["constrained_vs_plain"]
                            for b, e in result["by_batch"].items()}
    engine.shutdown()
    free_engine(engine)
    return result
