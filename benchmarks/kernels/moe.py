"""MXFP4 grouped MoE kernels vs dequantise-then-matmul PyTorch, at V4-Flash expert shapes.

hidden 4096, 256 routed experts of intermediate 2048, top-6, swiglu limit 10; weights in the release
layout (packed e2m1 [E, out, in/2] with UE8M0 scales [E, out, in/32]), random codes and realistic
scales; bf16 activations.

* Correctness against `moe_mxfp4_reference` in float32 on the upcast activations (outputs and
  workspaces poisoned with NaN; fresh random inputs) for every launch shape that is timed.
* Decode (1-64 tokens): median time of the whole op, captured in a CUDA graph over calls that rotate
  through 4 routings (at batch 1: 4 disjoint sets of 6 experts, 320 MB, so weights do not come from
  L2). Byte floor: the packed weights + scales of the experts hit, read once.
  `moe_mxfp4_weight_bw_B1` = those bytes at batch 1 / time / the copy bandwidth measured in the run.
* Prefill (1K-16K tokens, 24-384 tokens per expert): time against the FLOP floor (the bf16 matmul
  rate measured in the same run).
* Baseline: the reference in bf16 (dequantise the experts hit, then per-expert F.linear), eager,
  since it synchronises with the host to loop over experts.

    python -m benchmarks run kernels --only moe [--smoke] [--set sweep_only=true --set sweep_batches=32,64]

`sweep_only`: the decode tile sweep alone (every launch shape checked, then timed) at `sweep_batches`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch

from ..lib.checks import BF16_TOL, poisoned, rel_err
from ..lib.context import Context
from ..lib.timing import geomean, time_us

# ----- MoE -----


def expert_weights(
    experts: int, hidden: int, inter: int, device: str, g: torch.Generator
) -> dict[str, torch.Tensor]:
    """Random packed codes; exponents 2^-11 .. 2^-4, so weights lie in about +-0.1 like trained ones."""

    def packed(rows: int, cols: int) -> torch.Tensor:
        shape = (experts, rows, cols // 2)
        return torch.randint(0, 256, shape, device=device, generator=g, dtype=torch.uint8)

    def scales(rows: int, cols: int) -> torch.Tensor:
        shape = (experts, rows, cols // 32)
        exps = torch.randint(116, 124, shape, device=device, generator=g, dtype=torch.uint8)
        return exps.view(torch.float8_e8m0fnu)

    return {
        "w1": packed(inter, hidden),
        "w1_scale": scales(inter, hidden),
        "w3": packed(inter, hidden),
        "w3_scale": scales(inter, hidden),
        "w2": packed(hidden, inter),
        "w2_scale": scales(hidden, inter),
    }


def make_routing(
    tokens: int, top_k: int, experts: int, device: str, g: torch.Generator, chosen: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Routing weights (normalised, x1.5 as the model scales them) and expert ids; `chosen` fixes the ids."""
    if chosen is None:
        chosen = torch.rand(tokens, experts, device=device, generator=g).topk(top_k).indices
    weights = torch.rand(tokens, top_k, device=device, generator=g) + 0.1
    return {"topk_weights": 1.5 * weights / weights.sum(-1, keepdim=True), "topk_ids": chosen}


def moe_call(fn: Callable, x: torch.Tensor, route: dict, w: dict, limit: float,
             **kwargs: Any) -> torch.Tensor:
    return fn(
        x,
        route["topk_weights"],
        route["topk_ids"],
        w["w1"],
        w["w1_scale"],
        w["w3"],
        w["w3_scale"],
        w["w2"],
        w["w2_scale"],
        limit,
        **kwargs,
    )


