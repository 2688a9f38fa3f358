"""Sampling on the GPU: the same tokens as the CPU, and the race kernel against torch.

1. On the tiny checkpoint, the GPU engine (decode graphs, and the general step) against the CPU
   fp32 engine over 32 tokens on five prompts: greedy, seeded temperature 1, and seeded
   temperature 0.8 with top-p 0.9 / top-k 50; and unseeded temperature-1 requests that must
   simply run (OpenAI's default).
2. The Gumbel race kernel at the V4 vocabulary (129280) for batch 1 / 8 / 32 / 64: tokens equal
   to its PyTorch reference run on the same GPU, and its time against the torch chain it replaces
   (softmax, exponential draws, argmax) and against its byte floor (the logits read once, at the
   copy rate measured in the same run).

3. The sampler with penalties against without at B32 over the V4 vocabulary: every row with
   presence / frequency / repetition penalties over a 1024-token prompt and 256 generated tokens,
   ten logit biases, min_p 0.05 and a min_tokens ban (the fused race over adjusted logits), against
   the same rows at temperature 1 only (the plain race), both through `Sampler.sample_tokens` as
   the engine calls it (eager: the step's entries are copied to the device in the call). Tokens
   are checked against the sampler's PyTorch path on the same GPU; the host's time to build the
   step's rows (`SamplingRows.build`) is reported beside, not in the ratio. Ratio
   `penalties_vs_plain_sampler_B32`.

    python -m benchmarks.sampling_gpu              # all three
    python -m benchmarks.sampling_gpu --penalties  # the third alone
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


def penalties_sampler(device: str, batch: int = 32, vocab: int = VOCAB) -> dict[str, Any]:
    """Section 3 of the module docstring (a smaller `vocab` for a smoke run in the interpreter)."""
    import time

    from antumbra import SamplingParams
    from antumbra.replicas.penalties import TokenCounts
    from antumbra.replicas.sampler import Sampler, SamplingRows

    g = torch.Generator().manual_seed(batch)
    sets = min(64, max(2, -(-256_000_000 // (batch * vocab * 4))))
    inputs = [torch.randn(batch, vocab, device=device) * 4 for _ in range(sets)]
    histories, outputs = [], []
    for _ in range(batch):
        prompt = torch.randint(0, vocab, (1024,), generator=g).tolist()
        outputs.append(torch.randint(0, vocab, (255,), generator=g).tolist())
        histories.append(TokenCounts(prompt).update(outputs[-1]))
    bias = {int(t): 1.5 for t in torch.randint(0, vocab, (10,), generator=g)}
    adjusted = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1,
                               logit_bias=bias, min_p=0.05, min_tokens=300, max_tokens=1024, seed=i)
                for i in range(batch)]
    plain = [SamplingParams(seed=i) for i in range(batch)]
    seeds, counts = list(range(batch)), [256] * batch
    SamplingRows.build(adjusted, seeds, counts, histories)  # a request's first step builds its arrays
    for history, output in zip(histories, outputs, strict=True):  # one more token each, as a step adds
        history.update(output + [int(torch.randint(0, vocab, (1,), generator=g))])
    start = time.perf_counter()
    rows = SamplingRows.build(adjusted, seeds, counts, histories)
    build_us = (time.perf_counter() - start) * 1e6  # a later step's build
    plain_rows = SamplingRows.build(plain, seeds, counts)
    eos = (1,)
    kernel, torch_path = Sampler(use_kernel=True), Sampler(use_kernel=False)
    got = kernel.sample_tokens(inputs[0], rows, eos)
    want = torch_path.sample_tokens(inputs[0], rows, eos)
    plain_us = time_us([lambda x=x: kernel.sample_tokens(x, plain_rows, eos) for x in inputs], device,
                       graph=False)
    adjusted_us = time_us([lambda x=x: kernel.sample_tokens(x, rows, eos) for x in inputs], device,
                          graph=False)
    general_us = time_us([lambda x=x: torch_path.sample_tokens(x, rows, eos) for x in inputs], device,
                         graph=False)
    kernels = _kernels_alone(inputs, rows, plain_rows, eos, device)
    return {
        **kernels,
        "batch": batch,
        "entries": rows.penalties.size if rows.penalties is not None else 0,
        "tokens_equal_torch_path": float((got == want).float().mean()),
        "plain_us": plain_us,
        "penalties_us": adjusted_us,
        "torch_path_us": general_us,
        "host_build_us": build_us,
        "penalties_vs_plain": adjusted_us / plain_us,
        "torch_path_vs_plain": general_us / plain_us,
        "input_sets": sets,
    }


def _kernels_alone(inputs: list[torch.Tensor], rows: Any, plain_rows: Any, eos: tuple[int, ...],
                   device: str) -> dict[str, float]:
    """The two races' device time alone (inputs staged on the device first, replayed from a CUDA
    graph): what the fused launches cost over the plain ones, without the host's share."""
    from antumbra.kernels.sampling import (
        AdjustedWorkspace,
        RaceWorkspace,
        entry_segments,
        race_sample,
        race_sample_adjusted,
    )

    batch, vocab = inputs[0].shape
    entries = rows.entries(eos, vocab)
    seg, search = entry_segments(entries.rows, entries.tokens, batch, vocab)
    staged = [t.to(device) for t in (rows.packed, rows.slack, seg, entries.tokens.to(torch.int32),
                                      entries.values)]
    plain_packed = plain_rows.packed.to(device)
    no_cut = torch.full((batch,), float("-inf"), device=device)
    ws, adjusted_ws = RaceWorkspace(batch, vocab, torch.device(device)), AdjustedWorkspace(batch, vocab,
                                                                                           torch.device(device))
    out = torch.empty(batch, dtype=torch.int64, device=device)
    plain_us = time_us([lambda x=x: race_sample(x, plain_packed, no_cut, out=out, workspace=ws)
                        for x in inputs], device)
    fused_us = time_us([lambda x=x: race_sample_adjusted(x, staged[0], None, staged[1], staged[2], staged[3],
                                                         staged[4], search, out=out, workspace=adjusted_ws)
                        for x in inputs], device)
    return {"kernel_plain_us": plain_us, "kernel_penalties_us": fused_us,
            "kernel_penalties_vs_plain": fused_us / plain_us}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--penalties", action="store_true", help="only the penalties benchmark")
    args = parser.parse_args()
    device = "cuda"
    result: dict[str, Any] = environment()
    if args.penalties:
        result["penalties_sampler"] = pen = penalties_sampler(device)
        result["checks_ok"] = pen["tokens_equal_torch_path"] >= 0.98
        if result["checks_ok"]:
            result["ratios"] = {"penalties_vs_plain_sampler_B32": pen["penalties_vs_plain"]}
        print(json.dumps(pen, indent=1))
        print(write_result("h200-sampling-penalties", result))
        return
    result["copy_gbps"] = copy_gbps(device)
    result["tiny_gpu_vs_cpu"] = tiny_agreement(device)
    result["race_kernel"] = race_kernel(device, result["copy_gbps"])
    result["penalties_sampler"] = pen = penalties_sampler(device)
    kernel_ok = all(v["tokens_equal_reference"] >= 0.98 for v in result["race_kernel"].values())
    result["checks_ok"] = bool(result["tiny_gpu_vs_cpu"]["all_ok"]) and kernel_ok and \
        pen["tokens_equal_torch_path"] >= 0.98
    if result["checks_ok"]:
        result["ratios"] = {
            f"race_vs_torch_chain_{k}": v["vs_torch_chain"] for k, v in result["race_kernel"].items()
        }
        result["ratios"].update({f"race_of_byte_floor_{k}": v.get("of_byte_floor")
                                 for k, v in result["race_kernel"].items()})
        result["ratios"]["penalties_vs_plain_sampler_B32"] = pen["penalties_vs_plain"]
    print(json.dumps({k: result[k] for k in ("checks_ok", "tiny_gpu_vs_cpu")}, indent=1))
    print(json.dumps(result["race_kernel"], indent=1))
    print(json.dumps(pen, indent=1))
    print(write_result("h200-sampling", result))


if __name__ == "__main__":
    main()
