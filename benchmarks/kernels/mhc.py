"""mHC pre / post kernels vs the PyTorch chain they replace, at V4-Flash shapes.

hidden 4096, hc_mult 4 (streams [T, 4, 4096] bf16), mixing weight fp32 [24, 16384], 20 Sinkhorn
iterations. T from decode (1-16 tokens) to prefill-sized batches.

For every T: correctness against `mhc_pre_reference` / `mhc_post_reference` in float32 on the upcast
streams (outputs and workspaces poisoned with NaN; fresh random inputs), then median times of the
kernels and of the reference chain, both captured in a CUDA graph over calls that rotate through 16
distinct input sets (so the 1.57 MB mixing weight is not served from L2, as in the real model where
each of the 86 sub-layers has its own). Byte floor: streams, weight and outputs, each moved once.

    python -m benchmarks run kernels --only mhc [--smoke]
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from ..lib.checks import BF16_TOL, poisoned, rel_err
from ..lib.context import Context
from ..lib.timing import geomean, time_us

FP32_TOL = 1e-4  # float32 outputs: rounding of a float32 chain, far under any bf16 difference


# ----- mHC -----
def _inputs(tokens: int, n: int, d: int, device: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    nmix = (2 + n) * n
    return {
        "streams": torch.randn(tokens, n, d, device=device, generator=g).to(torch.bfloat16),
        "fn": torch.randn(nmix, n * d, device=device, generator=g) * (n * d) ** -0.5,
        "base": torch.randn(nmix, device=device, generator=g),
        "scale": torch.rand(3, device=device, generator=g) + 0.5,
        "block_out": torch.randn(tokens, d, device=device, generator=g).to(torch.bfloat16),
    }


def _pre_calls(fn: Callable, sets: list[dict], pre_args: tuple) -> list[Callable[[], object]]:
    return [functools.partial(fn, s["streams"], s["fn"], s["base"], s["scale"], *pre_args) for s in sets]


def _post_calls(fn: Callable, sets: list[dict], mixes: list[tuple]) -> list[Callable[[], object]]:
    pairs = zip(sets, mixes, strict=True)
    return [functools.partial(fn, s["streams"], s["block_out"], m[1], m[2]) for s, m in pairs]


def run(ctx: Context) -> dict[str, Any]:
    """Correctness at real shapes, then kernel vs PyTorch timings. Returns a JSON-able dict."""
    device, smoke = ctx.device, ctx.smoke
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
    from antumbra.kernels.mhc import mhc_post, mhc_post_reference, mhc_pre, mhc_pre_reference
    from antumbra.kernels.mhc import triton as mhc_triton

    g = torch.Generator(device=device).manual_seed(0)
    iters, hc_eps, norm_eps = 20, 1e-6, 1e-6
    if smoke:
        n, d, token_counts, rotate, reps = 4, 64, [1, 5], 2, 1
    else:
        n, d, token_counts, rotate, reps = 4, 4096, [1, 2, 4, 8, 16, 64, 256, 1024], 16, 20
    copy_gbps = ctx.rates.copy_gbps
    checks, table = [], []
    for tokens in token_counts:
        sets = [_inputs(tokens, n, d, device, g) for _ in range(rotate)]
        x = sets[0]
        pre_args = (iters, hc_eps, norm_eps)
        with poisoned(mhc_triton):
            collapsed, post, comb = mhc_pre(x["streams"], x["fn"], x["base"], x["scale"], *pre_args)
            new_streams = mhc_post(x["streams"], x["block_out"], post, comb)
        upcast = x["streams"].float()
        ref_c, ref_p, ref_m = mhc_pre_reference(upcast, x["fn"], x["base"], x["scale"], *pre_args)
        ref_s = mhc_post_reference(upcast, x["block_out"].float(), ref_p, ref_m)
        errs = {
            "collapsed": rel_err(collapsed, ref_c),
            "post": rel_err(post, ref_p),
            "comb": rel_err(comb, ref_m),
            "streams_out": rel_err(new_streams, ref_s),
        }
        finite = all(bool(t.isfinite().all()) for t in (collapsed, post, comb, new_streams))
        ok = (
            finite
            and errs["post"] < FP32_TOL
            and errs["comb"] < FP32_TOL
            and errs["collapsed"] < BF16_TOL
            and errs["streams_out"] < BF16_TOL
        )
        checks.append({"tokens": tokens, **{f"rel_err_{k}": v for k, v in errs.items()}, "ok": ok})

        # post reads pre's outputs of the same set, computed beforehand: each op is timed on its own
        mixes = [mhc_pre_reference(s["streams"], s["fn"], s["base"], s["scale"], *pre_args) for s in sets]
        pre_us = time_us(_pre_calls(mhc_pre, sets, pre_args), device, reps=reps)
        tf32x3_us = None
        if tokens >= 64 and device != "cpu":
            # The GEMM turns FMA-bound at large T in exact fp32; 3xTF32 on the tensor cores keeps ~fp32
            # accuracy. Checked and timed as an option, not the default.
            pre_tc = functools.partial(mhc_pre, precision="tf32x3")
            _, post_tc, comb_tc = pre_tc(x["streams"], x["fn"], x["base"], x["scale"], *pre_args)
            tc_err = max(rel_err(post_tc, ref_p), rel_err(comb_tc, ref_m))
            checks.append(
                {
                    "tokens": tokens,
                    "precision": "tf32x3",
                    "rel_err_post_comb": tc_err,
                    "ok": tc_err < FP32_TOL,
                }
            )
            tf32x3_us = time_us(_pre_calls(pre_tc, sets, pre_args), device, reps=reps)
        torch_pre_us = time_us(_pre_calls(mhc_pre_reference, sets, pre_args), device, reps=reps)
        post_us = time_us(_post_calls(mhc_post, sets, mixes), device, reps=reps)
        torch_post_us = time_us(_post_calls(mhc_post_reference, sets, mixes), device, reps=reps)
        stream_bytes = tokens * n * d * 2
        pre_bytes = stream_bytes + x["fn"].numel() * 4 + tokens * d * 2 + tokens * (n + n * n) * 4
        post_bytes = 2 * stream_bytes + tokens * d * 2 + tokens * (n + n * n) * 4
        table.append(
            {
                "tokens": tokens,
                "pre_us": pre_us,
                "pre_tf32x3_us": tf32x3_us,
                "torch_pre_us": torch_pre_us,
                "post_us": post_us,
                "torch_post_us": torch_post_us,
                "speedup": (torch_pre_us + torch_post_us) / (pre_us + post_us),
                "pre_floor_us": pre_bytes / (copy_gbps * 1e3),
                "post_floor_us": post_bytes / (copy_gbps * 1e3),
                "pre_frac_copy_bw": pre_bytes / (pre_us * 1e3) / copy_gbps,
                "post_frac_copy_bw": post_bytes / (post_us * 1e3) / copy_gbps,
            }
        )
    sweep = _prefill_sweep(device, smoke, n, d, pre_args, g, checks, copy_gbps)
    decode = _decode_sweep(device, smoke, n, d, pre_args, g, checks)
    speedups = [row["speedup"] for row in table]
    return {
        "benchmark": "kernel_mhc",
        "smoke": smoke,
        "shape": {"hidden": d, "hc_mult": n, "sinkhorn_iters": iters, "streams_dtype": "bfloat16"},
        "copy_gbps_measured": copy_gbps,
        "all_checks_ok": all(c["ok"] for c in checks),
        "checks": checks,
        "table": table,
        "mhc_vs_torch": geomean(speedups),
        "mhc_vs_torch_min": min(speedups),
        "mhc_pre_plus_post_us_by_tokens": {row["tokens"]: row["pre_us"] + row["post_us"] for row in table},
        "prefill_pre_sweep": sweep,
        "mhc_pre_prefill_best_vs_default": sweep[0]["us"] / min(r["us"] for r in sweep),
        "decode_pre_sweep": decode,
    }


def _decode_sweep(device: str, smoke: bool, n: int, d: int, pre_args: tuple, g: torch.Generator,
                  checks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`mhc_pre` at decode sizes (1, 8, 32 tokens) with the finish's warps and the mixing GEMM's K
    slices varied (None: the planned ones), each checked against the reference, then timed in a CUDA
    graph over 16 input sets (the decode graph's setting, where each launch is latency-bound)."""
    import itertools

    from antumbra.kernels.mhc import mhc_pre, mhc_pre_reference
    from antumbra.kernels.mhc import triton as mhc_triton
    from antumbra.kernels.mhc.triton import PreTiles

    rows = []
    for tokens in [1, 3] if smoke else [1, 8, 32]:
        sets = [_inputs(tokens, n, d, device, g) for _ in range(2 if smoke else 16)]
        x = sets[0]
        _, ref_p, ref_m = mhc_pre_reference(x["streams"].float(), x["fn"], x["base"], x["scale"], *pre_args)
        for warps, split_k in itertools.product((None, 1, 2, 4), (None, 128, 64, 32, 16)):
            run_pre = functools.partial(mhc_pre, tiles=PreTiles(finish_warps=warps), split_k=split_k)
            with poisoned(mhc_triton):
                _, post, comb = run_pre(x["streams"], x["fn"], x["base"], x["scale"], *pre_args)
            err = max(rel_err(post, ref_p), rel_err(comb, ref_m))
            checks.append({"tokens": tokens, "finish_warps": warps, "split_k": split_k,
                           "rel_err_post_comb": err, "ok": err < FP32_TOL})
            us = time_us(_pre_calls(run_pre, sets, pre_args), device, reps=1 if smoke else 20)
            rows.append({"tokens": tokens, "finish_warps": warps, "split_k": split_k, "us": us})
    return rows


