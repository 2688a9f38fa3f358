"""HiSparse against HiSparse off on the 4-layer V4-Flash slice, on its own: no transformers run (its
model only supplies the slice's weights) and no other context or batch.

Per context (16K and 64K) two engines of the same sizes, one with HiSparse (`hisparse_rows` hot rows
per request) and one without, each timed the same way in this run:
  * prefill: time to the first token of one prompt, nothing cached (the best of `prefill_repeats`,
    after a first chunk compiled the step's kernels);
  * at `decode_ctx`, the B1 decode step (the fixed-shape step; with HiSparse its page-ins), as the
    slice benchmark's variants time it.
Ratios (HiSparse over off; targets at most 1.3 for prefill, 1.1 for decode):
  hisparse_prefill_vs_off_ctx16384, hisparse_prefill_vs_off_ctx65536, hisparse_decode_vs_off_ctx65536.
Check gating them: the two engines' greedy tokens and logprobs after the same prompt agree
(`lib.slices.agreement`; HiSparse only moves rows, so `identical` says whether they agree exactly).

Options (`--set name=value`): contexts, decode_ctx (0: no decode), hisparse_rows, steps,
prefill_repeats, graphs. Alone on an H200 in about two minutes:
`python -m benchmarks run engine --only hisparse_prefill`.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from ..lib.context import Context
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
from .slice_steps import engine_prefill_s
from .slice_variants import variant_decode

DEVICE = "cuda"


def run(ctx: Context) -> dict[str, Any]:
    device, small = ctx.device, ctx.smoke
    dtype = "bfloat16" if ctx.on_gpu else "float32"
    spec = SMOKE_SLICE if small else SliceSpec()
    contexts = ctx.option("contexts", [64, 96] if small else [16384, 65536])
    settings = {
        "contexts": contexts,
        "decode_ctx": ctx.option("decode_ctx", contexts[-1]),
        "hisparse_rows": ctx.option("hisparse_rows", spec.index_topk if small else 2048),
        "steps": ctx.option("steps", 2 if small else 12),
        "prefill_repeats": ctx.option("prefill_repeats", 1 if small else 2),
        "graphs": ctx.option("graphs", True),
    }
    result: dict[str, Any] = {"slice": asdict(spec), "settings": settings, "ratios": {},
                              "ratios_unchecked": {}}
    hf = build_hf(spec, device, getattr(torch, dtype))
    for n in contexts:
        decode = n == settings["decode_ctx"]
        row = {label: guarded(lambda n=n, rows=rows, decode=decode: _engine_figures(
                   hf, spec, device, dtype, n, rows, decode, settings))
               for label, rows in (("off", None), ("on", settings["hisparse_rows"]))}
        off, on = row["off"], row["on"]
        if "greedy" in off and "greedy" in on:
            check = agreement(on.pop("greedy"), off.pop("greedy"))
            check["identical"] = (check["leading_tokens_agree"] == check["of"]
                                  and check["max_logprob_diff"] == 0.0)
            row["agreement"] = check
        ok = row.get("agreement", {}).get("ok", False)
        ratios = {}
        if on.get("prefill_s") and off.get("prefill_s"):
            ratios[f"hisparse_prefill_vs_off_ctx{n}"] = on["prefill_s"] / off["prefill_s"]
        if on.get("decode", {}).get("step_ms") and off.get("decode", {}).get("step_ms"):
            ratios[f"hisparse_decode_vs_off_ctx{n}"] = on["decode"]["step_ms"] / off["decode"]["step_ms"]
        result["ratios" if ok else "ratios_unchecked"].update(ratios)
        result[f"ctx{n}"] = row
    return result


def _engine_figures(hf: Any, spec: SliceSpec, device: str, dtype: str, n: int, hisparse_rows: int | None,
                    decode: bool, settings: dict[str, Any]) -> dict[str, Any]:
    """Prefill (and decode) figures of one engine sized for an n-token prompt, and its greedy run."""
    engine = build_engine(hf, device, dtype, max_model_len=n + 256, max_num_seqs=2,
                          num_virtual_tokens=2 * n + 8192, graphs=settings["graphs"],
                          hisparse_rows=hisparse_rows, decode="on")
    prompt = prompts(spec.vocab_size, 1, n, seed=n + 1)[0]
    budget = engine.core.scheduler.cfg.token_budget
    engine_prefill_s(engine, prompt[: min(budget, n)], device)  # compiles
    runs = [engine_prefill_s(engine, prompt, device) for _ in range(settings["prefill_repeats"])]
    out: dict[str, Any] = {"prefill_s": min(runs), "prefill_runs_s": runs,
                           "token_budget": budget, "plan_decode": engine.core.plan.decode.value}
    if decode:
        out["decode"] = variant_decode(engine, prompt, settings["steps"], device)
    out["greedy"] = greedy_with_logprobs(engine, prompt)
    hot = engine.pools.hot
    if hot is not None:
        out["host_tier"] = {"hits": hot.counters.hits, "misses": hot.counters.misses,
                            "rows_copied": hot.rows_copied(), "hot_buffer_device_bytes": hot.device_bytes()}
    free_engine(engine)
    return out
