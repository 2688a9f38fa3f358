"""The decode step's index kernels vs their PyTorch references at serving shapes.

Page 128, window 128, rates 4 and 128, context up to 65 536 (513 logical pages, 16 384 C4
entries), batch 1 / 8 / 64, half the SWA pages released. Correctness: exact equality with the
reference on fresh random page tables; then median times of the three launches against the
reference's chain of small ops (both in CUDA graphs).

    python -m benchmarks run kernels --only decode_index [--smoke]
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..lib.context import Context
from ..lib.timing import time_us

PAGE, WINDOW, RATES = 128, 128, (4, 128)


def _state(batch: int, max_len: int, device: str, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    max_pages = -(-max_len // PAGE)
    num_vpages = batch * max_pages + 1
    tables = torch.randperm(num_vpages - 1, device=device, generator=g)[: batch * max_pages].view(
        batch, max_pages
    )
    swa_map = torch.randint(0, 4 * batch + 4, (num_vpages,), device=device, generator=g)
    swa_map[torch.rand(num_vpages, device=device, generator=g) < 0.5] = -1
    positions = torch.randint(0, max_len, (batch,), device=device, generator=g)
    active = torch.ones(batch, dtype=torch.long, device=device)
    active[batch // 2 :: 7] = 0
    return tables.contiguous(), swa_map, positions, active


def _all(fns: dict[str, Any], state: tuple[torch.Tensor, ...], max_len: int) -> list[torch.Tensor]:
    out = list(fns["window"](*state, PAGE, WINDOW, 10**6))
    for rate in RATES:
        out += list(fns["rate"](*state, PAGE, rate, max_len // rate, 10**6, 10**6 + 1))
    return out


def run(ctx: Context) -> dict[str, Any]:
    device, smoke = ctx.device, ctx.smoke
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
    from antumbra.kernels.decode_index import (
        rate_index,
        rate_index_reference,
        window_index,
        window_index_reference,
    )

    kernel = {"window": window_index, "rate": rate_index}
    reference = {"window": window_index_reference, "rate": rate_index_reference}
    g = torch.Generator(device=device).manual_seed(0)
    cases = [(1, 4096), (8, 512)] if smoke else [(1, 4096), (1, 65536), (8, 16384), (64, 4096), (64, 65536)]
    rows, ok = [], True
    for batch, max_len in cases:
        state = _state(batch, max_len, device, g)
        ref = _all(reference, state, max_len)
        with torch.no_grad():
            got = _all(kernel, state, max_len)
        same = all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
        ok &= same
        sets = [_state(batch, max_len, device, g) for _ in range(2 if smoke else 8)]
        kernel_us = time_us([lambda s=s, n=max_len: _all(kernel, s, n) for s in sets], device)
        chain_us = time_us([lambda s=s, n=max_len: _all(reference, s, n) for s in sets], device)
        rows.append(
            {
                "batch": batch,
                "context": max_len,
                "equal": same,
                "kernel_us": kernel_us,
                "chain_us": chain_us,
                "speedup": chain_us / kernel_us,
            }
        )
    return {
        "benchmark": "kernel_decode_index",
        "smoke": smoke,
        "all_checks_ok": ok,
        "cases": rows,
        "decode_index_vs_torch_B1": rows[0]["speedup"],
    }


# The ratios this benchmark puts in its suite's `ratios` table.
HEADLINE = ("decode_index_vs_torch_B1",)
