"""Few-token GEMV kernel vs the PyTorch calls it replaces, at V4-Flash's small bf16 projections.

x [T, K] bf16 against one or two bf16 weights that read it: a window compressor's kv and gate
(written into float32 state rows: the torch side is two `F.linear` calls and the state-write
kernel), the indexer compressor's, the 128:1 compressor's, the router's gate and the indexer's
head weights (`F.linear`). T in {1, 2, 4, 8}: where `GEMV_MAX_TOKENS` should sit.

* Correctness against `gemv_into_reference` (outputs NaN-poisoned), every timed shape and token count;
  on a GPU, a CUDA graph's replays of one token's call bitwise the eager call.
* Time: median of CUDA-graph replays over rotating weight copies (>= 256 MB in all, off L2).
* Byte floor: the weights' bytes plus activations in and out, once, at the copy bandwidth measured
  in the same run; `frac_floor` = floor time / kernel time. `gemv_vs_torch_T<t>` is the geomean over
  the shapes of torch time / kernel time (> 1: the kernel is faster).
* A sweep of launch shapes at T = 1, to retune `GEMV_CONFIG`.

    python -m benchmarks run kernels --only gemv [--smoke]
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..lib.checks import BF16_TOL, rel_err, replays_bitwise
from ..lib.context import Context
from ..lib.timing import geomean, time_zipped

# name: (K, output widths) of the V4-Flash projections the GEMV takes
SHAPES = {"compressor_c4": (4096, (1024, 1024)), "indexer_compressor": (4096, (256, 256)),
          "compressor_c128": (4096, (512, 512)), "router": (4096, (256,)), "head_weights": (4096, (64,))}
SMOKE_SHAPES = {"pair": (200, (40, 40)), "single": (256, (48,))}
ROTATE_BYTES = 256 * 2**20


def _variants(smoke: bool) -> list[Any]:
    from antumbra.kernels.gemv.triton import GEMV_CONFIG

    replace = dataclasses.replace
    if smoke:
        return [replace(GEMV_CONFIG, block_n=8, block_k=64)]
    return [replace(GEMV_CONFIG, block_n=8), replace(GEMV_CONFIG, block_n=32, block_k=256),
            replace(GEMV_CONFIG, block_k=1024, num_warps=8), replace(GEMV_CONFIG, programs_per_sm=4),
            replace(GEMV_CONFIG, num_stages=4)]


def _torch_chain(x: torch.Tensor, weights: list[torch.Tensor], outs: list[torch.Tensor],
                 rows: torch.Tensor) -> None:
    """What the model runs without the kernel: the linears, then (pairs) the state-write launch."""
    from antumbra.kernels.compressor import write_state

    ys = [F.linear(x, w) for w in weights]
    if len(ys) == 2:
        write_state(ys[0], ys[1], rows, outs[0], outs[1])


def _ours(x: torch.Tensor, weights: list[torch.Tensor], outs: list[torch.Tensor], rows: torch.Tensor,
          config: Any = None) -> None:
    from antumbra.kernels.gemv import gemv_into

    gemv_into(x, weights, outs, rows=rows if len(weights) == 2 else None, config=config)


@dataclasses.dataclass
class _Bench:
    device: str
    g: torch.Generator
    reps: int
    floor_gbps: float
    checks: list[dict[str, Any]]

    def check(self, shape: str, k: int, widths: tuple[int, ...], tokens: int, config: Any) -> bool:
        from antumbra.kernels.gemv import gemv_into_reference

        x = torch.randn(tokens, k, device=self.device, generator=self.g).to(torch.bfloat16)
        ws = [(0.02 * torch.randn(n, k, device=self.device, generator=self.g)).to(torch.bfloat16)
              for n in widths]
        rows = torch.arange(tokens, device=self.device)
        outs = [torch.full((tokens, n), float("nan"), device=self.device) for n in widths]
        refs = [torch.empty_like(o) for o in outs]
        _ours(x, ws, outs, rows, config)
        gemv_into_reference(x, ws, refs, rows=rows)
        err = max(rel_err(o, r) for o, r in zip(outs, refs, strict=True))
        ok = all(bool(o.isfinite().all()) for o in outs) and err < BF16_TOL
        self.checks.append({"shape": shape, "tokens": tokens, "config": str(config or "auto"), "rel_err": err,
                            "ok": ok})
        return ok

    def check_replay(self, shape: str, k: int, widths: tuple[int, ...]) -> None:
        """CUDA graph replays of one token's call, into state rows, bitwise the eager call (the
        GPU-marked `test_graph_replays_are_bitwise_the_eager_call`, at this shape)."""
        from antumbra.kernels.gemv import gemv_into

        x = torch.randn(1, k, device=self.device, generator=self.g).to(torch.bfloat16)
        ws = [(0.02 * torch.randn(n, k, device=self.device, generator=self.g)).to(torch.bfloat16)
              for n in widths]
        outs = [torch.zeros(3, n, device=self.device) for n in widths]
        rows = torch.tensor([2], device=self.device)

        def call() -> tuple[torch.Tensor, ...]:
            gemv_into(x, ws, outs, rows=rows if len(ws) == 2 else None)
            return tuple(outs)

        self.checks.append({"shape": shape, "tokens": 1, "config": "graph replay",
                            "ok": replays_bitwise(call)})

    def time(self, fn: Callable[..., object], *arg_sets: list[Any], **kwargs: Any) -> float:
        return time_zipped(fn, arg_sets, self.device, self.reps, **kwargs)


def _shape_rows(bench: _Bench, shape: str, k: int, widths: tuple[int, ...], tokens_list: list[int],
                rotate_bytes: int, smoke: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    copies = max(2, -(-rotate_bytes // (2 * sum(widths) * k)))
    wsets = [[(0.02 * torch.randn(n, k, device=bench.device, generator=bench.g)).to(torch.bfloat16)
              for n in widths] for _ in range(copies)]
    table, sweep = [], []
    for tokens in tokens_list:
        xs = [torch.randn(tokens, k, device=bench.device, generator=bench.g).to(torch.bfloat16)
              for _ in range(copies)]
        outs = [[torch.empty(tokens, n, device=bench.device) for n in widths] for _ in range(copies)]
        rows = [torch.arange(tokens, device=bench.device)] * copies
        ok = bench.check(shape, k, widths, tokens, None)
        ours = bench.time(_ours, xs, wsets, outs, rows)
        torch_us = bench.time(_torch_chain, xs, wsets, outs, rows)
        nbytes = 2 * sum(widths) * k + 2 * tokens * k + 4 * tokens * sum(widths)
        floor_us = nbytes / (bench.floor_gbps * 1e3)
        table.append({"shape": shape, "k": k, "widths": list(widths), "tokens": tokens, "ok": ok,
                      "kernel_us": ours, "torch_us": torch_us, "speedup_vs_torch": torch_us / ours,
                      "bytes": nbytes, "floor_us": floor_us, "frac_floor": floor_us / ours})
        if tokens != 1:
            continue
        if bench.device != "cpu":
            bench.check_replay(shape, k, widths)
        for config in _variants(smoke):
            ok = bench.check(shape, k, widths, tokens, config)
            us = bench.time(_ours, xs, wsets, outs, rows, config=config)
            sweep.append({"shape": shape, "tokens": tokens, "config": str(dataclasses.asdict(config)),
                          "ok": ok, "kernel_us": us, "frac_floor": floor_us / us})
    return table, sweep


def run(ctx: Context) -> dict[str, Any]:
    """Correctness at real shapes, then kernel vs torch timings. Returns a JSON-able dict."""
    device, smoke = ctx.device, ctx.smoke
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
    shapes, tokens_list, rotate_bytes, reps = ((SMOKE_SHAPES, [1, 2], 0, 1) if smoke
                                               else (SHAPES, [1, 2, 4, 8], ROTATE_BYTES, 20))
    bench = _Bench(device, torch.Generator(device=device).manual_seed(0), reps, ctx.rates.copy_gbps, [])
    table: list[dict[str, Any]] = []
    sweep: list[dict[str, Any]] = []
    for shape, (k, widths) in shapes.items():
        rows, swept = _shape_rows(bench, shape, k, widths, tokens_list, rotate_bytes, smoke)
        table += rows
        sweep += swept
    per_tokens = {f"gemv_vs_torch_T{t}": geomean([r["speedup_vs_torch"] for r in table if r["tokens"] == t])
                  for t in tokens_list}
    return {
        "benchmark": "kernel_gemv",
        "smoke": smoke,
        "shapes": {name: {"k": k, "widths": list(w)} for name, (k, w) in shapes.items()},
        "copy_gbps_measured": ctx.rates.copy_gbps,
        "all_checks_ok": all(c["ok"] for c in bench.checks),
        "checks": bench.checks,
        **per_tokens,
        "gemv_floor_frac_T1": geomean([r["frac_floor"] for r in table if r["tokens"] == 1]),
        "table": table,
        "config_sweep": sweep,
    }


HEADLINE_PREFIXES = ("gemv_vs_torch_T", "gemv_floor_frac_")
