"""A light tenant's time to first token beside a heavy one, with fair share and with FIFO.

The tiny checkpoint on the CPU, one engine stepped by hand (64-token steps, 16 sequences). The
heavy tenant keeps `HEAVY_OUTSTANDING` requests of `HEAVY_PROMPT` tokens in the engine all the
time (a finished one is replaced at once): a tenant within any rate limit that still sends 10x
the tokens. The light tenant sends a `LIGHT_PROMPT`-token request every `LIGHT_EVERY` steps. Its
p50 TTFT (arrival in the engine to the first token, wall clock) is compared with its solo run
(the same arrivals, no heavy tenant), per scheduling policy, over `--runs` repetitions; each
repetition runs solo, fair share and FIFO back to back so that a slow spell of the machine
touches all three. Also reported: the light p50 in steps (scheduling alone, free of step cost) and
the heavy tenant's share of the tokens served.

    python -m benchmarks.fairness_cpu [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .lib.records import RESULTS_DIR, provenance

HEAVY_PROMPT, LIGHT_PROMPT, MAX_TOKENS = 160, 16, 4
HEAVY_OUTSTANDING = 16
LIGHT_REQUESTS, LIGHT_EVERY, LIGHT_START = 12, 3, 4
MAX_STEPS = 400
SCHEDULER = {"max_num_batched_tokens": 64, "max_num_seqs": 16, "max_model_len": 512}


def run_once(model: Path, policy: str, heavy: bool, seed: int) -> dict[str, Any]:
    """One run; -> the light requests' TTFTs (seconds and steps) and the heavy share served."""
    from antumbra import Engine, SamplingParams
    from antumbra.config import SchedulerConfig
    from antumbra.replicas.tenancy import Tenancy

    core = Engine.from_pretrained(model, scheduler=SchedulerConfig(**SCHEDULER, policy=policy)).core
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    rng = random.Random(seed)
    tenants = {"heavy": (Tenancy("heavy"), HEAVY_PROMPT), "light": (Tenancy("light"), LIGHT_PROMPT)}

    def submit(name: str) -> Any:
        tenancy, length = tenants[name]
        request = core.make_request([rng.randrange(1, 500) for _ in range(length)], params, tenancy=tenancy)
        core.add(request)
        return request

    heavy_live: list[Any] = []
    light: list[tuple[Any, int]] = []  # (request, step it arrived before)
    first_step: dict[str, int] = {}
    served = {"heavy": 0, "light": 0}
    step = 0
    while step < MAX_STEPS and (len(light) < LIGHT_REQUESTS or len(first_step) < LIGHT_REQUESTS):
        if step >= LIGHT_START and (step - LIGHT_START) % LIGHT_EVERY == 0 and len(light) < LIGHT_REQUESTS:
            light.append((submit("light"), step))
        while heavy and len(heavy_live) < HEAVY_OUTSTANDING:
            heavy_live.append(submit("heavy"))
        core.step()
        step += 1
        for request, arrived in light:
            if request.record.first_token_time_s is not None and request.request_id not in first_step:
                first_step[request.request_id] = step - arrived
        for request in [r for r in heavy_live if r.finished]:
            heavy_live.remove(request)
            served["heavy"] += request.num_computed_prompt_tokens + request.num_output_tokens
    served["light"] = sum(r.num_computed_prompt_tokens + r.num_output_tokens for r, _ in light)
    done = [r for r, _ in light if r.record.first_token_time_s is not None]
    return {
        "ttft_s": [r.record.first_token_time_s - r.arrival_time_s for r in done],
        "ttft_steps": list(first_step.values()),
        "light_without_first_token": LIGHT_REQUESTS - len(done),
        "heavy_token_share": served["heavy"] / max(1, sum(served.values())),
        "steps": step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    from antumbra.replicas.model.tiny import make_tiny_checkpoint

    torch.set_num_threads(2)
    runs: dict[str, list[dict[str, Any]]] = {"solo": [], "fair_share": [], "fifo": []}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_checkpoint(Path(tmp) / "tiny")
        run_once(model, "fair_share", heavy=False, seed=99)  # warm-up, not counted
        for seed in range(args.runs):
            runs["solo"].append(run_once(model, "fair_share", heavy=False, seed=seed))
            for policy in ("fair_share", "fifo"):
                runs[policy].append(run_once(model, policy, heavy=True, seed=seed))
    result: dict[str, Any] = {
        **provenance("cpu"), "scheduler": SCHEDULER,
        "heavy_prompt": HEAVY_PROMPT, "light_prompt": LIGHT_PROMPT,
        "max_tokens": MAX_TOKENS, "heavy_outstanding": HEAVY_OUTSTANDING, "light_requests": LIGHT_REQUESTS,
        "light_every_steps": LIGHT_EVERY, "runs": args.runs, "seconds": time.perf_counter() - started,
    }
    ratios: dict[str, Any] = {}
    for name, per_run in runs.items():
        p50s = [statistics.median(r["ttft_s"]) for r in per_run]
        result[name] = {
            "light_p50_ttft_s": p50s,
            "light_p50_ttft_steps": [statistics.median(r["ttft_steps"]) for r in per_run],
            "heavy_token_share": [r["heavy_token_share"] for r in per_run],
            "light_without_first_token": sum(r["light_without_first_token"] for r in per_run),
        }
        if name != "solo":
            vs_solo = [p / s for p, s in zip(p50s, result["solo"]["light_p50_ttft_s"], strict=True)]
            ratios[f"light_p50_ttft_vs_solo_{name}"] = {
                "median": statistics.median(vs_solo), "min": min(vs_solo), "max": max(vs_solo),
                "runs": vs_solo,
            }
    result["ratios"] = ratios
    for name, figure in ratios.items():
        print(f"{name}: {figure['median']:.2f}x (range {figure['min']:.2f}-{figure['max']:.2f} over "
              f"{args.runs} runs)")
    out = RESULTS_DIR / "fairness.json"  # one current file; history is git's
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(out)


if __name__ == "__main__":
    main()
