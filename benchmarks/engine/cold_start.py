"""First-request TTFT after a cold start against steady TTFT, and what the warm-up costs.

Two fresh processes start an engine on the same checkpoint, one after the other, sharing one
empty kernel cache directory: the first compiles every kernel variant during its warm-up (a
node's first replica), the second loads them from disk (every later replica or restart). In
each, after the warm-up, prompts of 4K / 16K / 64K tokens are sent one at a time: the first at
each length against the median of the next two (different prompts, so no prefix is cached),
then prompts of random lengths; Triton's cache misses are counted over all of them (a miss on
the request path is a compilation, or a disk load, that a user waited for).

Headline: `first_start_s` and `second_start_s`, each engine's `Engine.from_pretrained` wall time
(the second sharing the first's kernel cache), recorded whenever both engines served every prompt;
each child also splits its start into `phases`: the checkpoint load, the decode-graph captures, the
warm-up's synthetic steps, and the rest (pools, plan).

Where a second start goes, profiled on a CPU with the tiny checkpoint (cProfile over
`from_pretrained`): the warm-up's synthetic general steps are nearly all of it, the checkpoint load
and the rest a few seconds; no kernel is compiled or loaded on that path (PyTorch), so the second
start costs what the first does. Each synthetic step's logits were also sampled twice (greedy and
filtered) through the sampler's PyTorch reference, which compiles nothing: a large share of the
warm-up's time. The warm-up now samples only with the sampler's kernels and once per row count
(`replicas/warmup.py`), the launches following the logits' shape alone. On a GPU the same
`phases` say how a second start divides between loading the slice, capturing the eight decode
graphs and the warm-up's steps, whose kernels then come from the disk cache (`kernel_loads`).

    python -m benchmarks run engine --only cold_start [--set model=DIR] [--set contexts=4096,16384,65536]

Without `model` it serves the slice checkpoint (`slice_checkpoint.cached_slice`); a smoke run serves
the tiny checkpoint on the CPU at 256 / 512 tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..lib.context import Context

DEVICE = "cuda"

MAX_MODEL_LEN = 65536 + 1024
SMOKE_MAX_MODEL_LEN = 2048  # --smoke: the tiny checkpoint on the CPU, to check the script itself


def engine_settings(smoke: bool = False) -> dict[str, Any]:
    """The engine the platform runs for the slice (serve_gpu uses the same)."""
    from antumbra.config import CacheConfig, SchedulerConfig

    max_len = SMOKE_MAX_MODEL_LEN if smoke else MAX_MODEL_LEN
    return {
        "device": "cpu" if smoke else "cuda",
        "dtype": "float32" if smoke else "bfloat16",
        "scheduler": SchedulerConfig(max_num_seqs=32, max_model_len=max_len, max_num_batched_tokens=2048),
        "cache": CacheConfig(num_virtual_tokens=4 * max_len),
        "warmup": "on",
    }


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (length,), generator=g).tolist()


async def _ttft_s(engine: Any, prompt: list[int]) -> float:
    from antumbra import SamplingParams

    started = time.perf_counter()
    first = None
    async for out in engine.stream(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)):
        if first is None and out.new_token_ids:
            first = time.perf_counter() - started
    assert first is not None
    return first


@contextlib.contextmanager
def _phase_timer(phases: dict[str, float]) -> Iterator[None]:
    """Seconds spent in the start-up's checkpoint load and decode-graph capture, by wrapping the
    two calls `Engine.__init__` / `from_pretrained` make (the warm-up reports its own)."""
    from antumbra.replicas import decode_graphs
    from antumbra.replicas.engine import engine as engine_module

    targets = [("load_s", engine_module, "load_model"),
               ("capture_s", decode_graphs.DecodeGraphs, "capture_all")]
    saved = [(owner, name, getattr(owner, name)) for _, owner, name in targets]

    def timed(label: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            started = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[label] = phases.get(label, 0.0) + time.monotonic() - started
        return call

    for (label, owner, name), (_, _, fn) in zip(targets, saved, strict=True):
        setattr(owner, name, timed(label, fn))
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def child(model: str, contexts: list[int], smoke: bool) -> dict[str, Any]:
    from antumbra import Engine
    from antumbra.kernels.variants import compile_watch

    phases: dict[str, float] = {}
    started = time.monotonic()
    with _phase_timer(phases):
        engine = Engine.from_pretrained(model, **engine_settings(smoke))
    result: dict[str, Any] = {"start_s": time.monotonic() - started}
    warm = engine.warmup
    assert warm is not None, "the warm-up is on for CUDA engines"
    result["warmup"] = {"seconds": warm.seconds, "steps": warm.num_steps, "kernel_loads": warm.kernel_loads}
    phases["warmup_s"] = warm.seconds
    phases["other_s"] = result["start_s"] - sum(phases.values())
    result["phases"] = phases
    vocab = engine.model_config.vocab_size
    ttft: dict[str, Any] = {}
    with compile_watch() as watch:
        for ctx in contexts:
            first = asyncio.run(_ttft_s(engine, _prompt(vocab, ctx, seed=ctx)))
            steady = [asyncio.run(_ttft_s(engine, _prompt(vocab, ctx, seed=ctx + i))) for i in (1, 2)]
            ttft[f"ctx{ctx}"] = {"first_s": first, "steady_s": statistics.median(steady),
                                 "first_vs_steady": first / statistics.median(steady)}
        g = torch.Generator().manual_seed(99)
        lengths = torch.randint(100, engine.max_model_len - 100, (4,), generator=g).tolist()
        for n in lengths:
            asyncio.run(_ttft_s(engine, _prompt(vocab, n, seed=n)))
    result["ttft"] = ttft
    result["random_lengths"] = lengths
    result["misses_after_warmup"] = watch.count
    result["missed_kernels"] = sorted({str(e) for e in watch.events})[:20]
    engine.check_integrity()
    return result


def run(ctx: Context) -> dict[str, Any]:
    """Options: model (a checkpoint directory), contexts."""
    contexts = ctx.option("contexts", [256, 512] if ctx.smoke else [4096, 16384, 65536])
    with tempfile.TemporaryDirectory() as tmp:
        return _measure(_model(ctx, Path(tmp)), contexts, ctx.smoke)


def _model(ctx: Context, tmp: Path) -> str:
    if ctx.option("model", ""):
        return ctx.option("model", "")
    if ctx.smoke:
        from antumbra.replicas.model.tiny import make_tiny_checkpoint

        return str(make_tiny_checkpoint(tmp / "tiny"))
    from .slice_checkpoint import cached_slice

    return str(cached_slice(ctx.device, smoke=False))


def _measure(model: str, contexts: list[int], smoke: bool) -> dict[str, Any]:
    result: dict[str, Any] = {"model": model, "contexts": contexts, "smoke": smoke,
                              "max_model_len": SMOKE_MAX_MODEL_LEN if smoke else MAX_MODEL_LEN}
    with tempfile.TemporaryDirectory() as cache_dir:
        env = {**os.environ, "ANTUMBRA_KERNEL_CACHE_DIR": cache_dir}
        env.pop("TRITON_CACHE_DIR", None)
        for label in ("cold_cache", "warm_cache"):
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.engine.cold_start", model, ",".join(map(str, contexts)),
                 *(["--smoke"] if smoke else [])],
                env=env, capture_output=True, text=True, timeout=280,
            )
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            result[label] = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
                "error": proc.stderr[-3000:], "returncode": proc.returncode}
    ok = all("ttft" in result[k] for k in ("cold_cache", "warm_cache"))
    result["checks_ok"] = ok and all(
        result[k]["misses_after_warmup"] == 0 for k in ("cold_cache", "warm_cache")
    )
    result["ratios"] = {}
    if ok:  # both engines started, served every prompt and kept their pools intact
        result["ratios"] = {"first_start_s": result["cold_cache"]["start_s"],
                            "second_start_s": result["warm_cache"]["start_s"]}
    if result["checks_ok"]:
        result["ratios"].update({
            f"first_vs_steady_ttft_{k}_{label}": v["first_vs_steady"]
            for label in ("cold_cache", "warm_cache") for k, v in result[label]["ttft"].items()
        })
    return result


if __name__ == "__main__":  # one engine's start-up, in a process of its own: `MODEL CONTEXTS [--smoke]`
    print(json.dumps(child(sys.argv[1], [int(c) for c in sys.argv[2].split(",")], "--smoke" in sys.argv)))
