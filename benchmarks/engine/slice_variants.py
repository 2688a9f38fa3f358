"""The slice's variant figures: the prefill FLOP floor, bytes per token of the pools, release numerics
and HiSparse against the exact fast path, the float32 gates of those variants, and the ratios.

Prefill FLOP floor (what a prefill of T tokens must compute, counted on the slice's dense
shapes): every linear a token passes through, 2 x its weights' elements (attention, indexer,
compressor, shared expert, router, mHC; 6 of the 16 routed experts; the lm_head for the last
token only), plus attention: for the token at position t, 4 x H x D FLOPs per key it attends
(min(t + 1, 128) window keys; C4 layers min(512, (t + 1) // 4) entries; C128 layers
(t + 1) // 128), plus the CSA indexer's 2 x Hi x Di per scored candidate ((t + 1) // 4).
Floor = FLOPs / the bf16 matmul rate measured in the same run.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..lib.slices import agreement, build_engine, free_engine, greedy_with_logprobs, prompts
from .slice_steps import settle


def prefill_flops(hf_model: Any, spec: Any, tokens: int) -> dict[str, float]:
    experts = linear = 0
    for name, p in hf_model.named_parameters():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            continue
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts += p.numel()
        elif p.dim() >= 2:
            linear += p.numel()
    per_token = 2 * (linear + experts * spec.num_experts_per_tok / spec.n_routed_experts)
    lm_head = 2 * spec.vocab_size * spec.hidden_size
    t1 = torch.arange(1, tokens + 1, dtype=torch.float64)  # t + 1
    per_entry = 4 * spec.num_heads * spec.head_dim
    attn = idx = 0.0
    for kind in spec.layer_types:
        keys = t1.clamp(max=spec.sliding_window)
        if kind == "compressed_sparse_attention":
            keys = keys + (t1 // 4).clamp(max=spec.index_topk)
            idx += float((t1 // 4).sum()) * 2 * spec.index_n_heads * spec.index_head_dim
        elif kind == "heavily_compressed_attention":
            keys = keys + t1 // 128
        attn += float(keys.sum()) * per_entry
    total = per_token * tokens + lm_head + attn + idx
    return {"linear_flops": per_token * tokens + lm_head, "attention_flops": attn, "indexer_flops": idx,
            "total_flops": total}


def pool_bytes_per_token(engine: Any) -> dict[str, float]:
    """Bytes per token slot of the compressed pools (C4 / C128 entries and indexer keys), and of
    everything the pools hold on the device, over the virtual token capacity."""
    pools = engine.pools
    slots = pools.layout.num_virtual_slots
    rows = [p.rows for p in list(pools.compressors.values()) + list(pools.indexers.values())]
    compressed = sum(t.numel() * t.element_size() for t in rows)
    return {"compressed_bytes_per_token": compressed / slots,
            "device_bytes_per_token": pools.device_bytes() / slots}


def variant_decode(engine: Any, prompt: list[int], steps: int, device: str) -> dict[str, Any]:
    """B1 decode step of a variant engine (release numerics, HiSparse): ms per step, and which path
    ran the timed steps (`fast_steps`: fixed-shape ones among them). With HiSparse also what the
    device holds for it (`hot_buffer_device_bytes`, against `pool_device_bytes` in all) and the
    rows paged in per timed step (device counter of the fixed-shape page-ins plus the general
    step's), and on the graphs the same steps with the CSA indexers (and their page-ins) on a
    second stream (`step_ms_overlap_indexer`)."""
    from antumbra import SamplingParams

    params = SamplingParams(max_tokens=3 * steps + 64, temperature=0.0, ignore_eos=True)
    rid = engine.core.add_request(prompt, params)
    while not engine.core.requests[rid].output_token_ids:
        engine.core.step()
    fast, hot = engine.runner.fast, engine.pools.hot

    def timed() -> tuple[float, int, int]:
        for _ in range(2):  # captures the graph on first use
            engine.core.step()
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        fast_before = fast.num_steps if fast is not None else 0
        copied_before = hot.rows_copied() if hot is not None else 0
        start = time.perf_counter()
        for _ in range(steps):
            engine.core.step()
        sync()
        ms = (time.perf_counter() - start) * 1e3 / steps
        copied = (hot.rows_copied() - copied_before) if hot is not None else 0
        return ms, (fast.num_steps - fast_before) if fast is not None else 0, copied

    step_ms, fast_steps, copied = timed()
    row: dict[str, Any] = {"step_ms": step_ms, "fast_path": fast is not None, "fast_steps": fast_steps,
                           "timed_steps": steps, "plan_decode": engine.core.plan.decode.value,
                           "pool_device_bytes": engine.pools.device_bytes()}
    if hot is not None:
        row.update(hot_buffer_device_bytes=hot.device_bytes(), rows_copied_per_step=copied / steps,
                   hot_rows_per_request=hot.rows_per_request, hot_layers=len(hot.layers))
        if fast is not None and fast.use_graphs and not fast.overlap_indexer:
            settle(engine)
            fast.set_overlap_indexer(True)
            row["step_ms_overlap_indexer"] = timed()[0]
            settle(engine)
            fast.set_overlap_indexer(False)
    engine.core.abort(rid)
    settle(engine)
    return row


def variant_ratios(result: dict[str, Any], ctx: int) -> dict[str, float]:
    """Host fraction, overlap gains, prefill against the FLOP floor, release and HiSparse against the
    exact fast path, each only where both sides ran in this run."""
    eng = result.get("engine", {})
    out: dict[str, float] = {}
    for batch in (1, 8, 32, 64):
        row = eng.get(f"decode_B{batch}_ctx{ctx}", {})
        if row.get("step_ms") and row.get("graph_replay_ms"):
            host = max(0.0, row["step_ms"] - row["graph_replay_ms"])
            out[f"engine_host_fraction_B{batch}_ctx{ctx}"] = host / row["step_ms"]
        if row.get("graph_replay_ms") and row.get("graph_replay_ms_overlap_indexer"):
            # Above 1: the CSA indexers on a second stream shorten the graph at this batch.
            side = row["graph_replay_ms"] / row["graph_replay_ms_overlap_indexer"]
            out[f"engine_overlap_indexer_gain_B{batch}_ctx{ctx}"] = side
        if row.get("step_ms") and row.get("step_ms_no_overlap"):
            gain = row["step_ms_no_overlap"] / row["step_ms"]
            out[f"engine_overlap_schedule_gain_B{batch}_ctx{ctx}"] = gain
    longest = max((int(k.rsplit("ctx", 1)[1]) for k in eng if k.startswith("decode_B8_ctx")), default=None)
    short, long_ = eng.get(f"decode_B8_ctx{ctx}", {}), eng.get(f"decode_B8_ctx{longest}", {})
    if longest and longest > ctx and short.get("tokens_per_s") and long_.get("tokens_per_s"):
        flat = long_["tokens_per_s"] / short["tokens_per_s"]
        out[f"decode_throughput_B8_{longest // 1024}k_vs_{ctx // 1024}k"] = flat
    mm = result.get("rates", {}).get("matmul_tflops")
    for key, value in eng.items():
        if key.startswith("prefill_B1_ctx") and "s" in value and mm and "flops" in value:
            n = key.rsplit("ctx", 1)[1]
            out[f"engine_prefill_flop_frac_ctx{n}"] = value["flops"]["total_flops"] / (mm * 1e12) / value["s"]
        elif key.startswith("prefill_chunk") and "s" in value and mm and "flops" in value:
            frac = value["flops"]["total_flops"] / (mm * 1e12) / value["s"]
            out[f"engine_prefill_flop_frac_{key.removeprefix('prefill_')}"] = frac
    rel, exact = result.get("release", {}), eng.get(f"decode_B1_ctx{ctx}", {})
    if rel.get("step_ms") and exact.get("step_ms"):
        out[f"engine_release_vs_exact_step_B1_ctx{ctx}"] = rel["step_ms"] / exact["step_ms"]
    if rel.get("bytes") and result.get("exact_bytes"):
        exact_bytes = result["exact_bytes"]["compressed_bytes_per_token"]
        release_bytes = rel["bytes"]["compressed_bytes_per_token"]
        out["engine_release_vs_exact_bytes_per_token"] = release_bytes / exact_bytes
    his = result.get("hisparse", {})
    off = eng.get(f"decode_B1_ctx{his.get('ctx')}", {})
    if his.get("step_ms") and off.get("step_ms"):
        out[f"engine_hisparse_vs_off_step_B1_ctx{his['ctx']}"] = his["step_ms"] / off["step_ms"]
        if his.get("step_ms_overlap_indexer"):  # the page-ins beside the main stream's work
            key = f"engine_hisparse_overlap_indexer_vs_off_step_B1_ctx{his['ctx']}"
            out[key] = his["step_ms_overlap_indexer"] / off["step_ms"]
    return out


def hisparse_agreements(engine_with: Any, prompt: list[int], ours: tuple[list[int], list[float]],
                         vs_general: dict[str, Any], gate: dict[str, Any]) -> dict[str, Any]:
    """The gate is `gate` (`hisparse_float32`); beside it, for the record, the bf16 agreements:
    HiSparse on the fixed-shape step against the same step without HiSparse, against the HiSparse
    general step, and the fixed-shape step's own agreement with the general step without HiSparse
    (two kernel paths in bf16 over one long context)."""
    fixed = engine_with(decode="on")
    off_fixed = greedy_with_logprobs(fixed, prompt)
    free_engine(fixed)
    general = engine_with(decode="off")
    off_general = greedy_with_logprobs(general, prompt)
    free_engine(general)
    return {"agreement": gate, "bf16_vs_fixed_off": agreement(ours, off_fixed),
            "bf16_vs_hisparse_general": vs_general,
            "bf16_calibration_fixed_vs_general_off": agreement(off_fixed, off_general)}


def _float32_run(hf_model: Any, device: str, ctx: int, decode: str, nudge: float = 0.0,
                 **kwargs: Any) -> tuple[list[int], list[float]]:
    """Greedy tokens and logprobs in float32: dense weights holding the packed values exactly, every
    prefill on the PyTorch general step, so that engines differing only in `decode` (the fixed-shape
    step or the general one) decode one prefill. `nudge` scales the embedding table by 1 + nudge.

    In bf16 two right paths of this slice part at near-ties and differ by up to about 0.1 in logprob
    (docs/performance.md), which hides any bug smaller than that; in float32 they agree to ~1e-5."""
    engine = build_engine(hf_model, device, "float32", max_model_len=ctx + 256, max_num_seqs=2,
                          num_virtual_tokens=2 * ctx + 8192, decode=decode, dense=True, general_kernels="off",
                          **kwargs)
    if nudge:
        with torch.no_grad():
            engine.core.model.model.embed_tokens.weight.mul_(1.0 + nudge)
    prompt = prompts(hf_model.config.vocab_size, 1, ctx, seed=ctx + 1, shared=0)[0]
    run = greedy_with_logprobs(engine, prompt)
    free_engine(engine)
    return run


def _float32_row(ours: tuple[list[int], list[float]], theirs: tuple[list[int], list[float]], ctx: int,
                 bound: float | None = None) -> dict[str, Any]:
    row = agreement(ours, theirs)
    row.update(ctx=ctx, dtype="float32", ok=row["leading_tokens_agree"] == row["of"]
               and row["max_logprob_diff"] < (FLOAT32_BOUND if bound is None else bound),
               logprob_diffs=[abs(a - b) for a, b in zip(ours[1], theirs[1], strict=True)])
    return row


def hisparse_float32(hf_model: Any, device: str, ctx: int, hisparse_rows: int) -> dict[str, Any]:
    """HiSparse's float32 gate, and beside it what tells a HiSparse fault from the fixed-shape step's
    own spread against the general step at this context:
    * `agreement` (the gate): HiSparse's fixed-shape step against its general step (host-side
      page-ins), all AGREE_TOKENS tokens within FLOAT32_BOUND;
    * `fixed_vs_general_off`: the same pair of steps without HiSparse;
    * `hisparse_vs_off_fixed`: the fixed-shape step with and without HiSparse. Both run the same
      kernels on the same prefill (the PyTorch general step's), and paging only moves rows, so they
      must agree to PAGING_BOUND; it is part of the gate.
    The gate passes when paging agrees and either HiSparse's two steps agree within FLOAT32_BOUND or
    they part exactly as the two steps without HiSparse do (`same_spread_as_off`: the same tokens, every
    token's difference within PAGING_BOUND of the other pair's). That second case is a spread of the
    fixed-shape step against the general step at this prompt, which HiSparse leaves as it finds it. Per-token
    differences are kept (`logprob_diffs`) to show where two paths part."""
    hisparse = {"hisparse_rows": hisparse_rows}
    runs = {(decode, name): _float32_run(hf_model, device, ctx, decode, **extra)
            for name, extra in (("hisparse", hisparse), ("off", {})) for decode in ("on", "off")}
    gate = _float32_row(runs[("on", "hisparse")], runs[("off", "hisparse")], ctx)
    paging = _float32_row(runs[("on", "hisparse")], runs[("on", "off")], ctx, bound=PAGING_BOUND)
    off = _float32_row(runs[("on", "off")], runs[("off", "off")], ctx)
    gate.update(fixed_vs_general_off=off, hisparse_vs_off_fixed=paging, vs_general_ok=gate["ok"],
                same_spread_as_off=same_spread(gate, off))
    gate["ok"] = paging["ok"] and (gate["vs_general_ok"] or gate["same_spread_as_off"])
    return gate


def same_spread(ours: dict[str, Any], off: dict[str, Any]) -> bool:
    """Two float32 agreement rows part alike: as many leading tokens, each token's logprob difference
    within PAGING_BOUND of the other's."""
    return ours["leading_tokens_agree"] == off["leading_tokens_agree"] == ours["of"] and all(
        abs(a - b) <= PAGING_BOUND for a, b in zip(ours["logprob_diffs"], off["logprob_diffs"], strict=True))


# The fixed-shape step with and without HiSparse: one computation on rows that paging moved, not changed.
PAGING_BOUND = 1e-6
FLOAT32_BOUND = 1e-3


def gate_ratios(result: dict[str, Any], ctx: int) -> None:
    """Headline ratios only from checks that passed: the run's checks (logits against transformers,
    every timed batch running) gate every ratio; a variant's agreement with the path it
    replaces gates that variant's ratios. The rest are kept apart under `ratios_unchecked`."""
    result["checks_ok"] = _checks_ok(result)
    _ratios(result, ctx)
    failed = [label for label in ("release", "hisparse")
              if label in result and not result[label].get("agreement", {}).get("ok", False)]
    unchecked = {key: value for key, value in result["ratios"].items()
                 if not result["checks_ok"] or any(key.startswith(f"engine_{label}_") for label in failed)}
    result["ratios_unchecked"] = unchecked
    result["ratios"] = {key: value for key, value in result["ratios"].items() if key not in unchecked}
    result["variant_checks_failed"] = failed


def _checks_ok(result: dict[str, Any]) -> bool:
    logits = result.get("logits_vs_transformers", {})
    # Every timed decode ran its whole batch (no request preempted or waiting during the timing).
    batches_ok = all(row.get("all_running", True) and "error" not in row
                     for key, row in result.get("engine", {}).items() if key.startswith("decode_"))
    return bool(logits.get("same_argmax")) and \
        logits.get("rel_err", 1.0) < 0.05 and batches_ok


def _ratios(result: dict[str, Any], ctx: int) -> None:
    ours = result["engine"].get(f"decode_B1_ctx{ctx}", {})
    theirs = result["transformers"].get(f"B1_ctx{ctx}", {})
    bw = result.get("rates", {}).get("copy_gbps")
    ratios = result["ratios"]
    if "step_ms" in ours and "step_ms" in theirs:
        ratios[f"engine_decode_vs_transformers_B1_ctx{ctx}"] = theirs["step_ms"] / ours["step_ms"]
    if "step_ms" in ours and bw:
        floor_ms = ours["floor"]["total_bytes"] / (bw * 1e9) * 1e3
        ratios[f"engine_decode_vs_floor_B1_ctx{ctx}"] = floor_ms / ours["step_ms"]
        ours["floor"]["floor_ms"] = floor_ms
        if ours.get("graph_replay_ms"):
            ratios[f"engine_graph_vs_floor_B1_ctx{ctx}"] = floor_ms / ours["graph_replay_ms"]
    if ours.get("graph_replay_ms") and ours.get("graph_replay_ms_overlap_indexer"):
        # Above 1: the indexer on a second stream shortens the step (FastPathConfig.overlap_indexer).
        ratios[f"engine_overlap_indexer_gain_B1_ctx{ctx}"] = (
            ours["graph_replay_ms"] / ours["graph_replay_ms_overlap_indexer"]
        )
    for key, value in result["engine"].items():
        if key.startswith("prefill") and "s" in value:
            ratios[f"engine_{key}_s"] = value["s"]
    ratios.update(variant_ratios(result, ctx))


def release_gate(hf_model: Any, device: str, ctx: int) -> dict[str, Any]:
    """Release numerics' gate, in float32: the fixed-shape step against the general step parts no
    more than the general step parts from itself when its embedding table is scaled by 1 + 2^-22.

    Release rounds activations, KV rows and indexer keys to FP8 / FP4, so two right paths that differ
    by float32 rounding flip codes and part by 1e-2 to 1e-1 within a few tokens, where exact numerics
    part by 1e-5; a fixed bound cannot tell that from a bug, the nudge's spread measured in the same
    run can. The kernels one by one are checked against their references by the GPU-marked tests."""
    runs = {"fixed": _float32_run(hf_model, device, ctx, "on", numerics="release"),
            "general": _float32_run(hf_model, device, ctx, "off", numerics="release"),
            "nudged": _float32_run(hf_model, device, ctx, "off", numerics="release", nudge=2.0**-22)}
    spread = _mean_diff(runs["fixed"], runs["general"])
    nudge = _mean_diff(runs["nudged"], runs["general"])
    bound = max(SPREAD_SLACK * nudge["mean_logprob_diff"], SPREAD_FLOOR)
    ok = spread["leading_tokens_agree"] >= 2 and spread["mean_logprob_diff"] <= bound
    return {"ok": ok, "ctx": ctx, "fixed_vs_general": spread, "nudged_vs_general": nudge, "bound": bound}


SPREAD_SLACK = 3.0  # the fixed-vs-general spread may be this many times the nudge's ...
SPREAD_FLOOR = 0.05  # ... or this mean logprob difference, whichever is larger


def _mean_diff(ours: tuple[list[int], list[float]], theirs: tuple[list[int], list[float]]) -> dict[str, Any]:
    row = agreement(ours, theirs)
    n = row["leading_tokens_agree"]
    diffs = [abs(a - b) for a, b in zip(ours[1][:n], theirs[1][:n], strict=True)]
    row["mean_logprob_diff"] = sum(diffs) / len(diffs) if diffs else 0.0
    return row
