"""Hybrid sparse attention kernels vs the PyTorch gather chain, at V4-Flash shapes.

64 query heads x head_dim 512, one latent KV head (K = V) in bf16, sliding window 128, and
per request either the indexer's top-512 C4 rows (CSA layers) or every causal C128 row
(HCA layers: context / 128 rows); per-head sink. Pool rows are drawn at random from pools of
about 1.5 GB, and timed calls rotate through several row sets, so key rows come from HBM.

* Correctness against `hybrid_attention_reference` in float32 on the bf16 inputs, for every
  timed launch shape: outputs and split-K scratch poisoned with NaN, fresh random inputs,
  some rows with missing keys (-1). bf16 tolerance 1e-2 relative (`lib/checks.BF16_TOL`).
* Decode timing: split + combine kernels captured in a CUDA graph, median of replays;
  the baseline is `hybrid_attention_reference(upcast=False)`: gather, einsum, one softmax
  with the sink, einsum, in bf16 like the model's eager path, in the same graph setup.
* Counted work per decode call, with n = W + K keys per request:
    bytes = B*n*d*2 (key rows, read once) + 2*B*H*d*2 (q in, out) + B*n*4 (row indices)
    FLOPs = 4*B*H*n*d (q.k and p.v)
  At B = 32, CSA: bytes = 25.3 MB, FLOPs = 2.68 GFLOP; the floor is the larger of
  bytes / copy bandwidth and FLOPs / bf16 matmul rate, both measured in the same run
  (`lib/floors.py`). `decode_attention_roofline_B32` = floor / time.
* A small sweep of launch configurations at B = 32 shows which tiling this GPU prefers.

    python -m benchmarks run kernels --only attention [--smoke]
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from ..lib.checks import BF16_TOL, rel_err
from ..lib.context import Context
from ..lib.timing import time_us

# ----- measurement helpers -----


# ----- attention -----
def counts(batch: int, heads: int, head_dim: int, keys: int) -> tuple[int, int]:
    """(bytes, FLOPs) of one decode call with `keys` valid keys per request (bf16 KV, q, out)."""
    moved = batch * keys * head_dim * 2 + 2 * batch * heads * head_dim * 2 + batch * keys * 4
    return moved, 4 * batch * heads * keys * head_dim


def _row_sets(
    batch: int,
    window: int,
    extra: int,
    pool_rows: int,
    extra_pool_rows: int,
    sets: int,
    device: str,
    g: torch.Generator,
    holes: bool,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random rows per request; with holes, some rows miss keys as real batches do."""
    out = []
    for _ in range(sets):
        win = torch.randint(0, pool_rows, (batch, window), device=device, generator=g, dtype=torch.int32)
        ext = torch.randint(0, extra_pool_rows, (batch, extra), device=device, generator=g, dtype=torch.int32)
        if holes:
            win[0, : window // 2] = -1  # near the start of its sequence
            ext[-1, extra // 3 :] = -1  # fewer compressed rows than the budget
        out.append((win, ext))
    return out


class Pools:
    """One layer's SWA pool and compressed pool, bf16, filled with random rows once."""

    def __init__(self, rows: int, extra_rows: int, head_dim: int, device: str, g: torch.Generator):
        self.kv = torch.randn(rows, head_dim, device=device, generator=g).to(torch.bfloat16)
        self.extra = torch.randn(extra_rows, head_dim, device=device, generator=g).to(torch.bfloat16)


def _check(kernels: Any, reference: Callable, pools: Pools, q, win, ext, sinks, **kwargs) -> dict[str, Any]:
    """Kernel vs float32 reference with poisoned output and scratch."""
    batch, heads, head_dim = q.shape
    out = torch.full_like(q, float("nan"))
    splits = kwargs.pop("num_splits", None)
    config = kwargs.get("config", kernels.DEFAULT_CONFIG)
    planned, _ = kernels.plan_splits(batch, win.shape[1], ext.shape[1], head_dim, q.device, config, splits)
    workspace = kernels.AttentionWorkspace.empty(batch, planned, heads, head_dim, q.device)
    workspace.acc.fill_(float("nan"))
    workspace.ml.fill_(float("nan"))
    kernels.hybrid_attention_decode(
        q, pools.kv, win, pools.extra, ext, sinks, out=out, num_splits=splits, workspace=workspace, **kwargs
    )
    ref = reference(q, pools.kv, win, pools.extra, ext, sinks)
    err = rel_err(out, ref)
    finite = bool(out.isfinite().all())
    return {
        "rel_err": err,
        "max_abs_err": (out.float() - ref.float()).abs().max().item(),
        "finite": finite,
        "ok": finite and err < BF16_TOL,
    }


def run(ctx: Context) -> dict[str, Any]:
    """Correctness at real shapes, then kernel vs PyTorch timings. Returns a JSON-able dict."""
    device, smoke = ctx.device, ctx.smoke
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
    from antumbra.kernels.hybrid_attention import triton as kernels
    from antumbra.kernels.hybrid_attention.reference import hybrid_attention_reference as reference

    g = torch.Generator(device=device).manual_seed(0)
    if smoke:
        heads, head_dim, window, topk = 4, 64, 16, 32
        csa_batches, hca_batches, contexts = [1, 3], [2], [1024, 4096]
        pool_rows, extra_pool_rows, rotate, reps = 4096, 4096, 2, 1
        configs = {
            "default": kernels.AttentionConfig(block_k=16),
            "chunked": kernels.AttentionConfig(block_k=16, block_d=32, block_dv=32),
        }
    else:
        heads, head_dim, window, topk = 64, 512, 128, 512
        csa_batches, hca_batches, contexts = [1, 8, 32, 64, 128], [1, 8, 32], [4096, 65536, 262144, 1048576]
        pool_rows, extra_pool_rows, rotate, reps = 2**19, 2**20, 8, 20  # 0.5 GB + 1 GB of bf16 rows
        configs = {
            "default": kernels.DEFAULT_CONFIG,
            "bk32_s3": kernels.AttentionConfig(block_k=32, num_stages=3),
            "bk32_s4": kernels.AttentionConfig(block_k=32, num_stages=4),
            "lazy_rescale": kernels.AttentionConfig(lazy_rescale=True),
            "fp32_partials": kernels.AttentionConfig(narrow_partials=False),
            "dv256_w4_bk32_s3": kernels.AttentionConfig(block_k=32, num_stages=3, block_dv=256, num_warps=4),
        }
    copy_gbps = ctx.rates.copy_gbps
    matmul_tflops = ctx.rates.matmul_tflops
    bw = copy_gbps
    rate = matmul_tflops
    pools = Pools(pool_rows, extra_pool_rows, head_dim, device, g)
    sinks = torch.randn(heads, device=device, generator=g)

    def q_of(batch: int) -> torch.Tensor:
        return torch.randn(batch, heads, head_dim, device=device, generator=g).to(torch.bfloat16)

    def measure(label: str, batch: int, extra: int, context: int | None) -> dict[str, Any]:
        rows = _row_sets(batch, window, extra, pool_rows, extra_pool_rows, rotate, device, g, holes=False)
        queries = [q_of(batch) for _ in rows]
        checked = _check(
            kernels,
            reference,
            pools,
            queries[0],
            *_row_sets(batch, window, extra, pool_rows, extra_pool_rows, 1, device, g, holes=batch > 1)[0],
            sinks,
        )
        outs = [torch.empty_like(q) for q in queries]
        kernel_calls = [
            functools.partial(kernels.hybrid_attention_decode, q, pools.kv, w, pools.extra, e, sinks, out=o)
            for q, (w, e), o in zip(queries, rows, outs, strict=True)
        ]
        torch_calls = [
            functools.partial(reference, q, pools.kv, w, pools.extra, e, sinks, upcast=False)
            for q, (w, e) in zip(queries, rows, strict=True)
        ]
        kernel_us = time_us(kernel_calls, device, reps=reps)
        torch_us = time_us(torch_calls, device, reps=reps)
        moved, flops = counts(batch, heads, head_dim, window + extra)
        floor_us = max(moved / (bw * 1e3), flops / (rate * 1e6))
        return {
            "layer": label,
            "batch": batch,
            "context": context,
            "keys_per_request": window + extra,
            "kernel_us": kernel_us,
            "torch_us": torch_us,
            "speedup": torch_us / kernel_us,
            "bytes": moved,
            "flops": flops,
            "floor_us": floor_us,
            "roofline_frac": floor_us / kernel_us,
            "frac_copy_bw": moved / (kernel_us * 1e3) / bw,
            "check": checked,
        }

    table = [measure("csa", b, topk, None) for b in csa_batches]
    table += [measure("hca", b, ctx // 128, ctx) for ctx in contexts for b in hca_batches]

    # Launch configurations and split counts at the headline shape (B = 32 CSA; the largest
    # smoke batch on CPU), and split counts at batch 1, where split-K matters most.
    sweep_batch = 32 if not smoke else csa_batches[-1]
    split_counts = [1, 2, 3, 4, 5, 10] if not smoke else [1, 2]
    variants = [(name, config, None, sweep_batch) for name, config in configs.items()]
    variants += [
        (f"default_s{n}", kernels.DEFAULT_CONFIG if not smoke else configs["default"], n, b)
        for b in sorted({1, sweep_batch})
        for n in split_counts
    ]
    sweep_sets = {}
    sweep = []
    for name, config, splits, batch in variants:
        if batch not in sweep_sets:
            rows = _row_sets(batch, window, topk, pool_rows, extra_pool_rows, rotate, device, g, holes=False)
            sweep_sets[batch] = (rows, [q_of(batch) for _ in rows])
        rows, queries = sweep_sets[batch]
        planned = kernels.plan_splits(batch, window, topk, head_dim, device, config, splits)[0]
        entry: dict[str, Any] = {"config": name, "batch": batch, "splits": planned, **config.__dict__}
        try:
            entry["check"] = _check(
                kernels, reference, pools, queries[0], *rows[0], sinks, config=config, num_splits=splits
            )
            outs = [torch.empty_like(q) for q in queries]
            calls = [
                functools.partial(
                    kernels.hybrid_attention_decode,
                    q,
                    pools.kv,
                    w,
                    pools.extra,
                    e,
                    sinks,
                    out=o,
                    config=config,
                    num_splits=splits,
                )
                for q, (w, e), o in zip(queries, rows, outs, strict=True)
            ]
            entry["kernel_us"] = time_us(calls, device, reps=reps)
        except Exception as exc:  # a configuration that does not compile or fit is a result too
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        sweep.append(entry)

    # One prefill point: T tokens, each with its own window and top-k rows.
    tokens = 2048 if not smoke else 8
    q = q_of(tokens)
    win, ext = _row_sets(tokens, window, topk, pool_rows, extra_pool_rows, 1, device, g, holes=False)[0]
    prefill_out = torch.empty_like(q)
    prefill_us = time_us(
        [
            functools.partial(
                kernels.hybrid_attention_prefill, q, pools.kv, win, pools.extra, ext, sinks, out=prefill_out
            )
        ],
        device,
        reps=reps,
    )
    p_bytes, p_flops = counts(tokens, heads, head_dim, window + topk)
    prefill = {
        "tokens": tokens,
        "kernel_us": prefill_us,
        "tflops": p_flops / prefill_us / 1e6,
        "roofline_frac": max(p_bytes / (bw * 1e3), p_flops / (rate * 1e6)) / prefill_us,
    }

    headline = next(r for r in table if r["layer"] == "csa" and r["batch"] == sweep_batch)
    timed = [s for s in sweep if "kernel_us" in s and s["batch"] == sweep_batch]
    best = min(timed, key=lambda s: s["kernel_us"]) if timed else None
    b32_bytes, b32_flops = counts(32, 64, 512, 128 + 512)
    return {
        "benchmark": "kernel_attention",
        "smoke": smoke,
        "shape": {
            "heads": heads,
            "head_dim": head_dim,
            "window": window,
            "c4_topk": topk,
            "kv_dtype": "bfloat16",
        },
        "copy_gbps_measured": copy_gbps,
        "matmul_tflops_measured": matmul_tflops,
        "counting": {
            "bytes_per_call": "B*(W+K)*d*2 + 2*B*H*d*2 + B*(W+K)*4",
            "flops_per_call": "4*B*H*(W+K)*d",
            "B32_csa_bytes": b32_bytes,
            "B32_csa_flops": b32_flops,
        },
        "all_checks_ok": all(r["check"]["ok"] for r in table)
        and all(s["check"]["ok"] for s in sweep if "check" in s),
        "table": table,
        "config_sweep": sweep,
        "best_config": {k: best[k] for k in ("config", "splits", "kernel_us")} if best else None,
        "prefill": prefill,
        "decode_attention_roofline_B32": headline["roofline_frac"],
        "decode_attention_vs_torch_B32": headline["speedup"],
        "decode_attention_us_B32": headline["kernel_us"],
        "decode_attention_roofline_B32_best_config": (headline["floor_us"] / best["kernel_us"])
        if best
        else None,
    }


# The ratios this benchmark puts in its suite's `ratios` table.
HEADLINE = ("decode_attention_roofline_B32", "decode_attention_vs_torch_B32")