def run(ctx: Context) -> dict[str, Any]:
    """Correctness at real shapes, then decode / prefill timings. Returns a JSON-able dict."""
    device, smoke = ctx.device, ctx.smoke
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
    from antumbra.kernels.moe_mxfp4 import (
        DECODE_TILES,
        PAIR_TILES,
        SMALL_BATCH_TILES,
        MoeTiles,
        moe_mxfp4,
        moe_mxfp4_reference,
    )
    from antumbra.kernels.moe_mxfp4 import triton as moe_triton

    g = torch.Generator(device=device).manual_seed(0)
    limit = 10.0
    if smoke:
        experts, hidden, inter, top_k = 8, 64, 64, 2
        decode_batches, prefill_tokens, rotate, reps = [1, 3], [24], 2, 1
        b1_variants = [DECODE_TILES, MoeTiles(block_t=16, block_n=64, block_kb=32, use_dot=True)]
    else:
        experts, hidden, inter, top_k = 256, 4096, 2048, 6
        decode_batches, prefill_tokens, rotate, reps = [1, 2, 4, 8, 16, 32, 64], [1024, 4096, 16384], 4, 20
        # the default (pre-packed f16x2 operands); its operands gathered in the kernel instead; wider
        # rows, narrower steps, a deeper pipeline; the same with float32 products, with the token's
        # experts summed in the down kernel, and without any PTX; a neighbour in rows / bytes per
        # step; the previous default; token tiles
        b1_variants = [
            DECODE_TILES,
            dataclasses.replace(DECODE_TILES, prepacked=False),
            dataclasses.replace(DECODE_TILES, block_n=32),
            dataclasses.replace(DECODE_TILES, block_kb=256),
            dataclasses.replace(DECODE_TILES, num_stages=3),
            dataclasses.replace(DECODE_TILES, packed_math=False),
            dataclasses.replace(DECODE_TILES, sum_slots=True, down_block_n=16),
            dataclasses.replace(DECODE_TILES, asm_decode=False),
            MoeTiles(block_t=1, block_n=32, block_kb=512, use_dot=False, num_stages=2),
            MoeTiles(
                block_t=1,
                block_n=32,
                block_kb=128,
                use_dot=False,
                packed_math=False,
                sum_slots=False,
                num_stages=1,
            ),
            SMALL_BATCH_TILES,
        ]
    copy_gbps = ctx.rates.copy_gbps
    matmul_tflops = ctx.rates.matmul_tflops
    w = expert_weights(experts, hidden, inter, device, g)
    expert_bytes = 3 * (inter * hidden // 2 + inter * hidden // 32)
    checks: list[dict[str, Any]] = []

    def check(tokens: int, x: torch.Tensor, route: dict, tiles: MoeTiles | None) -> None:
        with poisoned(moe_triton):
            out = moe_call(moe_mxfp4, x, route, w, limit, tiles=tiles)
        ref = moe_call(moe_mxfp4_reference, x.float(), route, w, limit)
        err = rel_err(out, ref)
        ok = bool(out.isfinite().all()) and err < BF16_TOL
        checks.append({"tokens": tokens, "tiles": str(tiles or "auto"), "rel_err": err, "ok": ok})

    def timed(tokens: int, tiles: MoeTiles | None, disjoint: bool) -> dict[str, Any]:
        """Check, then time the op over `rotate` input sets (distinct experts at batch 1); returns the row."""
        perm = torch.randperm(experts, device=device, generator=g)
        sets = []
        for r in range(rotate):
            chosen = perm[r * top_k : (r + 1) * top_k].view(1, top_k) if disjoint else None
            x = torch.randn(tokens, hidden, device=device, generator=g).to(torch.bfloat16)
            sets.append((x, make_routing(tokens, top_k, experts, device, g, chosen)))
        check(tokens, *sets[0], tiles)
        decode = tokens <= max(decode_batches)
        calls = [functools.partial(moe_call, moe_mxfp4, x, route, w, limit, tiles=tiles) for x, route in sets]
        kernel_us = time_us(calls, device, reps=reps if decode else max(reps // 4, 1), graph=decode)
        hit = statistics.mean(route["topk_ids"].unique().numel() for _, route in sets)
        nbytes = hit * expert_bytes
        flops = 2 * tokens * top_k * 3 * hidden * inter
        row = {
            "tokens": tokens,
            "tiles": str(tiles or "auto"),
            "kernel_us": kernel_us,
            "experts_hit": hit,
            "weight_bytes": nbytes,
            "weight_floor_us": nbytes / (copy_gbps * 1e3),
            "frac_copy_bw": nbytes / (kernel_us * 1e3) / copy_gbps,
            "tflops": flops / kernel_us / 1e6,
        }
        if matmul_tflops:
            row["frac_matmul_rate"] = row["tflops"] / matmul_tflops
        return row

    def with_baseline(row: dict[str, Any], tokens: int) -> dict[str, Any]:
        x = torch.randn(tokens, hidden, device=device, generator=g).to(torch.bfloat16)
        route = make_routing(tokens, top_k, experts, device, g)
        baseline = [functools.partial(moe_call, moe_mxfp4_reference, x, route, w, limit)]
        row["torch_us"] = time_us(baseline, device, reps=max(reps // 4, 1), graph=False)
        row["speedup"] = row["torch_us"] / row["kernel_us"]
        return row

    def grouped(tokens: int, num_experts: int) -> dict[str, Any]:
        """The prefill path (`moe_mxfp4_grouped`: decode once, grouped GEMMs) against the fused kernel
        on the first `num_experts` experts (the engine's slice has 16), checked against the reference."""
        from antumbra.kernels.moe_mxfp4.grouped import moe_mxfp4_grouped

        ws = {name: t[:num_experts].contiguous() for name, t in w.items()}
        x = torch.randn(tokens, hidden, device=device, generator=g).to(torch.bfloat16)
        route = make_routing(tokens, top_k, num_experts, device, g)
        out = moe_call(moe_mxfp4_grouped, x, route, ws, limit)
        err = rel_err(out, moe_call(moe_mxfp4_reference, x.float(), route, ws, limit))
        ok = bool(out.isfinite().all()) and err < BF16_TOL
        checks.append({"tokens": tokens, "tiles": f"grouped E={num_experts}", "rel_err": err, "ok": ok})
        fused_us, grouped_us = (
            time_us([functools.partial(moe_call, fn, x, route, ws, limit)], device, reps=4, graph=False)
            for fn in (moe_mxfp4, moe_mxfp4_grouped)
        )
        flops = 2 * tokens * top_k * 3 * hidden * inter
        return {"tokens": tokens, "experts": num_experts, "fused_us": fused_us, "grouped_us": grouped_us,
                "grouped_vs_fused": fused_us / grouped_us, "grouped_tflops": flops / grouped_us / 1e6}

    def same_bits(tokens: int, first: MoeTiles, second: MoeTiles, what: str, act_fp8: bool = False) -> None:
        """Two launch shapes that make the same products, so the same bits: pre-packed operands against
        the gathering path at batch 1, pairs two to a program against a pair per program (the GPU-only
        tests `test_prepacked_operands_on_a_gpu_give_the_same_bits` and
        `test_pair_tiles_on_a_gpu_give_the_decode_tiles_bits` check the same)."""
        x = torch.randn(tokens, hidden, device=device, generator=g).to(torch.bfloat16)
        route = make_routing(tokens, top_k, experts, device, g)
        outs = [moe_call(moe_mxfp4, x, route, w, limit, tiles=t, act_fp8=act_fp8) for t in (first, second)]
        checks.append({"tokens": tokens, "tiles": what,
                       "ok": bool(outs[0].isfinite().all()) and torch.equal(outs[0], outs[1])})

    def prepacked_bits(act_fp8: bool) -> None:
        same_bits(1, DECODE_TILES, dataclasses.replace(DECODE_TILES, prepacked=False),
                  f"prepacked vs gathered, act_fp8={act_fp8}", act_fp8)

    def pair_tiles_bits(tokens: int) -> None:
        same_bits(tokens, DECODE_TILES, PAIR_TILES, "pair tiles vs decode tiles, bitwise")

    # Which tiles small batches want: per-pair GEMV tiles, sorted pairs two to a program (f16x2 products
    # of both rows from each decoded word) and neighbours of them, sorted rows sharing each decoded
    # weight tile in float32 on the CUDA cores, 16-token dot tiles.
    row_shapes = ((2, 16, 32), (4, 16, 32)) if smoke else ((4, 16, 128),)
    sweep_tiles = [DECODE_TILES, dataclasses.replace(DECODE_TILES, prepacked=False), SMALL_BATCH_TILES,
                   PAIR_TILES, dataclasses.replace(PAIR_TILES, block_kb=256),
                   dataclasses.replace(PAIR_TILES, block_n=32), dataclasses.replace(PAIR_TILES, num_stages=3),
                   ] + [MoeTiles(block_t=t, block_n=bn, block_kb=kb, use_dot=False, num_warps=4, num_stages=2)
                        for t, bn, kb in row_shapes]
    if ctx.option("sweep_only", False):  # the batch sweep alone, at these batches
        sweep_batches = ctx.option("sweep_batches", [32, 64] if not smoke else [3])
        if device != "cpu":  # the pair tiles' products are PTX
            pair_tiles_bits(max(sweep_batches))
        rows = [timed(b, tiles, disjoint=False) for b in sweep_batches for tiles in sweep_tiles]
        return {"benchmark": "kernel_moe", "smoke": smoke, "copy_gbps_measured": copy_gbps,
                "all_checks_ok": all(c["ok"] for c in checks), "checks": checks, "batch_tile_sweep": rows,
                "best_per_batch": {b: min((r for r in rows if r["tokens"] == b), key=lambda r: r["kernel_us"])
                                   for b in sweep_batches}}
    for act_fp8 in (False, True):
        prepacked_bits(act_fp8)
    if device != "cpu":
        pair_tiles_bits(64)
    grouped_rows = [grouped(tokens, min(16, experts)) for tokens in prefill_tokens]
    b1_sweep = [timed(1, tiles, disjoint=True) for tiles in b1_variants]
    decode = [with_baseline(timed(b, None, disjoint=b == 1), b) for b in decode_batches]
    batch_sweep = [timed(b, tiles, disjoint=False) for b in decode_batches if 4 < b <= 64
                   for tiles in sweep_tiles]
    b8 = next((r for r in decode if r["tokens"] == 8), None)
    prefill = [with_baseline(timed(tokens, None, disjoint=False), tokens) for tokens in prefill_tokens]
    best_b1 = max(b1_sweep, key=lambda r: r["frac_copy_bw"])
    return {
        "benchmark": "kernel_moe",
        "smoke": smoke,
        "shape": {"experts": experts, "hidden": hidden, "intermediate": inter, "top_k": top_k},
        "activation_dtype": "bfloat16",
        "copy_gbps_measured": copy_gbps,
        "matmul_tflops_measured": matmul_tflops,
        "all_checks_ok": all(c["ok"] for c in checks),
        "checks": checks,
        "moe_mxfp4_weight_bw_B1": decode[0]["frac_copy_bw"],
        **({"moe_mxfp4_weight_bw_B8": b8["frac_copy_bw"]} if b8 else {}),
        "batch_tile_sweep": batch_sweep,
        "moe_mxfp4_weight_bw_B1_best_tiles": best_b1["frac_copy_bw"],
        "best_b1_tiles": best_b1["tiles"],
        "moe_vs_torch_decode": geomean([r["speedup"] for r in decode]),
        "moe_vs_torch_prefill": geomean([r["speedup"] for r in prefill]),
        "moe_grouped_vs_fused_prefill": geomean([r["grouped_vs_fused"] for r in grouped_rows]),
        "grouped_prefill": grouped_rows,
        "b1_tile_sweep": b1_sweep,
        "decode": decode,
        "prefill": prefill,
    }


# The ratios this benchmark puts in its suite's `ratios` table.
HEADLINE = ("moe_mxfp4_weight_bw_B1", "moe_mxfp4_weight_bw_B8")
