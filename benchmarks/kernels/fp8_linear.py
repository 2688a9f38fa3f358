"""FP8-block linear kernel vs the PyTorch chains it replaces, at V4-Flash attention projection shapes.

x [T, K] bf16 times an FP8-block weight [N, K] (e4m3 + one UE8M0 scale per 128 x 128 block):
q_a (K 4096 -> N 1024), q_b (K 1024 -> N 32768), o_b (K 8192 -> N 4096); T in {1, 8, 64} (decode)
and 2048 (prefill). Weights are quantised from random bf16 weights of trained-like magnitude.

* Correctness against `fp8_linear_reference` in float32 on the upcast activations, output and
  split-K workspace poisoned with NaN, fresh random inputs, for every launch shape that is timed.
* Time: median of CUDA-graph replays of calls that rotate through enough distinct weight copies
  (>= 256 MB in all) that the weights do not come from L2.
* Byte floor: weight bytes (fp8) + scales + activations in and out, read / written once, at the
  copy bandwidth measured in the same run; `frac_floor` = floor time / kernel time.
* Baselines, timed the same way: `dequant_fp8_block` to bf16 then `F.linear` (what the model runs
  without the kernel), and `F.linear` on a bf16 weight dequantised ahead of time (twice the weight
  bytes, cuBLAS).
* The pairs that share a GEMV launch at one token (q_a with kv, the shared expert's gate with up):
  against the reference, and on a GPU a CUDA graph's replays bitwise the eager call.
* A sweep of launch shapes at T = 1, 4, 8, 32, 64 and 2048 on every projection, to retune
  `pick_config`.
* The dense path at T = 2048 and 8192 (`fp8_linear` with an `Fp8DequantConfig`: the weight expanded
  to bf16 by `dequant_fp8_into`, then cuBLAS) beside the Triton kernels at the launch shape
  `fp8_linear` would otherwise pick and `F.linear` on a bf16 weight dequantised ahead of time:
  TFLOP/s of each and `dense_vs_triton_T<T>_<shape>` = Triton time / dense time (> 1: the dense path
  is faster), both checked against the reference; and the dequantisation kernel alone, in GB/s
  (e4m3 + scales read, bf16 written), as `dequant_gbps_<shape>`. The table's rows at 2048 tokens
  time `fp8_linear` as called, so on a GPU they take the dense path (`uses_dense`).

    python -m benchmarks run kernels --only fp8_linear [--smoke]
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..lib.checks import BF16_TOL, poisoned, rel_err, replays_bitwise
from ..lib.context import Context
from ..lib.timing import geomean, time_zipped

# name: (K, N) of the V4-Flash attention projections
SHAPES = {"q_a": (4096, 1024), "q_b": (1024, 32768), "o_b": (8192, 4096)}
# name: (K, N1, N2) of the V4-Flash pairs that share a launch at one token (`fp8_linear_pair`)
PAIRS = {"q_a+kv": (4096, 1024, 512), "gate+up": (4096, 2048, 2048)}
ROTATE_BYTES = 256 * 2**20  # weight bytes cycled through per timing, several times the 60 MB L2


def _weight(k: int, n: int, device: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8-block weight [N, K] with scales [N/128, K/128], from N(0, 0.02^2) values whose blocks
    are rescaled by 2^-2..2^1, so the block exponents differ."""
    from antumbra.replicas.model.quant import quant_fp8_block

    blocks = torch.randint(-2, 2, (-(-n // 128), -(-k // 128)), device=device, generator=g).float().exp2()
    spread = blocks.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return quant_fp8_block(0.02 * torch.randn(n, k, device=device, generator=g) * spread)


def _variants(num_tokens: int, smoke: bool) -> list[Any]:
    """Launch shapes timed at this token count besides `pick_config`'s: its neighbours."""
    from antumbra.kernels.fp8_linear import DECODE_16_CONFIG, GEMV_CONFIG, MID_CONFIG, PREFILL_CONFIG

    replace = dataclasses.replace
    if smoke:
        return [replace(DECODE_16_CONFIG, block_n=32, block_k=64)] if num_tokens > 1 else []
    if num_tokens == 1:
        return [
            replace(GEMV_CONFIG, block_n=16, block_k=512),
            replace(GEMV_CONFIG, num_stages=4, programs_per_sm=4),
            DECODE_16_CONFIG,
        ]
    if num_tokens <= 64:
        t = max(16, num_tokens)
        return [
            *([GEMV_CONFIG] if num_tokens <= 4 else []),
            replace(DECODE_16_CONFIG, block_t=t, scale_weights=False),
            replace(DECODE_16_CONFIG, block_t=t, block_n=128, block_k=64, num_stages=6),
        ]
    return [MID_CONFIG, PREFILL_CONFIG, replace(PREFILL_CONFIG, num_stages=3)]


@dataclasses.dataclass
class _Bench:
    """What every measurement of one run shares."""

    device: str
    g: torch.Generator
    reps: int
    floor_gbps: float
    checks: list[dict[str, Any]]

    def check(self, shape: str, k: int, n: int, tokens: int, config: Any) -> bool:
        """Poisoned outputs, fresh weight and activations, against the float32 reference."""
        from antumbra.kernels.fp8_linear import fp8_linear, fp8_linear_reference
        from antumbra.kernels.fp8_linear import triton as fp8_triton

        w, s = _weight(k, n, self.device, self.g)
        x = torch.randn(tokens, k, device=self.device, generator=self.g).to(torch.bfloat16)
        with poisoned(fp8_triton):
            out = fp8_linear(x, w, s, config=config)
        err = rel_err(out, fp8_linear_reference(x.float(), w, s))
        ok = bool(out.isfinite().all()) and err < BF16_TOL
        self.checks.append({"shape": shape, "tokens": tokens, "config": str(config or "auto"), "rel_err": err,
                            "ok": ok})
        return ok

    def time(self, fn: Callable[..., object], *arg_sets: list[Any], **kwargs: Any) -> float:
        """Median us per call of fn over the rotating argument sets (zipped)."""
        return time_zipped(fn, arg_sets, self.device, self.reps, **kwargs)

    def floor(self, k: int, n: int, tokens: int) -> tuple[int, float]:
        """(bytes, microseconds): fp8 weight + scales + bf16 activations in and out, once each."""
        nbytes = n * k + -(-n // 128) * -(-k // 128) + 2 * tokens * (k + n)
        return nbytes, nbytes / (self.floor_gbps * 1e3)


def _pair_checks(bench: _Bench, smoke: bool) -> None:
    """Two linears on one input at one token (`fp8_linear_pair`): each output against the reference,
    and on a GPU a second call and a CUDA graph's replays bitwise the first (what the GPU-marked
    `test_pairs_at_v4_shapes_on_a_gpu_match_and_replay` checks)."""
    from antumbra.kernels.fp8_linear import fp8_linear_pair, fp8_linear_reference

    for name, (k, n1, n2) in ({"odd": (200, 72, 40)} if smoke else PAIRS).items():
        first, second = _weight(k, n1, bench.device, bench.g), _weight(k, n2, bench.device, bench.g)
        x = torch.randn(1, k, device=bench.device, generator=bench.g).to(torch.bfloat16)
        ys = fp8_linear_pair(x, first, second)
        err = max(rel_err(y, fp8_linear_reference(x.float(), *ws))
                  for y, ws in zip(ys, (first, second), strict=True))
        ok = err < BF16_TOL and all(bool(y.isfinite().all()) for y in ys)
        if bench.device != "cpu":
            ok = ok and replays_bitwise(lambda: fp8_linear_pair(x, first, second))  # noqa: B023 - called here
        bench.checks.append({"shape": name, "tokens": 1, "config": "pair", "rel_err": err, "ok": ok})


def _num_sms(device: str) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device != "cpu" else 4


def _dequant_linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    from antumbra.kernels.fp8_linear import dequant_fp8_weight

    return F.linear(x, dequant_fp8_weight(w, s, x.dtype))


def _auto_path(tokens: int, n: int, device: str) -> str:
    """What `fp8_linear` runs for T rows of bf16 without a config."""
    from antumbra.kernels.fp8_linear import DEQUANT_CONFIG, pick_config, uses_dense

    if uses_dense(tokens, torch.bfloat16, torch.device(device).type):
        return f"dense {DEQUANT_CONFIG}"
    return str(pick_config(tokens, n, _num_sms(device)))


def _shared_inputs(bench: _Bench, tokens: int, k: int, copies: int, rotate_bytes: int) -> list[torch.Tensor]:
    """`copies` activations [T, K] bf16 to pair with the rotating weights: distinct ones up to
    `rotate_bytes` in all (at least one), then repeated. Prefill activations outgrow L2 by themselves,
    and 8192-token copies for every weight would take gigabytes."""
    distinct = max(1, min(copies, rotate_bytes // (2 * tokens * k)))
    xs = [torch.randn(tokens, k, device=bench.device, generator=bench.g).to(torch.bfloat16)
          for _ in range(distinct)]
    return [xs[i % distinct] for i in range(copies)]


def _dense_rows(
    bench: _Bench, shape: str, k: int, n: int, weights: list[tuple[torch.Tensor, torch.Tensor]],
    bf16_ws: list[torch.Tensor], tokens_list: list[int], rotate_bytes: int,
) -> list[dict[str, Any]]:
    """The dense path against the Triton kernels and F.linear on a bf16 weight at prefill sizes, and
    the dequantisation kernel alone (first row, tokens 0) of one projection."""
    from antumbra.kernels.fp8_linear import DEQUANT_CONFIG, dequant_fp8_into, fp8_linear
    from antumbra.kernels.fp8_linear import triton as fp8_triton

    ws, ss = [w for w, _ in weights], [s for _, s in weights]
    outs = [torch.empty(n, k, dtype=torch.bfloat16, device=bench.device) for _ in weights]
    dequant_us = bench.time(dequant_fp8_into, outs, ws, ss, config=DEQUANT_CONFIG)
    dequant_bytes = 3 * n * k + -(-n // 128) * -(-k // 128)  # e4m3 and scales read, bf16 written
    rows: list[dict[str, Any]] = [{"shape": shape, "tokens": 0, "dequant_us": dequant_us,
                                   "dequant_bytes": dequant_bytes,
                                   "dequant_gbps": dequant_bytes / dequant_us / 1e3,
                                   "dequant_frac_copy": dequant_bytes / dequant_us / 1e3 / bench.floor_gbps}]
    for tokens in tokens_list:
        triton_config = fp8_triton.plan(tokens, n, k, _num_sms(bench.device))[0]
        dense_ok = bench.check(shape, k, n, tokens, DEQUANT_CONFIG)
        triton_ok = bench.check(shape, k, n, tokens, triton_config)
        xs = _shared_inputs(bench, tokens, k, len(weights), rotate_bytes)
        dense_us = bench.time(fp8_linear, xs, ws, ss, config=DEQUANT_CONFIG)
        triton_us = bench.time(fp8_linear, xs, ws, ss, config=triton_config)
        bf16_us = bench.time(F.linear, xs, bf16_ws)
        flops = 2 * tokens * n * k
        rows.append({
            "shape": shape,
            "tokens": tokens,
            "ok": dense_ok and triton_ok,
            "dense_config": str(DEQUANT_CONFIG),
            "triton_config": str(triton_config),
            "dense_us": dense_us,
            "triton_us": triton_us,
            "bf16_linear_us": bf16_us,
            "dense_tflops": flops / dense_us / 1e6,
            "triton_tflops": flops / triton_us / 1e6,
            "bf16_linear_tflops": flops / bf16_us / 1e6,
            "dense_vs_triton": triton_us / dense_us,
            "dense_vs_bf16_linear": bf16_us / dense_us,
        })
    return rows


def _shape_rows(bench: _Bench, shape: str, k: int, n: int, tokens_list: list[int], decode_tokens: list[int],
                sweep_tokens: list[int], dense_tokens: list[int], rotate_bytes: int,
                smoke: bool) -> tuple[list[dict], list[dict], list[dict]]:
    """(timing rows against the torch chains, launch-shape sweep rows, dense-path rows) of one projection."""
    from antumbra.kernels.fp8_linear import dequant_fp8_weight, fp8_linear, pick_config

    copies = max(2, -(-rotate_bytes // (n * k)))
    weights = [_weight(k, n, bench.device, bench.g) for _ in range(copies)]
    ws, ss = [w for w, _ in weights], [s for _, s in weights]
    bf16_ws = [dequant_fp8_weight(w, s, torch.bfloat16) for w, s in weights]

    def inputs(tokens: int) -> list[torch.Tensor]:
        return [torch.randn(tokens, k, device=bench.device, generator=bench.g).to(torch.bfloat16)
                for _ in range(copies)]

    table = []
    for tokens in tokens_list:
        xs = inputs(tokens)
        bench.check(shape, k, n, tokens, None)
        ours = bench.time(fp8_linear, xs, ws, ss)
        chain_us = bench.time(_dequant_linear, xs, ws, ss)
        bf16_us = bench.time(F.linear, xs, bf16_ws)
        nbytes, floor_us = bench.floor(k, n, tokens)
        table.append({
            "shape": shape,
            "k": k,
            "n": n,
            "tokens": tokens,
            "phase": "decode" if tokens in decode_tokens else "prefill",
            "config": _auto_path(tokens, n, bench.device),
            "kernel_us": ours,
            "dequant_linear_us": chain_us,
            "bf16_linear_us": bf16_us,
            "speedup_vs_dequant_linear": chain_us / ours,
            "speedup_vs_bf16_linear": bf16_us / ours,
            "bytes": nbytes,
            "floor_us": floor_us,
            "frac_floor": floor_us / ours,
            "tflops": 2 * tokens * n * k / ours / 1e6,
        })
    sweep = []
    for tokens in sweep_tokens:
        xs = inputs(tokens)
        configs = [pick_config(tokens, n, _num_sms(bench.device)), *_variants(tokens, smoke)]
        for config in dict.fromkeys(configs):  # the chosen one first, each once
            ok = bench.check(shape, k, n, tokens, config)
            us = bench.time(fp8_linear, xs, ws, ss, config=config)
            sweep.append({
                "shape": shape,
                "tokens": tokens,
                "config": str(dataclasses.asdict(config)),
                "ok": ok,
                "kernel_us": us,
                "frac_floor": bench.floor(k, n, tokens)[1] / us,
            })
    dense = _dense_rows(bench, shape, k, n, weights, bf16_ws, dense_tokens, rotate_bytes)
    return table, sweep, dense


def run(ctx: Context) -> dict[str, Any]:
    """Correctness at real shapes, then kernel vs torch timings. Returns a JSON-able dict."""
    device, smoke = ctx.device, ctx.smoke
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
    if smoke:
        shapes, decode_tokens, prefill_tokens = {"odd": (200, 72), "even": (256, 128)}, [1, 3], [17]
        sweep_tokens, dense_tokens, rotate_bytes, reps = [1, 3], [17], 0, 1
    else:
        shapes, decode_tokens, prefill_tokens = SHAPES, [1, 8, 64], [2048]
        sweep_tokens, dense_tokens = [1, 4, 8, 32, 64, 2048], [2048, 8192]
        rotate_bytes, reps = ROTATE_BYTES, 20
    copy_gbps = ctx.rates.copy_gbps
    matmul_tflops = ctx.rates.matmul_tflops
    bench = _Bench(
        device, torch.Generator(device=device).manual_seed(0), reps, copy_gbps, []
    )
    table: list[dict[str, Any]] = []
    sweep: list[dict[str, Any]] = []
    dense: list[dict[str, Any]] = []
    for shape, (k, n) in shapes.items():
        rows, swept, dense_rows = _shape_rows(
            bench,
            shape,
            k,
            n,
            decode_tokens + prefill_tokens,
            decode_tokens,
            sweep_tokens,
            dense_tokens,
            rotate_bytes,
            smoke,
        )
        table += rows
        sweep += swept
        dense += dense_rows
    _pair_checks(bench, smoke)
    if matmul_tflops:
        for row in table:
            row["frac_matmul_rate"] = row["tflops"] / matmul_tflops

    def summary(phase: str, key: str, tokens: int | None = None) -> float:
        rows = [r for r in table if r["phase"] == phase and (tokens is None or r["tokens"] == tokens)]
        return geomean([r[key] for r in rows])

    return {
        "benchmark": "kernel_fp8_linear",
        "smoke": smoke,
        "shapes": {name: {"k": k, "n": n} for name, (k, n) in shapes.items()},
        "activation_dtype": "bfloat16",
        "copy_gbps_measured": copy_gbps,
        "matmul_tflops_measured": matmul_tflops,
        "all_checks_ok": all(c["ok"] for c in bench.checks),
        "checks": bench.checks,
        "fp8_linear_floor_frac_B1": summary("decode", "frac_floor", tokens=1),
        "fp8_linear_floor_frac_decode": summary("decode", "frac_floor"),
        "fp8_linear_vs_torch_decode": summary("decode", "speedup_vs_dequant_linear"),
        "fp8_linear_vs_bf16_decode": summary("decode", "speedup_vs_bf16_linear"),
        "fp8_linear_vs_torch_prefill": summary("prefill", "speedup_vs_dequant_linear"),
        "fp8_linear_vs_bf16_prefill": summary("prefill", "speedup_vs_bf16_linear"),
        "dense_vs_triton_prefill": geomean([r["dense_vs_triton"] for r in dense if r["tokens"]]),
        **_dense_keys(dense),
        "table": table,
        "config_sweep": sweep,
        "dense": dense,
    }


def _dense_keys(dense: list[dict[str, Any]]) -> dict[str, float]:
    """Flat figures of the dense rows: `<what>_T<tokens>_<shape>`, and `dequant_gbps_<shape>`."""
    keys = {}
    for row in dense:
        if not row["tokens"]:
            keys[f"dequant_gbps_{row['shape']}"] = row["dequant_gbps"]
            keys[f"dequant_frac_copy_{row['shape']}"] = row["dequant_frac_copy"]
            continue
        for what in ("dense_vs_triton", "dense_tflops", "triton_tflops", "bf16_linear_tflops"):
            keys[f"{what}_T{row['tokens']}_{row['shape']}"] = row[what]
    return keys


# The ratios this benchmark puts in its suite's `ratios` table.
HEADLINE = ("fp8_linear_floor_frac_B1", "fp8_linear_vs_bf16_decode")
