"""The sampler's Gumbel race kernel against torch, at the V4 vocabulary (129280), batch 1 / 8 / 32 / 64:
tokens equal to its PyTorch reference run on the same device, and its time against the torch chain it
replaces (softmax, exponential draws, argmax) and against its byte floor (the logits read once, at the
copy rate measured in the same run). That the engine's sampled tokens on a GPU equal the CPU's is a
GPU-marked test (tests/replicas/test_gpu_paths.py).

Then the sampler with penalties against without at B32 over the V4 vocabulary: every row with
presence / frequency / repetition penalties over a 1024-token prompt and 256 generated tokens, ten
logit biases, min_p 0.05 and a min_tokens ban, each row's counts resident on the device in its slot
of a `PenaltyState` (the race reads them beside the logits), against the same rows at temperature 1
only (the plain race), both through `Sampler.sample_tokens` as the engine calls it (eager: the
rows' keys, slack and slot ids are copied to the device in the call). Tokens are checked against the
sampler's PyTorch path on the same device. Reported beside, not in the ratio: the host's time to
build a later step's rows (`PenaltyState.rows_for` and `SamplingRows.build`: slots already filled),
the first step's (the slots filled from the histories), the device count update after a draw
(`PenaltyState.record`), and plain rows through the slot race against the plain race (what a decode
graph with a penalty state pays on a step without penalties). Ratio `penalties_vs_plain_sampler_B32`.

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




def penalties_sampler(device: str, batch: int = 32, vocab: int = VOCAB) -> dict[str, Any]:
    """Section 3 of the module docstring (a smaller `vocab` for a smoke run in the interpreter)."""
    import time

    from antumbra import SamplingParams
    from antumbra.replicas.penalty_state import PenalisedRow, PenaltyState
    from antumbra.replicas.sampler import Sampler, SamplingRows

    g = torch.Generator().manual_seed(batch)
    sets = min(64, max(2, -(-256_000_000 // (batch * vocab * 4))))
    inputs = [torch.randn(batch, vocab, device=device) * 4 for _ in range(sets)]
    bias = {int(t): 1.5 for t in torch.randint(0, vocab, (10,), generator=g)}
    adjusted = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1,
                               logit_bias=bias, min_p=0.05, min_tokens=300, max_tokens=1024, seed=i)
                for i in range(batch)]
    plain = [SamplingParams(seed=i) for i in range(batch)]
    histories = [PenalisedRow(f"r{i}", p, torch.randint(0, vocab, (1024,), generator=g).tolist(),
                              torch.randint(0, vocab, (255,), generator=g).tolist())
                 for i, p in enumerate(adjusted)]
    seeds, counts, eos = list(range(batch)), [256] * batch, (1,)
    state = PenaltyState(vocab, torch.device(device), eos, max_slots=batch)
    start = time.perf_counter()
    first = SamplingRows.build(adjusted, seeds, [255] * batch, state.rows_for(histories))
    fill_us = (time.perf_counter() - start) * 1e6  # a request's first step fills its slot
    kernel, torch_path = Sampler(use_kernel=True), Sampler(use_kernel=False)
    state.record(kernel.sample_tokens(inputs[-1], first), first.resident)  # one more token each
    start = time.perf_counter()
    rows = SamplingRows.build(adjusted, seeds, counts, state.rows_for(histories))
    build_us = (time.perf_counter() - start) * 1e6  # a later step's build
    plain_rows = SamplingRows.build(plain, seeds, counts)
    got = kernel.sample_tokens(inputs[0], rows)
    want = torch_path.sample_tokens(inputs[0], rows)
    plain_us = time_us([lambda x=x: kernel.sample_tokens(x, plain_rows) for x in inputs], device, graph=False)
    adjusted_us = time_us([lambda x=x: kernel.sample_tokens(x, rows) for x in inputs], device, graph=False)
    general_us = time_us([lambda x=x: torch_path.sample_tokens(x, rows) for x in inputs], device, graph=False)
    kernels = _kernels_alone(inputs, rows, plain_rows, device)
    # Last: it changes the counts the draws above read.
    record_us = time_us([lambda: state.record(got, rows.resident)], device, graph=False)
    return {
        **kernels,
        "batch": batch,
        "listed_tokens_per_row": len(bias) + len(eos),
        "tokens_equal_torch_path": float((got == want).float().mean()),
        "plain_us": plain_us,
        "penalties_us": adjusted_us,
        "torch_path_us": general_us,
        "host_build_us": build_us,
        "host_first_step_fill_us": fill_us,
        "device_record_us": record_us,
        "penalties_vs_plain": adjusted_us / plain_us,
        "torch_path_vs_plain": general_us / plain_us,
        "input_sets": sets,
    }


def _kernels_alone(inputs: list[torch.Tensor], rows: Any, plain_rows: Any, device: str) -> dict[str, float]:
    """The two races' device time alone (inputs staged on the device first, replayed from a CUDA
    graph): what the slot-reading launches cost over the plain ones, without the host's share."""
    from antumbra.kernels.sampling import AdjustedWorkspace, RaceWorkspace, race_sample, race_sample_slots

    batch, vocab = inputs[0].shape
    resident = rows.resident
    packed, slack, slots = (t.to(device) for t in (rows.packed, rows.slack, resident.slots))
    plain_packed = plain_rows.packed.to(device)
    no_cut = torch.full((batch,), float("-inf"), device=device)
    ws = RaceWorkspace(batch, vocab, torch.device(device))
    adjusted_ws = AdjustedWorkspace(batch, vocab, torch.device(device))
    out = torch.empty(batch, dtype=torch.int64, device=device)
    plain_us = time_us([lambda x=x: race_sample(x, plain_packed, no_cut, out=out, workspace=ws)
                        for x in inputs], device)
    fused_us = time_us([lambda x=x: race_sample_slots(x, packed, None, slack, slots, resident.state.tables,
                                                      resident.search, out=out, workspace=adjusted_ws)
                        for x in inputs], device)
    # Plain rows through the slot race, as a decode graph with a penalty state draws them.
    no_slots = torch.full((batch,), -1, dtype=torch.int32, device=device)
    slots_plain_us = time_us([lambda x=x: race_sample_slots(x, plain_packed, None, no_cut, no_slots,
                                                            resident.state.tables, resident.search, out=out,
                                                            workspace=adjusted_ws)
                              for x in inputs], device)
    return {"kernel_plain_us": plain_us, "kernel_penalties_us": fused_us,
            "kernel_penalties_vs_plain": fused_us / plain_us,
            "kernel_slot_race_plain_rows_vs_plain": slots_plain_us / plain_us}


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
    batch = 4 if ctx.smoke else 32
    penalties = result["penalties"] = penalties_sampler(ctx.device, batch=batch, vocab=vocab)
    if penalties["tokens_equal_torch_path"] >= 0.98:
        ratio = penalties["penalties_vs_plain"]
        result.setdefault("ratios", {})[f"penalties_vs_plain_sampler_B{batch}"] = ratio
    else:
        result["checks_ok"] = False
    return result
