"""Launch-shape sweeps for the attention, top-k and MoE kernels in one process (one GPU lease).

Every variant is checked against the float32 reference on fresh inputs before it is timed; a
variant that fails to compile or to match is recorded with its error and the sweep goes on.
Timings are CUDA-graph replays over rotating input sets (as in the kernels suite). What a sweep
decided is written beside its kernel (`antumbra/kernels/<op>/TUNING.md`).

    python -m benchmarks run tuning [--smoke] [--set only=attention,topk,moe] [--set budget_s=185]
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import traceback
from typing import Any

import torch

from ..lib.checks import rel_err
from ..lib.context import Context
from ..lib.timing import time_us

T0 = time.perf_counter()


def _log(*parts: Any) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s]", *parts, flush=True)



# ----------------------------------------------------------------------------- attention
def attention(device: str, smoke: bool, budget_s: float) -> list[dict[str, Any]]:
    from antumbra.kernels.hybrid_attention import triton as K
    from antumbra.kernels.hybrid_attention.reference import hybrid_attention_reference as reference

    g = torch.Generator(device=device).manual_seed(0)
    if smoke:
        heads, d, window, topk, pool_rows, xrows, rotate, reps = 4, 64, 16, 32, 4096, 4096, 2, 1
        base = K.AttentionConfig(block_k=16)
        batches = [1, 3]
    else:
        heads, d, window, topk, pool_rows, xrows, rotate, reps = 64, 512, 128, 512, 2**19, 2**20, 8, 20
        base = K.AttentionConfig()
        batches = [1, 8, 32, 64, 128]
    kv = torch.randn(pool_rows, d, device=device, generator=g).to(torch.bfloat16)
    ex = torch.randn(xrows, d, device=device, generator=g).to(torch.bfloat16)
    sinks = torch.randn(heads, device=device, generator=g)
    R = dataclasses.replace
    bk32 = R(base, block_k=32, num_stages=3)
    variants: list[tuple[str, Any, int | None, list[int]]] = [
        ("default", base, None, [32, 64] if not smoke else batches),
        ("bk32_s3", bk32, None, [8, 32, 64] if not smoke else [3]),
        ("bk32_s4", R(base, block_k=32, num_stages=4), None, [32] if not smoke else [3]),
    ]
    if not smoke:
        variants += [
            ("default_S2", base, 2, [32]),
            ("default_S3", base, 3, [32]),
            ("bk32_s3_S3", bk32, 3, [32]),
            ("dv256_w4_bk32_s3", R(bk32, block_dv=256, num_warps=4), None, [32]),
            ("default_S5", base, 5, [8]),
            ("bk32_s3_S20", bk32, 20, [1]),
        ]
    sets_cache: dict[int, Any] = {}

    def inputs(batch: int):
        if batch not in sets_cache:
            sets = []
            for _ in range(rotate):
                q = torch.randn(batch, heads, d, device=device, generator=g).to(torch.bfloat16)
                w = torch.randint(
                    0, pool_rows, (batch, window), device=device, generator=g, dtype=torch.int32
                )
                e = torch.randint(0, xrows, (batch, topk), device=device, generator=g, dtype=torch.int32)
                sets.append((q, w, e))
            sets_cache[batch] = sets
        return sets_cache[batch]

    rows = []
    for name, cfg, splits, bs in variants:
        for batch in bs:
            if time.perf_counter() - T0 > budget_s:
                rows.append({"variant": name, "batch": batch, "skipped": "budget"})
                continue
            entry: dict[str, Any] = {"variant": name, "batch": batch, "splits_arg": splits}
            try:
                planned, per = K.plan_splits(batch, window, topk, d, device, cfg, splits)
                entry["splits"], entry["blocks_per_split"] = planned, per
                # correctness on fresh inputs with holes, poisoned output and scratch
                q = torch.randn(batch, heads, d, device=device, generator=g).to(torch.bfloat16)
                w = torch.randint(
                    0, pool_rows, (batch, window), device=device, generator=g, dtype=torch.int32
                )
                e = torch.randint(0, xrows, (batch, topk), device=device, generator=g, dtype=torch.int32)
                if batch > 1:
                    w[0, : window // 2] = -1
                    e[-1, topk // 3:] = -1
                out = torch.full_like(q, float("nan"))
                ws = K.AttentionWorkspace.empty(batch, planned, heads, d, device,
                                                torch.bfloat16 if cfg.narrow_partials else torch.float32)
                ws.acc.fill_(float("nan"))
                ws.ml.fill_(float("nan"))
                K.hybrid_attention_decode(
                    q, kv, w, ex, e, sinks, out=out, num_splits=splits, config=cfg, workspace=ws
                )
                ref = reference(q, kv, w, ex, e, sinks)
                entry["rel_err"] = rel_err(out, ref)
                entry["ok"] = bool(out.isfinite().all()) and entry["rel_err"] < 1e-2
                # timing: no workspace passed (the benchmark's call), and with a kept workspace
                sets = inputs(batch)
                outs = [torch.empty_like(s[0]) for s in sets]
                calls = [functools.partial(K.hybrid_attention_decode, qq, kv, ww, ex, ee, sinks, out=o,
                                           num_splits=splits, config=cfg)
                         for (qq, ww, ee), o in zip(sets, outs, strict=True)]
                entry["us"] = time_us(calls, device, reps=reps)
                wss = [K.AttentionWorkspace.empty(batch, planned, heads, d, device,
                                                  torch.bfloat16 if cfg.narrow_partials else torch.float32)
                       for _ in sets]
                calls_ws = [functools.partial(K.hybrid_attention_decode, qq, kv, ww, ex, ee, sinks, out=o,
                                              num_splits=splits, config=cfg, workspace=wk)
                            for (qq, ww, ee), o, wk in zip(sets, outs, wss, strict=True)]
                entry["us_ws"] = time_us(calls_ws, device, reps=reps)
                moved = (
                    batch * (window + topk) * d * 2 + 2 * batch * heads * d * 2 + batch * (window + topk) * 4
                )
                entry["roofline"] = moved / 4257e3 / entry["us"]
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                entry["trace"] = traceback.format_exc()[-1500:]
            _log("attn", json.dumps({k: v for k, v in entry.items() if k != "trace"}))
            rows.append(entry)
    if not smoke:
        # What random 1 KiB row gathers cost on their own, and the kernel on clustered rows.
        batch = 32
        for label, span in (("random", None), ("local_64MB", 2**16)):
            try:
                sets = []
                for _ in range(rotate):
                    hi_w, hi_x = (pool_rows, xrows) if span is None else (span, span)
                    sets.append((torch.randn(batch, heads, d, device=device, generator=g).to(torch.bfloat16),
                                 torch.randint(0, hi_w, (batch, window), device=device, generator=g,
                                               dtype=torch.int32),
                                 torch.randint(0, hi_x, (batch, topk), device=device, generator=g,
                                               dtype=torch.int32)))
                gather = [functools.partial(_gather, kv, ex, ww, ee) for _, ww, ee in sets]
                outs = [torch.empty_like(s[0]) for s in sets]
                kern = [functools.partial(K.hybrid_attention_decode, qq, kv, ww, ex, ee, sinks, out=o)
                        for (qq, ww, ee), o in zip(sets, outs, strict=True)]
                entry = {
                    "variant": f"gather_{label}",
                    "batch": batch,
                    "gather_us": time_us(gather, device, reps=reps),
                    "kernel_us": time_us(kern, device, reps=reps),
                }
                entry["gather_gbps"] = batch * (window + topk) * d * 2 * 2 / entry["gather_us"] / 1e3
            except Exception as exc:
                entry = {"variant": f"gather_{label}", "error": repr(exc)[:300]}
            _log("attn", json.dumps(entry))
            rows.append(entry)
    return rows


def _gather(kv: torch.Tensor, ex: torch.Tensor, w: torch.Tensor, e: torch.Tensor) -> None:
    kv.index_select(0, w.view(-1).long())
    ex.index_select(0, e.view(-1).long())


# ----------------------------------------------------------------------------- top-k
def topk(device: str, smoke: bool, budget_s: float) -> list[dict[str, Any]]:
    from antumbra.kernels.indexer_topk import triton as K
    from antumbra.kernels.indexer_topk.reference import indexer_scores_reference, topk_rows_reference

    from .topk import check_selection

    g = torch.Generator(device=device).manual_seed(1)
    if smoke:
        heads, di, k, pool_rows, rotate, reps = 4, 32, 16, 4096, 1, 1
        shapes = [(1, 300), (2, 1000)]
        old = K.TopkConfig(
            score_block_n=32, filter_block_n=64, finish_block_n=32, keys_block_n=64, finish_regs=256
        )
        base = K.TopkConfig(score_block_n=32, filter_block_n=64, finish_block_n=32, keys_block_n=64)
        variants = {"old": old, "new": base}
    else:
        heads, di, k, pool_rows, rotate, reps = 64, 128, 512, 2**23, 4, 20
        shapes = [(1, 65536), (1, 4096), (1, 16384), (8, 65536), (32, 16384)]
        base = K.TopkConfig()
        R = dataclasses.replace
        variants = {
            "default": base,
            "splits16": R(base, tie_log_splits=4),
            "splits64": R(base, tie_log_splits=6),
            "regs2048": R(base, finish_regs=2048),
            "b9": R(base, coarse_bits=9),
            "b10": R(base, coarse_bits=10),
        }
    pool = torch.randn(pool_rows, di, device=device, generator=g).to(torch.bfloat16)
    rows = []
    for batch, n in shapes:
        q = [
            torch.randn(batch, heads, di, device=device, generator=g).to(torch.bfloat16)
            for _ in range(rotate)
        ]
        w = [torch.randn(batch, heads, device=device, generator=g) * heads**-0.5 for _ in range(rotate)]
        cand = [torch.stack([torch.randperm(pool_rows, device=device, generator=g)[:n] for _ in range(batch)])
                .to(torch.int32) for _ in range(rotate)]
        scores = [torch.randn(batch, n, device=device, generator=g) for _ in range(rotate)]
        for name, cfg in variants.items():
            if time.perf_counter() - T0 > budget_s:
                rows.append({"variant": name, "batch": batch, "n": n, "skipped": "budget"})
                continue
            entry: dict[str, Any] = {"variant": name, "batch": batch, "n": n}
            try:
                # correctness: fused against fp32 scores, top-k only exact
                out = torch.full((batch, k), -2, dtype=torch.int32, device=device)
                K.indexer_topk(q[0], w[0], pool, cand[0], k, out=out, config=cfg)
                m = max(1, min(batch, 2**21 // n))
                ref_scores = indexer_scores_reference(q[0][:m], w[0][:m], pool, cand[0][:m])
                ref = topk_rows_reference(ref_scores, cand[0][:m], k)
                chk = check_selection(out[:m], ref, ref_scores, cand[0][:m], tol=1e-3)
                out2 = torch.full((batch, k), -2, dtype=torch.int32, device=device)
                K.topk_rows(scores[0], cand[0], k, out=out2, config=cfg)
                exact = torch.equal(
                    out2.sort(1).values, topk_rows_reference(scores[0], cand[0], k).sort(1).values
                )
                entry["ok"] = chk["ok"] and exact and not bool((out == -2).any())
                entry["problems"] = chk["problems"][:2]
                ws = K.TopkWorkspace.allocate(batch, n, k, device, cfg.coarse_bits)
                outs = [torch.empty(batch, k, dtype=torch.int32, device=device) for _ in range(rotate)]
                fused = [
                    functools.partial(
                        K.indexer_topk, q[i], w[i], pool, cand[i], k, out=outs[i], workspace=ws, config=cfg
                    )
                    for i in range(rotate)
                ]
                only = [
                    functools.partial(
                        K.topk_rows, scores[i], cand[i], k, out=outs[i], workspace=ws, config=cfg
                    )
                    for i in range(rotate)
                ]
                entry["fused_us"] = time_us(fused, device, reps=reps)
                entry["only_us"] = time_us(only, device, reps=reps)
                # first launch alone (its histogram piles up; reset after)
                ws2 = K.TopkWorkspace.allocate(batch, n, k, device, cfg.coarse_bits)
                score_only = [functools.partial(_score_launch, K, q[i], w[i], pool, cand[i], ws2, cfg)
                              for i in range(rotate)]
                keys_only = [
                    functools.partial(_keys_launch, K, scores[i], cand[i], ws2, cfg) for i in range(rotate)
                ]
                entry["score_kernel_us"] = time_us(score_only, device, reps=reps)
                entry["keys_kernel_us"] = time_us(keys_only, device, reps=reps)
                entry["ws_clean"] = bool((ws.hist == 0).all()) and bool((ws.counters == 0).all())
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                entry["trace"] = traceback.format_exc()[-1500:]
            _log("topk", json.dumps({kk: v for kk, v in entry.items() if kk != "trace"}))
            rows.append(entry)
        if not smoke:
            tt = [functools.partial(torch.topk, scores[i], k, dim=1) for i in range(rotate)]
            rows.append(
                {"variant": "torch.topk", "batch": batch, "n": n, "only_us": time_us(tt, device, reps=reps)}
            )
            _log("topk", json.dumps(rows[-1]))
    return rows


def _score_launch(K, q, w, pool, cand, ws, cfg) -> None:
    K.launch_scores(q, w, pool, cand, None, ws, q.shape[2] ** -0.5, cfg)


def _keys_launch(K, scores, cand, ws, cfg) -> None:
    rows, n = scores.shape
    block_n = min(cfg.keys_block_n, max(16, 1 << (n - 1).bit_length()))
    num_blocks = (n + block_n - 1) // block_n
    programs, per = K._grid_split(rows, num_blocks, cfg.programs_per_sm, scores.device)
    K._score_keys_kernel[(rows, programs)](
        scores, cand, cand, ws.keys, ws.hist, n, per, BLOCK_N=block_n, COARSE_BITS=cfg.coarse_bits,
        HAS_NCAND=False, num_warps=4,
    )


# ----------------------------------------------------------------------------- MoE
def moe(device: str, smoke: bool, budget_s: float, copy_gbps: float) -> list[dict[str, Any]]:
    from antumbra.kernels.moe_mxfp4 import MoeTiles, moe_mxfp4, moe_mxfp4_reference

    from .moe import expert_weights, make_routing, moe_call

    g = torch.Generator(device=device).manual_seed(2)
    if smoke:
        experts, hidden, inter, top_k, rotate, reps = 8, 64, 64, 2, 2, 1
        tiles = {"old": MoeTiles(1, 32, 32, False, packed_math=False, sum_slots=False),
                 "new": MoeTiles(1, 32, 32, False, down_block_n=16)}
        batches = {"old": [1], "new": [1, 2]}
    else:
        experts, hidden, inter, top_k, rotate, reps = 256, 4096, 2048, 6, 4, 20
        R = dataclasses.replace
        base = MoeTiles(1, 16, 512, False, num_stages=2, down_block_n=16)
        tiles = {
            "new": base,
            "st3": R(base, num_stages=3),
            "n32_kb256_st3": R(base, block_n=32, block_kb=256, num_stages=3),
            "n32_kb512": R(base, block_n=32),
            "d8": R(base, down_block_n=8),
            "d32": R(base, down_block_n=32),
            "fp32math": R(base, packed_math=False),
            "nosum": R(base, sum_slots=False),
            "n16_kb256_st3": R(base, block_kb=256, num_stages=3),
            "w8_n32": R(base, block_n=32, num_warps=8, down_block_n=32),
        }
        batches = {name: [1] for name in tiles}
        batches["new"] = [1, 2, 4, 8]
    w = expert_weights(experts, hidden, inter, device, g)
    expert_bytes = 3 * (inter * hidden // 2 + inter * hidden // 32)
    rows = []
    for name, t in tiles.items():
        for tokens in batches[name]:
            if time.perf_counter() - T0 > budget_s:
                rows.append({"variant": name, "tokens": tokens, "skipped": "budget"})
                continue
            entry: dict[str, Any] = {"variant": name, "tokens": tokens, "tiles": str(t)}
            try:
                perm = torch.randperm(experts, device=device, generator=g)
                sets = []
                for r in range(rotate):
                    chosen = None
                    if tokens == 1:
                        chosen = perm[r * top_k:(r + 1) * top_k].view(1, top_k)
                    x = torch.randn(tokens, hidden, device=device, generator=g).to(torch.bfloat16)
                    sets.append((x, make_routing(tokens, top_k, experts, device, g, chosen)))
                out = moe_call(moe_mxfp4, *sets[0], w, 10.0, tiles=t)
                ref = moe_call(moe_mxfp4_reference, sets[0][0].float(), sets[0][1], w, 10.0)
                entry["rel_err"] = rel_err(out, ref)
                entry["ok"] = bool(out.isfinite().all()) and entry["rel_err"] < 1e-2
                calls = [functools.partial(moe_call, moe_mxfp4, x, route, w, 10.0, tiles=t)
                         for x, route in sets]
                entry["us"] = time_us(calls, device, reps=reps)
                hit = sum(route["topk_ids"].unique().numel() for _, route in sets) / len(sets)
                entry["weight_bw"] = hit * expert_bytes / (entry["us"] * 1e3) / copy_gbps
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                entry["trace"] = traceback.format_exc()[-1500:]
            _log("moe", json.dumps({k: v for k, v in entry.items() if k not in ("trace", "tiles")}))
            rows.append(entry)
    return rows


def quick(device: str, smoke: bool, budget_s: float) -> list[dict[str, Any]]:
    """Attention with many splits (one request, 8320 keys) and top-k at batch 1, default configs."""
    from antumbra.kernels.hybrid_attention import triton as A
    from antumbra.kernels.hybrid_attention.reference import hybrid_attention_reference
    from antumbra.kernels.indexer_topk import triton as T
    from antumbra.kernels.indexer_topk.reference import indexer_scores_reference, topk_rows_reference

    from .topk import check_selection

    g = torch.Generator(device=device).manual_seed(3)
    small = smoke or device == "cpu"
    heads, d, window, extra, rows_n = (4, 64, 16, 64, 4096) if small else (64, 512, 128, 8192, 2**17)
    kv = torch.randn(rows_n, d, device=device, generator=g).to(torch.bfloat16)
    ex = torch.randn(rows_n, d, device=device, generator=g).to(torch.bfloat16)
    sinks = torch.randn(heads, device=device, generator=g)
    sets = [
        (
            torch.randn(1, heads, d, device=device, generator=g).to(torch.bfloat16),
            torch.randint(0, rows_n, (1, window), device=device, generator=g, dtype=torch.int32),
            torch.randint(0, rows_n, (1, extra), device=device, generator=g, dtype=torch.int32),
        )
        for _ in range(4)
    ]
    out = torch.full_like(sets[0][0], float("nan"))
    A.hybrid_attention_decode(sets[0][0], kv, sets[0][1], ex, sets[0][2], sinks, out=out)
    ref = hybrid_attention_reference(sets[0][0], kv, sets[0][1], ex, sets[0][2], sinks)
    outs = [torch.empty_like(q) for q, _, _ in sets]
    calls = [functools.partial(A.hybrid_attention_decode, q, kv, w, ex, e, sinks, out=o)
             for (q, w, e), o in zip(sets, outs, strict=True)]
    rows = [{"kernel": "attention_B1_8320keys", "splits": A.plan_splits(1, window, extra, d, device)[0],
             "rel_err": rel_err(out, ref), "us": time_us(calls, device, reps=10)}]
    _log("quick", json.dumps(rows[-1]))
    heads, di, k, pool_rows = (4, 32, 16, 4096) if small else (64, 128, 512, 2**20)
    pool = torch.randn(pool_rows, di, device=device, generator=g).to(torch.bfloat16)
    for n in ((1000,) if small else (65536, 262144)):
        q = [torch.randn(1, heads, di, device=device, generator=g).to(torch.bfloat16) for _ in range(4)]
        w = [torch.randn(1, heads, device=device, generator=g) * heads**-0.5 for _ in range(4)]
        cand = [torch.randperm(pool_rows, device=device, generator=g)[:n].view(1, n).to(torch.int32)
                for _ in range(4)]
        scores = [torch.randn(1, n, device=device, generator=g) for _ in range(4)]
        o1 = torch.full((1, k), -2, dtype=torch.int32, device=device)
        T.indexer_topk(q[0], w[0], pool, cand[0], k, out=o1)
        rs = indexer_scores_reference(q[0], w[0], pool, cand[0])
        chk = check_selection(o1, topk_rows_reference(rs, cand[0], k), rs, cand[0], tol=1e-3)
        o2 = torch.full((1, k), -2, dtype=torch.int32, device=device)
        T.topk_rows(scores[0], cand[0], k, out=o2)
        exact = torch.equal(o2.sort(1).values, topk_rows_reference(scores[0], cand[0], k).sort(1).values)
        ws = T.TopkWorkspace.allocate(1, n, k, device)
        outs = [torch.empty(1, k, dtype=torch.int32, device=device) for _ in range(4)]
        fused = [functools.partial(T.indexer_topk, q[i], w[i], pool, cand[i], k, out=outs[i], workspace=ws)
                 for i in range(4)]
        only = [
            functools.partial(T.topk_rows, scores[i], cand[i], k, out=outs[i], workspace=ws) for i in range(4)
        ]
        tt = [functools.partial(torch.topk, scores[i], k, dim=1) for i in range(4)]
        rows.append(
            {
                "kernel": f"topk_B1_N{n}",
                "ok": chk["ok"] and exact,
                "fused_us": time_us(fused, device, reps=10),
                "only_us": time_us(only, device, reps=10),
                "torch_topk_us": time_us(tt, device, reps=10),
            }
        )
        _log("quick", json.dumps(rows[-1]))
    return rows


SWEEPS = {"attention": 0.4, "topk": 0.35, "moe": 0.25}  # share of the time budget each sweep gets


def run(ctx: Context) -> dict[str, Any]:
    """Options: `only` (comma list of attention, topk, moe, quick), `budget_s` (seconds after which
    variants are skipped)."""
    names = ctx.option("only", "attention,topk,moe").split(",")
    budget_s = ctx.option("budget_s", 185.0)
    results: dict[str, Any] = {}
    spent = 0.0
    for name in names:
        spent += SWEEPS.get(name, 1.0 / len(names))
        fn = {"attention": attention, "topk": topk, "moe": moe, "quick": quick}[name]
        kwargs = {"copy_gbps": ctx.rates.copy_gbps} if name == "moe" else {}
        try:
            results[name] = fn(ctx.device, ctx.smoke, budget_s * spent, **kwargs)
        except Exception as exc:
            results[name] = {"error": repr(exc), "trace": traceback.format_exc()[-3000:]}
    return results
