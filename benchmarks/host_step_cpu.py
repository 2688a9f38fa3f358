"""The host's work per decode step at batch N, on the CPU, with the model's forward made trivial.

    python -m benchmarks.host_step_cpu [--batch 1] [--steps 2000] [--reps 5] [--profile]

The tiny checkpoint runs with the fixed-shape decode step and overlapped scheduling; in this script
only, the decode step's forward returns a fixed logits row and the race writes a counter's next token
id in place of a draw, so what a step costs is the host's part alone: scheduling, the launch's
bookkeeping and input writes, reading the tokens back, applying them, the snapshots and, through
the public API, the driver's handoff to the output thread and that thread's work.

Two measures, each the median over `--reps` runs:
* `core_step_us`: `EngineCore.step()` driven by hand, `--batch` requests decoding, per step; each
  part timed by a perf_counter wrapper around it (`parts_us`; the wrappers' own cost is in the total;
  `parts_cpu_us`: the thread's CPU time in each part).
* `core_step_cpu_us`: the same loop's CPU time on its thread, per step (what a loaded machine's
  other jobs do not inflate, unlike the wall-clock figures).
* `api_step_us`: `Engine.generate` of `--batch` prompts of 1 + N tokens minus the same of 1 token,
  over N (the driver, its lock and condition, the output thread's detokenizing and sinks included),
  as the H200 decode A/B does.
`--profile` prints cProfile's top functions of the core loop by own time. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import itertools
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .lib.timing import Parts

PROMPT = list(range(1000, 1000 + 300))


def _engine(path: Path, max_len: int, batch: int = 1) -> Any:
    from antumbra import Engine
    from antumbra.config import FastPathConfig, SchedulerConfig

    seqs = max(4, batch)
    return Engine.from_pretrained(
        path, device="cpu", dtype="float32", warmup="off",
        scheduler=SchedulerConfig(max_model_len=max_len, max_num_seqs=seqs),
        fast=FastPathConfig(decode="on", cuda_graph_batch_sizes=tuple(sorted({1, 4, batch})),
                            overlap_schedule=True),
    )


def _stub_forward(engine: Any, device_us: float = 0.0) -> None:
    """The decode step's forward and race made trivial (this script's engine only). With
    `device_us`, a device is imitated: each launched step is done `device_us` after the later of
    its launch and the previous step's end, and reading its tokens back sleeps until then (the GIL
    released, as a CUDA event's wait releases it)."""
    fast = engine.runner.fast
    overlap = engine.core.overlap
    cfg = engine.core.model_config
    logits = torch.zeros(fast.max_batch_size, cfg.vocab_size)
    streams = torch.zeros(fast.max_batch_size, cfg.hc_mult, cfg.hidden_size)
    drawn = itertools.count()
    done_at = [0.0]  # when the device finishes the last launched step
    ready: dict[int, float] = {}

    def race(logits: torch.Tensor, size: int) -> None:
        # Ordinary text tokens, each different (the detokenizer's window slides as in real text).
        fast.race.tokens[:size].fill_(1000 + next(drawn) % 20000)
        done_at[0] = max(time.perf_counter(), done_at[0]) + device_us * 1e-6

    def launch(*args: Any, **kwargs: Any) -> Any:
        launched = fast_launch(*args, **kwargs)
        ready[id(launched)] = done_at[0]
        return launched

    def resolve() -> Any:
        flight = overlap.inflight
        if flight is not None:
            wait = ready.pop(id(flight.launched), 0.0) - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
        return overlap_resolve()

    fast._eager_streams = lambda size: (logits[:size], streams[:size])
    fast.race.race = race
    if device_us > 0:
        engine.driver.hold_outputs = True  # as on a GPU: a launched step runs while the host waits
        fast_launch, overlap_resolve = fast.launch, overlap.resolve
        fast.launch = launch
        overlap.resolve = resolve


def _instrument(engine: Any, parts: Parts) -> None:
    from antumbra.replicas import core as core_module

    core = engine.core
    overlap = core.overlap
    fast = engine.runner.fast
    core.step = parts.wrap("step", core.step)
    overlap.can_continue = parts.wrap("can_continue", overlap.can_continue)
    core.scheduler.schedule = parts.wrap("schedule", core.scheduler.schedule)
    core.runner.launch = parts.wrap("launch_total", core.runner.launch)
    fast.launch = parts.wrap("graphs_launch", fast.launch)
    overlap.resolve = parts.wrap("readback", overlap.resolve)
    core.scheduler.update_from_output = parts.wrap("update_from_output", core.scheduler.update_from_output)
    core_module.snapshot = parts.wrap("snapshot", core_module.snapshot)


def _decode_requests(engine: Any, tokens: int, batch: int) -> list[str]:
    """`batch` requests decoding together, in the overlapped steady state."""
    from antumbra import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    rids = [engine.core.add_request(PROMPT, params) for _ in range(batch)]
    while not all(engine.core.requests[rid].output_token_ids for rid in rids):
        engine.core.step()
    for _ in range(3):  # into the overlapped steady state
        engine.core.step()
    return rids


def _abort_all(engine: Any, rids: list[str]) -> None:
    for rid in rids:
        engine.core.abort(rid)
    engine.core.drain()
    engine.core.stash = []


