"""The sampler's Gumbel race kernel against torch, at the V4 vocabulary (129280), batch 1 / 8 / 32 / 64:
tokens equal to its PyTorch reference run on the same device, and its time against the torch chain it
replaces (softmax, exponential draws, argmax) and against its byte floor (the logits read once, at the
copy rate measured in the same run). That the engine's sampled tokens on a GPU equal the CPU's is a
GPU-marked test (tests/replicas/test_gpu_paths.py).

    python -m benchmarks run engine --only sampling [--smoke]
"""

from __future__ import annotations

from typing import Any

import torch

from ..lib.context import Context
from ..lib.timing import time_us

DEVICE = "cuda"

VOCAB = 129280


def race_kernel(device: str, bandwidth_gbps: float, vocab: int, batches: tuple[int, ...]) -> dict[str, Any]:
    return {f"B{batch}": _race_at(batch, device, bandwidth_gbps, vocab) for batch in batches}


def _race_at(batch: int, device: str, bandwidth_gbps: float, vocab: int) -> dict[str, Any]:
    from antumbra.kernels.sampling import RaceWorkspace, pack_rows, race_sample, race_sample_reference

    g = torch.Generator(device=device).manual_seed(batch)
    # Enough distinct logits that repeats do not read them from L2 (60 MB on an H200).
    sets = min(64, max(2, -(-256_000_000 // (batch * vocab * 4))))
    inputs = [torch.randn(batch, vocab, device=device, generator=g) * 4 for _ in range(sets)]
    rows = pack_rows(list(range(batch)), [7] * batch, [1.0] * batch).to(device)
    cut = torch.full((batch,), float("-inf"), device=device)
    ws = RaceWorkspace(batch, vocab, torch.device(device))
    tokens = torch.empty(batch, dtype=torch.int64, device=device)
    got = race_sample(inputs[0], rows, cut, out=tokens, workspace=ws).clone()
    want = race_sample_reference(inputs[0], rows, cut)
    kernel_us = time_us(
        [lambda x=x: race_sample(x, rows, cut, out=tokens, workspace=ws) for x in inputs], device
    )

    def chain(x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(x, dim=-1)
        return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)

    chain_us = time_us([lambda x=x: chain(x) for x in inputs], device)
    entry: dict[str, Any] = {
        "tokens_equal_reference": float((got == want).float().mean()),
        "kernel_us": kernel_us,
        "torch_chain_us": chain_us,
        "vs_torch_chain": chain_us / kernel_us,
        "input_sets": sets,
    }
    floor_us = batch * vocab * 4 / (bandwidth_gbps * 1e3)
    entry["floor_us"] = floor_us
    entry["of_byte_floor"] = floor_us / kernel_us
    return entry


def run(ctx: Context) -> dict[str, Any]:
    vocab, batches = (1024, (1, 4)) if ctx.smoke else (VOCAB, (1, 8, 32, 64))
    result: dict[str, Any] = {"vocab": vocab, "race_kernel": race_kernel(ctx.device, ctx.rates.copy_gbps,
                                                                         vocab, batches)}
    result["checks_ok"] = all(v["tokens_equal_reference"] >= 0.98 for v in result["race_kernel"].values())
    if result["checks_ok"]:
        rows = result["race_kernel"].items()
        result["ratios"] = {f"race_vs_torch_chain_{k}": v["vs_torch_chain"] for k, v in rows}
        result["ratios"].update({f"race_of_byte_floor_{k}": v["of_byte_floor"]
                                 for k, v in rows})
    return result
