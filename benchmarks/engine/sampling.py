"""Sampling on the GPU: the same tokens as the CPU, and the race kernel against torch.

1. On the tiny checkpoint, the GPU engine (decode graphs, and the general step) against the CPU
   fp32 engine over 32 tokens on five prompts: greedy, seeded temperature 1, and seeded
   temperature 0.8 with top-p 0.9 / top-k 50; and unseeded temperature-1 requests that must
   simply run (OpenAI's default).
2. The Gumbel race kernel at the V4 vocabulary (129280) for batch 1 / 8 / 32 / 64: tokens equal
   to its PyTorch reference run on the same GPU, and its time against the torch chain it replaces
   (softmax, exponential draws, argmax) and against its byte floor (the logits read once, at the
   copy rate measured in the same run).

    python -m benchmarks.sampling_gpu
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from .common import environment, write_result
from .gpu_measure import copy_gbps, time_us

VOCAB = 129280


def tiny_agreement(device: str) -> dict[str, Any]:
    from antumbra import Engine, SamplingParams
    from antumbra.config import FastPathConfig
    from antumbra.replicas.model.tiny import TinyModelSpec, make_tiny_checkpoint

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 261, (n,), generator=g).tolist() for n in (1, 5, 129, 300, 700)]
    modes = {
        "greedy": [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)] * len(prompts),
        "seeded_t1": [
            SamplingParams(max_tokens=32, temperature=1.0, seed=100 + i, ignore_eos=True)
            for i in range(len(prompts))
        ],
        "seeded_top_p_top_k": [
            SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, top_k=50, seed=200 + i, ignore_eos=True)
            for i in range(len(prompts))
        ],
    }
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "model", TinyModelSpec())
        cpu = Engine.from_pretrained(path, device="cpu", dtype="float32")
        for label, fast in (
            ("graphs", FastPathConfig(decode="auto")),
            ("general", FastPathConfig(decode="off")),
        ):
            gpu = Engine.from_pretrained(path, device=device, dtype="float32", fast=fast)
            for mode, params in modes.items():
                want = [o.token_ids for o in cpu.generate(prompts, params)]
                got = [o.token_ids for o in gpu.generate(prompts, params)]
                result[f"{label}_{mode}"] = {"identical": [a == b for a, b in zip(want, got, strict=True)]}
            unseeded = gpu.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
            result[f"{label}_unseeded_t1_ran"] = all(len(o.token_ids) == 16 for o in unseeded)
            fast_steps = gpu.runner.fast.num_steps if gpu.runner.fast else 0
            result[f"{label}_fast_path_steps"] = fast_steps
            gpu.check_integrity()
    result["all_identical"] = all(all(v["identical"]) for k, v in result.items() if isinstance(v, dict))
    result["all_ok"] = result["all_identical"] and result["graphs_unseeded_t1_ran"] and \
        result["general_unseeded_t1_ran"] and result["graphs_fast_path_steps"] > 0
    return result


def race_kernel(device: str, bandwidth_gbps: float | None) -> dict[str, Any]:
    return {f"B{batch}": _race_at(batch, device, bandwidth_gbps) for batch in (1, 8, 32, 64)}


def _race_at(batch: int, device: str, bandwidth_gbps: float | None) -> dict[str, Any]:
    from antumbra.kernels.sampling import RaceWorkspace, pack_rows, race_sample, race_sample_reference

    g = torch.Generator(device=device).manual_seed(batch)
    # Enough distinct logits that repeats do not read them from L2 (60 MB on an H200).
    sets = min(64, max(2, -(-256_000_000 // (batch * VOCAB * 4))))
    inputs = [torch.randn(batch, VOCAB, device=device, generator=g) * 4 for _ in range(sets)]
    rows = pack_rows(list(range(batch)), [7] * batch, [1.0] * batch).to(device)
    cut = torch.full((batch,), float("-inf"), device=device)
    ws = RaceWorkspace(batch, VOCAB, torch.device(device))
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
    if bandwidth_gbps:
        floor_us = batch * VOCAB * 4 / (bandwidth_gbps * 1e3)
        entry["floor_us"] = floor_us
        entry["of_byte_floor"] = floor_us / kernel_us
    return entry


def main() -> None:
    device = "cuda"
    result: dict[str, Any] = {**environment(), "copy_gbps": copy_gbps(device)}
    result["tiny_gpu_vs_cpu"] = tiny_agreement(device)
    result["race_kernel"] = race_kernel(device, result["copy_gbps"])
    kernel_ok = all(v["tokens_equal_reference"] >= 0.98 for v in result["race_kernel"].values())
    result["checks_ok"] = bool(result["tiny_gpu_vs_cpu"]["all_ok"]) and kernel_ok
    if result["checks_ok"]:
        result["ratios"] = {
            f"race_vs_torch_chain_{k}": v["vs_torch_chain"] for k, v in result["race_kernel"].items()
        }
        result["ratios"].update({f"race_of_byte_floor_{k}": v.get("of_byte_floor")
                                 for k, v in result["race_kernel"].items()})
    print(json.dumps({k: result[k] for k in ("checks_ok", "tiny_gpu_vs_cpu")}, indent=1))
    print(json.dumps(result["race_kernel"], indent=1))
    print(write_result("h200-sampling", result))


if __name__ == "__main__":
    main()
