"""Weight dequantisation kernels against the copy bandwidth: MXFP4 experts and FP8-block linears.

* MXFP4 (`moe_mxfp4.grouped.dequant_mxfp4_into`, the decode of the grouped prefill MoE) at the
  engine's 16-expert slice of V4-Flash: w1 and w3 (each [16, 2048, 4096] values) into one
  [16, 4096, 4096] bf16 scratch (two launches, timed together as "w13"), and w2 [16, 4096, 2048];
  every config of its `DEQUANT_SWEEP` (tiles).
* FP8-block (`fp8_linear.dequant_fp8_into`, the first half of `fp8_linear`'s dense path) on the
  q_a (4096 -> 1024), q_b (1024 -> 32768) and o_b (8192 -> 4096) weights, every config of its
  `DEQUANT_SWEEP`; weights and outputs rotate through >= 256 MB so neither stays in L2.
* Each variant's output, NaN-poisoned first, must equal the PyTorch reference bit for bit.
* GB/s = (bytes read: packed weights + scales, and written: bf16 values) / time; `frac_copy` divides
  it by the device-to-device copy bandwidth measured in the same run (the project's H200 figure on CPU).
* The best config of each kernel: the least time summed over its shapes, among those that are exact.
Timings are medians of CUDA-graph replays (`gpu_measure.time_us`).

    python -m benchmarks run kernels --only dequant [--smoke]
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from ..lib.context import Context
from ..lib.timing import time_us

FP8_SHAPES = {"q_a": (4096, 1024), "q_b": (1024, 32768), "o_b": (8192, 4096)}  # name: (K, N)
SMOKE_FP8_SHAPES = {"odd": (200, 72), "even": (256, 128)}
ROTATE_BYTES = 256 * 2**20  # bytes touched per timed pass, several times the 60 MB L2


@dataclasses.dataclass(frozen=True)
class MoeSize:
    experts: int
    hidden: int
    inter: int


MOE_SIZE = MoeSize(experts=16, hidden=4096, inter=2048)
SMOKE_MOE_SIZE = MoeSize(experts=2, hidden=64, inter=32)


@dataclasses.dataclass
class _Bench:
    device: str
    reps: int
    copy_gbps: float
    g: torch.Generator

    def row(self, kernel: str, shape: str, config: Any, calls: list[Callable[[], object]], nbytes: int,
            ok: bool) -> dict[str, Any]:
        """Time `calls` (each moving `nbytes`) -> the result row of one (kernel, shape, config)."""
        us = time_us(calls, self.device, reps=self.reps)
        gbps = nbytes / us / 1e3
        return {"kernel": kernel, "shape": shape, "config": _name(config), "ok": ok, "us": us,
                "bytes": nbytes, "gbps": gbps, "frac_copy": gbps / self.copy_gbps}


def _name(config: Any) -> str:
    return ",".join(f"{k}={v}" for k, v in dataclasses.asdict(config).items())


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


# ----- MXFP4 experts


def _mxfp4(size: MoeSize, rows: int, cols: int, bench: _Bench) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes [E, rows, cols/2] uint8 and exponents [E, rows, cols/32] e8m0 (2^-11 .. 2^-4)."""
    codes = torch.randint(0, 256, (size.experts, rows, cols // 2), device=bench.device, generator=bench.g,
                          dtype=torch.uint8)
    exps = torch.randint(116, 124, (size.experts, rows, cols // 32), device=bench.device, generator=bench.g,
                         dtype=torch.uint8)
    return codes, exps.view(torch.float8_e8m0fnu)


def _mxfp4_rows(bench: _Bench, size: MoeSize) -> list[dict[str, Any]]:
    from antumbra.kernels.moe_mxfp4.grouped import DEQUANT_SWEEP, dequant_mxfp4_into
    from antumbra.kernels.moe_mxfp4.reference import dequant_mxfp4

    e, d, inter = size.experts, size.hidden, size.inter
    w1, w3, w2 = _mxfp4(size, inter, d, bench), _mxfp4(size, inter, d, bench), _mxfp4(size, d, inter, bench)
    want13 = torch.cat([dequant_mxfp4(*w1), dequant_mxfp4(*w3)], dim=1).to(torch.bfloat16)
    want2 = dequant_mxfp4(*w2).to(torch.bfloat16)
    w13 = torch.empty(e, 2 * inter, d, dtype=torch.bfloat16, device=bench.device)
    w2_dense = torch.empty(e, d, inter, dtype=torch.bfloat16, device=bench.device)
    values = e * inter * d  # of each of w1, w3, w2
    nbytes = values // 2 + values // 32 + 2 * values  # packed codes and scales read, bf16 written

    def decode13(config: Any) -> None:
        dequant_mxfp4_into(w13, *w1, 0, config)
        dequant_mxfp4_into(w13, *w3, inter, config)

    rows = []
    for config in DEQUANT_SWEEP:
        w13.fill_(float("nan"))
        w2_dense.fill_(float("nan"))
        decode13(config)
        dequant_mxfp4_into(w2_dense, *w2, 0, config)
        ok13, ok2 = _bits_equal(w13, want13), _bits_equal(w2_dense, want2)
        call13 = functools.partial(decode13, config)
        rows.append(bench.row("mxfp4", "w13", config, [call13], 2 * nbytes, ok13))
        call2 = functools.partial(dequant_mxfp4_into, w2_dense, *w2, 0, config)
        rows.append(bench.row("mxfp4", "w2", config, [call2], nbytes, ok2))
    return rows


# ----- FP8-block linears


def _fp8_rows(bench: _Bench, shapes: dict[str, tuple[int, int]], rotate_bytes: int) -> list[dict[str, Any]]:
    from antumbra.kernels.fp8_linear import DEQUANT_SWEEP, dequant_fp8_into, dequant_fp8_weight
    from antumbra.replicas.model.quant import quant_fp8_block

    rows = []
    for shape, (k, n) in shapes.items():
        nbytes = n * k * 3 + -(-n // 128) * -(-k // 128)  # e4m3 and scales read, bf16 written
        copies = max(2, -(-rotate_bytes // nbytes))
        weights = [quant_fp8_block(0.02 * torch.randn(n, k, device=bench.device, generator=bench.g))
                   for _ in range(copies)]
        outs = [torch.empty(n, k, dtype=torch.bfloat16, device=bench.device) for _ in range(copies)]
        want = dequant_fp8_weight(*weights[0], torch.bfloat16)
        for config in DEQUANT_SWEEP:
            outs[0].fill_(float("nan"))
            ok = _bits_equal(dequant_fp8_into(outs[0], *weights[0], config), want)
            calls: list[Callable[[], object]] = [
                functools.partial(dequant_fp8_into, out, w, s, config)
                for out, (w, s) in zip(outs, weights, strict=True)
            ]
            rows.append(bench.row("fp8", shape, config, calls, nbytes, ok))
    return rows


def _best(rows: list[dict[str, Any]], kernel: str, default: Any) -> dict[str, Any]:
    """The config of `kernel` with the least total time over its shapes (exact ones only), and the
    default's figures beside it."""
    totals: dict[str, float] = {}
    for row in rows:
        if row["kernel"] == kernel:
            us = row["us"] if row["ok"] else float("inf")
            totals[row["config"]] = totals.get(row["config"], 0.0) + us
    best = min(totals, key=lambda name: totals[name])

    def gbps(config: str) -> float:
        picked = [r for r in rows if r["kernel"] == kernel and r["config"] == config]
        return sum(r["bytes"] for r in picked) / sum(r["us"] for r in picked) / 1e3

    return {"config": best, "us": totals[best], "gbps": gbps(best), "default_config": _name(default),
            "default_us": totals[_name(default)], "default_gbps": gbps(_name(default)),
            "speedup_vs_default": totals[_name(default)] / totals[best]}


def run(ctx: Context) -> dict[str, Any]:
    """Every variant checked, then timed. Returns a JSON-able dict."""
    device, smoke = ctx.device, ctx.smoke
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
    from antumbra.kernels.fp8_linear import DEQUANT_CONFIG as FP8_DEFAULT
    from antumbra.kernels.moe_mxfp4.grouped import DEQUANT_CONFIG as MXFP4_DEFAULT

    size, shapes = (SMOKE_MOE_SIZE, SMOKE_FP8_SHAPES) if smoke else (MOE_SIZE, FP8_SHAPES)
    copy_gbps = ctx.rates.copy_gbps
    bench = _Bench(device, 1 if smoke else 20, copy_gbps,
                   torch.Generator(device=device).manual_seed(0))
    rows = _mxfp4_rows(bench, size) + _fp8_rows(bench, shapes, 0 if smoke else ROTATE_BYTES)
    mxfp4, fp8 = _best(rows, "mxfp4", MXFP4_DEFAULT), _best(rows, "fp8", FP8_DEFAULT)
    return {
        "benchmark": "kernel_dequant_gpu",
        "smoke": smoke,
        "moe_size": dataclasses.asdict(size),
        "fp8_shapes": {name: {"k": k, "n": n} for name, (k, n) in shapes.items()},
        "output_dtype": "bfloat16",
        "copy_gbps_measured": copy_gbps,
        "all_checks_ok": all(r["ok"] for r in rows),
        "best_mxfp4_config": mxfp4["config"],
        "mxfp4_best_frac_copy": mxfp4["gbps"] / bench.copy_gbps,
        "mxfp4_default_frac_copy": mxfp4["default_gbps"] / bench.copy_gbps,
        "mxfp4_best_vs_default": mxfp4["speedup_vs_default"],
        "best_fp8_config": fp8["config"],
        "fp8_best_frac_copy": fp8["gbps"] / bench.copy_gbps,
        "fp8_default_frac_copy": fp8["default_gbps"] / bench.copy_gbps,
        "fp8_best_vs_default": fp8["speedup_vs_default"],
        "mxfp4": mxfp4,
        "fp8": fp8,
        "rows": rows,
    }


# The ratios this benchmark puts in its suite's `ratios` table.
HEADLINE = ("mxfp4_best_frac_copy", "fp8_best_frac_copy")