def _pre_tiles_sweep() -> list[Any]:
    """`mhc_pre` launch shapes timed at a prefill step: the default first, then token tiles, warps
    of the mixing GEMM and of the finish (whose Sinkhorn reductions cross warps)."""
    import itertools

    from antumbra.kernels.mhc.triton import DEFAULT_PRE_TILES, PreTiles, finish_warps

    rest = [PreTiles(mix_block_t=bt, mix_warps=mw, finish_warps=fw)
            for bt, mw, fw in itertools.product((64, 128), (4, 8), (1, 2, 4))]
    default_at_8192 = PreTiles(mix_block_t=64, finish_warps=finish_warps(8192))  # what the default plans
    return [DEFAULT_PRE_TILES] + [t for t in rest if t != default_at_8192]


def _prefill_sweep(device: str, smoke: bool, n: int, d: int, pre_args: tuple, g: torch.Generator,
                   checks: list[dict[str, Any]], copy_gbps: float) -> list[dict[str, Any]]:
    """Each `_pre_tiles_sweep` shape at one prefill step (8192 tokens; 5 in the smoke run): checked
    against the reference like the default, then timed (eager: a step's streams are 268 MB, so L2
    holds none of them), with its fraction of the copy bandwidth."""
    import dataclasses

    from antumbra.kernels.mhc import mhc_pre, mhc_pre_reference
    from antumbra.kernels.mhc import triton as mhc_triton

    tokens = 5 if smoke else 8192
    sets = [_inputs(tokens, n, d, device, g) for _ in range(2)]
    x = sets[0]
    _, ref_p, ref_m = mhc_pre_reference(x["streams"].float(), x["fn"], x["base"], x["scale"], *pre_args)
    rows = []
    for tiles in _pre_tiles_sweep():
        run_pre = functools.partial(mhc_pre, tiles=tiles)
        with poisoned(mhc_triton):
            _, post, comb = run_pre(x["streams"], x["fn"], x["base"], x["scale"], *pre_args)
        err = max(rel_err(post, ref_p), rel_err(comb, ref_m))
        checks.append({"tokens": tokens, "tiles": str(tiles), "rel_err_post_comb": err, "ok": err < FP32_TOL})
        us = time_us(_pre_calls(run_pre, sets, pre_args), device, reps=1 if smoke else 10, graph=False)
        nbytes = tokens * n * d * 2 + x["fn"].numel() * 4 + tokens * d * 2
        rows.append({"tiles": dataclasses.asdict(tiles), "us": us,
                     "frac_copy_bw": nbytes / (us * 1e3) / copy_gbps})
    return rows


# The ratios this benchmark puts in its suite's `ratios` table.
HEADLINE = ("mhc_vs_torch",)
