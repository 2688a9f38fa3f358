"""Does the FP8 linear give the same answer every time? Repeated calls on one input, per launch shape.

The fresh-prefill check (`fresh_prefill_gpu.py`, 2026-12-02) found prefills of one prompt on one
engine differing first at an FP8 linear (q_b / o_b / the shared experts' up), in one whole
128-token tile of its output, with its input the same: a launch that is sometimes wrong. This
script calls `fp8_linear` `--reps` times on one input for each launch shape at the V4-Flash
projection widths and prefill token counts, and counts the calls whose output is not bitwise the
first call's or is off the float32 reference. The dequantise-then-cuBLAS chain runs beside them,
timed the same way (`gpu_measure.time_us`: median of `--time-reps` eager calls, CUDA events).

Results: benchmarks/results/<date>-h200-fp8-linear-stress.json.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from antumbra.kernels.common.device import multiprocessor_count
from antumbra.kernels.fp8_linear import triton as fp8
from antumbra.kernels.fp8_linear.reference import dequant_fp8_weight, fp8_linear_reference
from antumbra.replicas.model.quant import quant_fp8_block

from .common import environment, write_result
from .gpu_measure import rel_err, time_us

SHAPES = {"q_b": (1024, 32768), "o_b": (8192, 4096), "shared_up": (4096, 2048), "q_a": (4096, 1024)}
TOKENS = (384, 130, 2048)
DECODE_TOKENS = (2, 16, 48, 64)  # the launch shapes decode batches take: only the picked one runs
BAD_REL = 1e-2  # bf16 output against the float32 reference: a right call is ~3e-3 at most


def variants(tokens: int, n: int, k: int, candidates: bool) -> dict[str, fp8.Fp8LinearConfig | None]:
    """The launch shape `fp8_linear` picks for `tokens`, and with `candidates` the alternatives
    measured when the three-stage 128-token tile was found wrong."""
    picked = {"picked": fp8.plan(tokens, n, k, multiprocessor_count(torch.device("cuda")))[0]}
    if not candidates or tokens < 128:
        return picked
    mid, wide = fp8.MID_CONFIG, fp8.PREFILL_CONFIG
    return {**picked,
        "mid_stages3": dataclasses.replace(mid, num_stages=3),
        "mid_stages2": dataclasses.replace(mid, num_stages=2),
        "mid_stages1": dataclasses.replace(mid, num_stages=1),
        "mid_scale_product": dataclasses.replace(mid, scale_weights=False),
        "mid_warps4": dataclasses.replace(mid, num_warps=4),
        "wide": wide,
        "wide_stages2": dataclasses.replace(wide, num_stages=2),
        "dequant_cublas": None,
    }


def stress(k: int, n: int, tokens: int, config: fp8.Fp8LinearConfig | None, reps: int,
           time_reps: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(k * 7 + n + tokens)
    w_bf16 = torch.randn(n, k, device="cuda", generator=g, dtype=torch.float32) * 0.02
    weight, scale = quant_fp8_block(w_bf16)
    x = torch.randn(tokens, k, device="cuda", generator=g, dtype=torch.float32).to(torch.bfloat16)
    ref = fp8_linear_reference(x.float(), weight, scale)
    if config is None:
        def call() -> torch.Tensor:
            return F.linear(x, dequant_fp8_weight(weight, scale, torch.bfloat16))
    else:
        def call() -> torch.Tensor:
            return fp8.fp8_linear(x, weight, scale, config=config)
    first = call()
    mismatched = bad = 0
    worst = rel_err(first, ref)
    bad_tiles: list[int] = []
    for _ in range(reps):
        y = call()
        if not torch.equal(y, first):
            mismatched += 1
        rel = rel_err(y, ref)
        worst = max(worst, rel)
        if rel > BAD_REL:
            bad += 1
            rows = ((y.float() - ref.float()).abs().amax(1) > 0.1 * ref.abs().max()).nonzero().flatten()
            bad_tiles.extend(sorted({int(r) // 128 for r in rows.tolist()})[:4])
    ms = time_us([call], "cuda", reps=time_reps, graph=False) / 1e3
    return {"calls": reps + 1, "not_bitwise_first": mismatched, "bad": bad, "worst_rel": worst,
            "first_rel": rel_err(first, ref), "bad_token_tiles": bad_tiles[:16], "median_ms": ms,
            "tflops": 2 * tokens * n * k / (ms * 1e-3) / 1e12}


def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {**environment(), "reps": args.reps, "bad_rel": BAD_REL, "rows": {}}
    for shape_name, (k, n) in SHAPES.items():
        for tokens in TOKENS + DECODE_TOKENS:
            for label, config in variants(tokens, n, k, args.candidates).items():
                key = f"{shape_name}_T{tokens}_{label}"
                try:
                    row = stress(k, n, tokens, config, args.reps, args.time_reps)
                except Exception as exc:  # one failing launch shape must not hide the others
                    row = {"error": repr(exc)[:400]}
                result["rows"][key] = row
                print(key, {k2: row.get(k2) for k2 in ("not_bitwise_first", "bad", "worst_rel", "median_ms",
                                                       "error")}, flush=True)
        write_result("h200-fp8-linear-stress", result)
    rows = result["rows"].items()
    result["racy"] = sorted(k for k, r in rows if r.get("bad") or r.get("not_bitwise_first"))
    write_result("h200-fp8-linear-stress", result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--time-reps", type=int, default=15)
    parser.add_argument("--candidates", action="store_true", help="also the alternative tiles at T >= 128")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
