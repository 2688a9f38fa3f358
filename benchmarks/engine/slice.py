"""The engine on one GPU against transformers' eager DeepSeek-V4, on a 4-layer slice at V4-Flash widths.

The slice (random weights, routed experts MXFP4-representable and linears FP8-representable, so both
sides compute the same function; ours keep them packed) at batch 1 / 8 / 32 / 64 and context 4K and
64K: prefill time against the FLOP floor, decode step time (overlapped scheduling on and off, and the
captured graph alone) against transformers on the same weights in the same process and against the
step's byte floor; then release numerics and HiSparse against the exact fast path. Floors come from
the copy bandwidth and matmul rate measured in the same run. Checks beside the figures (last-position
logits against transformers, every timed batch running, each variant's agreement with the path it
replaces) gate the ratios: a ratio whose check failed goes to `ratios_unchecked`.

Options (`--set name=value`): contexts, batches, long_batches (batches at the later contexts), steps,
prefill_extra, prefill_chunk_alt (0: skip), release_ctx / hisparse_ctx (0: skip), hisparse_rows,
hisparse_gate_ctx, profile_prefill, graphs, shared_prefix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict
from typing import Any

import torch

from ..lib.context import Context
from ..lib.decode_floor import decode_floor_bytes
from ..lib.slices import (
    SMOKE_SLICE,
    SliceSpec,
    agreement,
    build_engine,
    build_hf,
    free_engine,
    greedy_with_logprobs,
    prompts,
)
from ..lib.timing import guarded
from .slice_steps import (
    engine_decode_ms,
    engine_prefill_s,
    hf_run,
    logits_agreement,
    prefill_profile,
    prefill_sync_probe,
    profile_fast_step,
)
from .slice_variants import (
    gate_ratios,
    hisparse_agreements,
    hisparse_float32,
    pool_bytes_per_token,
    prefill_flops,
    release_gate,
    variant_decode,
)

DEVICE = "cuda"


@dataclasses.dataclass(frozen=True)
class Settings:
    contexts: list[int]
    batches: list[int]
    long_batches: list[int]
    steps: int
    prefill_extra: list[int]
    prefill_chunk_alt: int
    release_ctx: int
    hisparse_ctx: int
    hisparse_rows: int
    hisparse_gate_ctx: int
    profile_prefill: bool
    graphs: bool
    shared_prefix: bool

    @classmethod
    def of(cls, ctx: Context) -> Settings:
        small = ctx.smoke
        return cls(
            contexts=ctx.option("contexts", [64, 128] if small else [4096, 65536]),
            batches=ctx.option("batches", [1] if small else [1, 8, 32, 64]),
            long_batches=ctx.option("long_batches", [1] if small else [1, 8]),
            steps=ctx.option("steps", 2 if small else 12),
            prefill_extra=ctx.option("prefill_extra", [96] if small else [16384]),
            prefill_chunk_alt=ctx.option("prefill_chunk_alt", 0 if small else 2048),
            release_ctx=ctx.option("release_ctx", 0 if small else 4096),
            hisparse_ctx=ctx.option("hisparse_ctx", 0 if small else 65536),
            hisparse_rows=ctx.option("hisparse_rows", 2048),
            hisparse_gate_ctx=ctx.option("hisparse_gate_ctx", 16384),
            profile_prefill=ctx.option("profile_prefill", False),
            graphs=ctx.option("graphs", True),
            shared_prefix=ctx.option("shared_prefix", False),
        )


def run(ctx: Context) -> dict[str, Any]:
    device = ctx.device
    dtype = "bfloat16" if ctx.on_gpu else "float32"
    spec = SMOKE_SLICE if ctx.smoke else SliceSpec()
    s = Settings.of(ctx)
    result: dict[str, Any] = {"slice": asdict(spec), "settings": asdict(s), "rates": ctx.rates.as_dict(),
                              "ratios": {}}
    hf = build_hf(spec, device, getattr(torch, dtype))
    result["params"] = sum(p.numel() for p in hf.parameters())
    result["transformers"] = _transformers(hf, spec, s, device, 4 if ctx.smoke else 8)
    result["engine"] = {}
    for length in s.contexts:
        _one_context(result, hf, spec, s, device, dtype, length)
    # `release` numerics and HiSparse: B1 decode steps against the exact fast path's.
    for label, length, kwargs in (("release", s.release_ctx, {"numerics": "release"}),
                                  # "on": the fixed-shape step with its device page-ins, or a PlanError.
                                  ("hisparse", s.hisparse_ctx, {"hisparse_rows": s.hisparse_rows,
                                                                "decode": "on"})):
        if length:
            result[label] = guarded(lambda lb=label, n=length, kw=kwargs: _variant(hf, spec, s, device, dtype,
                                                                                   lb, n, kw))
    gate_ratios(result, s.contexts[0])
    return result


def _transformers(hf: Any, spec: SliceSpec, s: Settings, device: str, new_tokens: int) -> dict[str, Any]:
    out = {}
    first = s.contexts[0]
    cases = ((1, first), (min(8, max(s.batches)), first)) + tuple((1, c) for c in s.contexts[1:])
    for batch, length in cases:
        batch_prompts = prompts(spec.vocab_size, batch, length, seed=batch * 7 + length)
        out[f"B{batch}_ctx{length}"] = guarded(lambda p=batch_prompts: hf_run(hf, p, device, new_tokens))
    return out


def _one_context(result: dict[str, Any], hf: Any, spec: SliceSpec, s: Settings, device: str, dtype: str,
                 length: int) -> None:
    """Prefill and decode figures of one context on an engine sized for it."""
    first, last = length == s.contexts[0], length == s.contexts[-1]
    batches = s.batches if first else s.long_batches
    engine = build_engine(hf, device, dtype, max_model_len=length + 256, max_num_seqs=max(batches),
                          num_virtual_tokens=max(batches) * (length + 512) + length + 4096, graphs=s.graphs)
    if first:
        result["exact_bytes"] = pool_bytes_per_token(engine)
        # Before anything else ran on this engine, and again after the profile (which aborts a
        # request with a step in flight): the two must agree.
        result["logits_vs_transformers_fresh"] = guarded(
            lambda: logits_agreement(engine, hf, spec.vocab_size, device))
        result["profile_B1"] = guarded(lambda: profile_fast_step(
            engine, prompts(spec.vocab_size, 1, length, seed=3)[0], device))
        result["logits_vs_transformers"] = guarded(
            lambda: logits_agreement(engine, hf, spec.vocab_size, device))
    budget = engine.core.scheduler.cfg.token_budget
    engine_prefill_s(engine, prompts(spec.vocab_size, 1, min(budget, length), seed=1)[0], device)  # compiles
    extra = {p for p in s.prefill_extra if p <= length} if last else set()
    for n in sorted({length} | extra):
        prompt = prompts(spec.vocab_size, 1, n, seed=n)[0]
        row = guarded(lambda p=prompt: {"s": engine_prefill_s(engine, p, device)})
        row["flops"] = prefill_flops(hf, spec, n)
        if s.profile_prefill and device.startswith("cuda"):
            row["profile"] = guarded(lambda p=prompt: prefill_profile(engine, p, device))
            row["sync_probe"] = guarded(lambda p=prompt: prefill_sync_probe(engine, p, device))
        result["engine"][f"prefill_B1_ctx{n}"] = row
    if last and s.prefill_chunk_alt:
        _prefill_at_another_budget(result, engine, hf, spec, s, device, min(length, 16384))
    for batch in batches:
        # Independent contexts: every row reads its own KV. Rows sharing all but 32 tokens of their
        # context read mostly the same pages (L2 hits), so that case is reported beside it, named so.
        cases = [("", 0)] + ([("_shared_prefix", length - 32)] if batch > 1 and s.shared_prefix else [])
        for suffix, shared in cases:
            batch_prompts = prompts(spec.vocab_size, batch, length, seed=length + batch, shared=shared)
            key = f"decode_B{batch}_ctx{length}{suffix}"
            result["engine"][key] = guarded(
                lambda p=batch_prompts: engine_decode_ms(engine, p, device, s.steps))
            result["engine"][key]["floor"] = decode_floor_bytes(engine, batch, length)
    free_engine(engine)


def _prefill_at_another_budget(result: dict[str, Any], engine: Any, hf: Any, spec: SliceSpec, s: Settings,
                               device: str, n: int) -> None:
    """The same prefill in steps of another token budget (fewer, larger GEMMs per chunk, or more)."""
    sched = engine.core.scheduler
    kept, sched.cfg = sched.cfg, dataclasses.replace(sched.cfg, max_num_batched_tokens=s.prefill_chunk_alt)
    prompt = prompts(spec.vocab_size, 1, n, seed=n)[0]
    guarded(lambda: {"s": engine_prefill_s(engine, prompt[: s.prefill_chunk_alt], device)})  # compiles
    row = guarded(lambda: {"s": engine_prefill_s(engine, prompt, device)})
    row["flops"], row["chunk_tokens"] = prefill_flops(hf, spec, n), s.prefill_chunk_alt
    result["engine"][f"prefill_chunk{s.prefill_chunk_alt}_ctx{n}"] = row
    sched.cfg = kept


def _variant(hf: Any, spec: SliceSpec, s: Settings, device: str, dtype: str, label: str, length: int,
             kwargs: dict[str, Any]) -> dict[str, Any]:
    def engine_with(**extra: Any) -> Any:
        return build_engine(hf, device, dtype, max_model_len=length + 256, max_num_seqs=2,
                            num_virtual_tokens=2 * length + 8192, graphs=s.graphs, **extra)

    engine = engine_with(**kwargs)
    prompt = prompts(spec.vocab_size, 1, length, seed=length + 1)[0]
    row = {"ctx": length, "prefill_s": engine_prefill_s(engine, prompt, device),
           "bytes": pool_bytes_per_token(engine), **kwargs}
    row.update(variant_decode(engine, prompt, max(5, s.steps // 2), device))
    ours = greedy_with_logprobs(engine, prompt)
    free_engine(engine)
    # The same decode on the path it replaces: the general step in the same mode (release
    # numerics; HiSparse with its host-side page-ins), so that both decode the same prefill.
    reference = engine_with(**{**kwargs, "decode": "off"})
    vs_general = agreement(ours, greedy_with_logprobs(reference, prompt))
    free_engine(reference)
    if label == "release":
        row["bf16_vs_general"] = vs_general
        row["agreement"] = guarded(lambda: release_gate(hf, device, length))
    else:
        gate = guarded(lambda: hisparse_float32(hf, device, s.hisparse_gate_ctx, s.hisparse_rows))
        row.update(hisparse_agreements(engine_with, prompt, ours, vs_general, gate))
    return row
