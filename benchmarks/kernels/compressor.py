"""Fused compressor kernel vs the unfused PyTorch chain, at V4-Flash shapes.

head_dim 512, rope 64; C4 (m = 4, overlap: 8 slots over [2d]-wide state rows) and C128 (m = 128).
Decode-sized batches close a few windows per step; prefill-sized ones close T / m windows.

For every shape: a correctness check against `compress_reference` in float32 (output pool poisoned
with NaN; fresh random state), then the median time of the fused kernel and of the reference chain,
both captured in a CUDA graph over calls that rotate through distinct event sets (distinct state rows),
so repeated calls do not read the same rows out of L2. Byte floor: each window's state slots (kv and
gate, float32) read once plus the entry written, over the copy bandwidth measured in the same run.

    python -m benchmarks run kernels --only compressor [--smoke]
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import Any

import torch

from ..lib.checks import BF16_TOL, poisoned, rel_err
from ..lib.context import Context
from ..lib.timing import geomean, time_us


# ----- compressor -----
def _state(
    rate: int, overlap: int, d: int, rows: int, device: str, g: torch.Generator
) -> dict[str, torch.Tensor]:
    width = overlap * d
    return {
        "state_kv": torch.randn(rows, width, device=device, generator=g),
        "state_gate": 2 * torch.randn(rows, width, device=device, generator=g),
        "position_bias": torch.randn(rate, width, device=device, generator=g),
        "norm_weight": torch.rand(d, device=device, generator=g) + 0.5,
    }


def _events(
    num_events: int,
    rate: int,
    overlap: int,
    rows: int,
    pool_rows: int,
    half: int,
    device: str,
    g: torch.Generator,
) -> dict[str, torch.Tensor | None]:
    angles = 2 * math.pi * torch.rand(num_events, half, device=device, generator=g)
    ev: dict[str, torch.Tensor | None] = {
        "src_rows": torch.randint(0, rows, (num_events, rate), device=device, generator=g),
        "prev_rows": None,
        "has_prev": None,
        "cos": angles.cos(),
        "sin": angles.sin(),
        "out_rows": torch.randperm(pool_rows, device=device, generator=g)[:num_events],
    }
    if overlap == 2:
        ev["prev_rows"] = torch.randint(0, rows, (num_events, rate), device=device, generator=g)
        has_prev = torch.rand(num_events, device=device, generator=g) > 0.05
        has_prev[0] = False
        ev["has_prev"] = has_prev
    return ev


def _call(fn: Callable[..., torch.Tensor], st: dict, ev: dict, out: torch.Tensor, eps: float) -> torch.Tensor:
    return fn(
        st["state_kv"],
        st["state_gate"],
        ev["src_rows"],
        ev["prev_rows"],
        ev["has_prev"],
        st["position_bias"],
        st["norm_weight"],
        eps,
        ev["cos"],
        ev["sin"],
        out,
        ev["out_rows"],
    )


def run(ctx: Context) -> dict[str, Any]:
    """Correctness at real shapes, then fused vs unfused timings. Returns a JSON-able dict."""
    device, smoke = ctx.device, ctx.smoke
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
    from antumbra.kernels.compressor import compress_reference, compress_windows
    from antumbra.kernels.compressor import triton as compressor_triton

    g = torch.Generator(device=device).manual_seed(0)
    eps = 1e-6
    if smoke:
        d, rope, rows = 64, 16, 1024
        cases = [("c4", 4, 2, [1, 3], []), ("c128", 16, 1, [1], [4])]
        rotate, reps = 2, 1
    else:
        d, rope, rows = 512, 64, 2**18
        # (name, rate, overlap, decode event counts, prefill event counts: 4K and 64K tokens)
        cases = [("c4", 4, 2, [1, 16, 64], [1024, 16384]), ("c128", 128, 1, [1, 4], [32, 512])]
        rotate, reps = 16, 20
    copy_gbps = ctx.rates.copy_gbps
    checks, table = [], []
    for name, rate, overlap, decode_sizes, prefill_sizes in cases:
        st = _state(rate, overlap, d, rows, device, g)
        for num_events in decode_sizes + prefill_sizes:
            phase = "decode" if num_events in decode_sizes else "prefill"
            pool_rows = max(2 * num_events, 64)
            sets = [
                _events(num_events, rate, overlap, rows, pool_rows, rope // 2, device, g)
                for _ in range(rotate if phase == "decode" else 2)
            ]
            # correctness: poisoned bf16 pool (and workspaces) vs a float32 reference pool; at decode
            # sizes both the channel-split path (the default there) and one program per event
            ref = _call(compress_reference, st, sets[0], torch.zeros(pool_rows, d, device=device), eps)
            rows_out = sets[0]["out_rows"]
            untouched = torch.ones(pool_rows, dtype=torch.bool, device=device)
            untouched[rows_out] = False
            for split in (None, 1) if phase == "decode" else (None,):
                out = torch.full((pool_rows, d), float("nan"), dtype=torch.bfloat16, device=device)
                with poisoned(compressor_triton):
                    _call(functools.partial(compress_windows, split=split), st, sets[0], out, eps)
                err = rel_err(out[rows_out], ref[rows_out])
                written = bool(out[rows_out].isfinite().all()) and bool(out[untouched].isnan().all())
                ok = written and err < BF16_TOL
                checks.append({"case": name, "events": num_events, "split": split, "rel_err": err, "ok": ok})

            fused = [functools.partial(_call, compress_windows, st, ev, out, eps) for ev in sets]
            unfused = [functools.partial(_call, compress_reference, st, ev, out, eps) for ev in sets]
            fused_us = time_us(fused, device, reps=reps)
            torch_us = time_us(unfused, device, reps=reps)
            slots = overlap * rate  # overlap: m slots of each half
            nbytes = num_events * (slots * d * 2 * 4 + d * 2 + rate * 2 * 8 + 2 * (rope // 2) * 4)
            table.append(
                {
                    "case": name,
                    "phase": phase,
                    "events": num_events,
                    "fused_us": fused_us,
                    "torch_us": torch_us,
                    "speedup": torch_us / fused_us,
                    "bytes": nbytes,
                    "floor_us": nbytes / (copy_gbps * 1e3),
                    "frac_copy_bw": nbytes / (fused_us * 1e3) / copy_gbps,
                }
            )
    speedups = [row["speedup"] for row in table]
    return {
        "benchmark": "kernel_compressor",
        "smoke": smoke,
        "shape": {"head_dim": d, "rope_dim": rope, "state_rows": rows, "out_dtype": "bfloat16"},
        "copy_gbps_measured": copy_gbps,
        "all_checks_ok": all(c["ok"] for c in checks),
        "checks": checks,
        "table": table,
        "compressor_vs_torch": geomean(speedups),
        "compressor_vs_torch_min": min(speedups),
        "compressor_frac_copy_bw_prefill": [r["frac_copy_bw"] for r in table if r["phase"] == "prefill"],
    }


# The ratios this benchmark puts in its suite's `ratios` table.
HEADLINE = ("compressor_vs_torch",)