def core_steps(engine: Any, steps: int, parts: Parts, batch: int = 1) -> dict[str, Any]:
    rids = _decode_requests(engine, steps + 50, batch)
    parts.reset()
    start, start_cpu = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        engine.core.step()
    total, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
    _abort_all(engine, rids)
    return {"loop_us": total * 1e6 / steps, "loop_cpu_us": cpu * 1e6 / steps,
            "parts_us": _per_step(parts.seconds, steps), "parts_cpu_us": _per_step(parts.cpu_seconds, steps)}


def _per_step(seconds: dict[str, float], steps: int) -> dict[str, float]:
    us = {k: v * 1e6 / steps for k, v in seconds.items()}
    launch = us.get("launch_total", 0.0)
    us["launch_bookkeeping"] = launch - us.get("graphs_launch", 0.0) - us.get("readback", 0.0)
    named = ("can_continue", "schedule", "launch_total", "update_from_output", "snapshot")
    us["step_rest"] = us.get("step", 0.0) - sum(us.get(k, 0.0) for k in named)
    return us


def _instrument_driver(engine: Any, parts: Parts) -> None:
    driver = engine.driver
    driver._dispatch = parts.wrap("dispatch", driver._dispatch)
    driver._deliver_all = parts.wrap("output_thread", driver._deliver_all)
    driver.texts.process = parts.wrap("text_process", driver.texts.process)
    driver._apply = parts.wrap("driver_apply", driver._apply)
    driver._run_due_updates = parts.wrap("due_updates", driver._run_due_updates)
    engine.core.step = parts.wrap("core_step", engine.core.step)


class Collections:
    """Garbage collections, per generation, and the seconds they took."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = 0.0
        self._start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._start


def api_step_us(engine: Any, new_tokens: int, batch: int = 1) -> float:
    from antumbra import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    many = SamplingParams(max_tokens=1 + new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.generate([PROMPT] * batch, one)
    short = time.perf_counter() - start
    start = time.perf_counter()
    engine.generate([PROMPT] * batch, many)
    long = time.perf_counter() - start
    return (long - short) * 1e6 / new_tokens


def profile(engine: Any, steps: int, batch: int = 1) -> None:
    rids = _decode_requests(engine, steps + 50, batch)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.core.step()
    prof.disable()
    _abort_all(engine, rids)
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


def _device_steps(path: Path, max_len: int, args: argparse.Namespace) -> dict[str, Any]:
    """`api_step_us` with the imitated device."""
    timed = _engine(path, max_len, args.batch)
    _stub_forward(timed, args.device_us)
    timed.generate([PROMPT], None)
    steps = [api_step_us(timed, args.steps, args.batch) for _ in range(args.reps)]
    timed.shutdown()
    return {"device_api_step_us": statistics.median(steps), "device_api_step_us_all": steps}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=1, help="requests decoding at once")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--device-only", action="store_true", help="time `device_api_step_us` alone")
    parser.add_argument("--device-us", type=float, default=400.0,
                        help="the imitated device's step for `device_api_step_us`")
    args = parser.parse_args()
    from antumbra.replicas.model.tiny import make_tiny_checkpoint

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "tiny")
        max_len = len(PROMPT) + args.steps + 256
        if args.device_only:
            timed = _device_steps(path, max_len, args)
            print(json.dumps({"batch": args.batch, "device_us": args.device_us, **timed}))
            return
        batch = args.batch
        plain = _engine(path, max_len, batch)
        _stub_forward(plain)
        plain.generate([PROMPT], None)  # the prompt's pages cached, the driver's threads started
        api = [api_step_us(plain, args.steps, batch) for _ in range(args.reps)]
        device_api = _device_steps(path, max_len, args)["device_api_step_us_all"]
        collections = Collections()
        api_step_us(plain, args.steps, batch)
        gcs = [c * 1000 / args.steps for c in collections.count]
        gc.callbacks.remove(collections._on_gc)
        driver_parts = Parts()
        _instrument_driver(plain, driver_parts)
        api_step_us(plain, args.steps, batch)
        plain.shutdown()
        measured = _engine(path, max_len, batch)
        _stub_forward(measured)
        if args.profile:
            profile(measured, args.steps, batch)
        parts = Parts()
        _instrument(measured, parts)
        loop_plain = _engine(path, max_len, batch)
        _stub_forward(loop_plain)
        loops = [core_steps(loop_plain, args.steps, Parts(), batch) for _ in range(args.reps)]
        loop, loop_cpu = [r["loop_us"] for r in loops], [r["loop_cpu_us"] for r in loops]
        runs = [core_steps(measured, args.steps, parts, batch) for _ in range(args.reps)]
    names = sorted(runs[0]["parts_us"])
    print(json.dumps({
        "batch": args.batch, "steps": args.steps, "reps": args.reps,
        "api_step_us": statistics.median(api), "api_step_us_all": [round(x, 1) for x in api],
        "core_step_us": statistics.median(loop), "core_step_us_all": [round(x, 1) for x in loop],
        "core_step_cpu_us": statistics.median(loop_cpu),
        "device_us": args.device_us, "device_api_step_us": statistics.median(device_api),
        "device_api_step_us_all": [round(x, 1) for x in device_api],
        "gc_per_1000_steps": gcs, "api_parts_us": {
            k: round(v * 1e6 / (args.steps + 1), 2) for k, v in driver_parts.seconds.items()},
        "parts_us": {n: round(statistics.median(r["parts_us"].get(n, 0.0) for r in runs), 2) for n in names},
        "parts_cpu_us": {
            n: round(statistics.median(r["parts_cpu_us"].get(n, 0.0) for r in runs), 2) for n in names},
    }))


if __name__ == "__main__":
    main()
