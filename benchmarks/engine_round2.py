"""Round-two figures of `engine_gpu.py` (issue 15): host fraction of the decode step, the prefill
FLOP floor, `release` numerics and HiSparse against the exact fast path, throughput against
round one, and the ratios named after the issue's targets.

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

ROUND_ONE_STEP_MS = {1: 1.60, 8: 2.60, 32: 3.53}  # the decode steps at ctx 4K (round one)


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


def settle(engine: Any) -> None:
    """Apply any overlapped step still in flight (its requests were aborted)."""
    overlap = getattr(engine.core, "overlap", None)
    if overlap is not None:
        overlap.drain()
        overlap.take_stash()


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


def ratios(result: dict[str, Any], ctx: int) -> dict[str, float]:
    """The issue's keys from the figures `engine_gpu.run` gathered (each only where both sides ran)."""
    eng = result.get("engine", {})
    out: dict[str, float] = {}
    for batch in (1, 8, 32, 64):
        row = eng.get(f"decode_B{batch}_ctx{ctx}", {})
        if row.get("step_ms") and row.get("graph_replay_ms"):
            host = max(0.0, row["step_ms"] - row["graph_replay_ms"])
            out[f"engine_host_fraction_B{batch}_ctx{ctx}"] = host / row["step_ms"]
        if row.get("step_ms") and batch in ROUND_ONE_STEP_MS:
            key = f"engine_decode_throughput_vs_round1_B{batch}_ctx{ctx}"
            out[key] = ROUND_ONE_STEP_MS[batch] / row["step_ms"]
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
    mm = result.get("matmul_tflops")
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
