"""Where a step that carries a prompt chunk spends its time, on the 4-layer V4-Flash slice.

A decoding request's inter-token latency is the length of the steps it rides in; while prompts
arrive those steps carry prompt chunks (the general step) beside the decodes. Measured here:

* `chunk_ms`: one request whose prompt's first `ctx` tokens are cached and whose last n are not
  (n in `chunks`): the time to its first token, i.e. one general step over an n-token chunk at that
  context, nothing else running;
* `mixed_ms`: the same chunk in a step beside `decodes` decoding requests, against the pure decode
  step of those requests (`decode_ms`); the step is timed from before `EngineCore.step` to the device
  drained after it, the previous step drained first;
* with `prefill_rows` R > 0 the engine runs a step whose prompt chunk holds at most R tokens on the
  decode graphs, each prompt token a row (`FastPathConfig.prefill_rows`): `mixed_rows` says which
  of the `mixed_ms` steps ran so;
* `profile`: for the chunk of `profile_chunk` tokens, the host's time (cProfile, functions above
  200 us, microseconds of the one step) and the device's kernels (time per kernel name, busy time
  against wall time);
* `profile_mixed` (with `profile_mixed` n > 0): the same for one step of the n-token chunk beside the
  decodes, which runs as prompt rows where n is at most `prefill_rows` (`ran_as_rows` says so).

The least time a chunk's step can take is its decodes' step plus the chunk's share of the prefill
rate: `prefill_us_per_token` is the slope between the largest two chunks.

Options (`--set name=value`): ctx, chunks, decodes, decode_ctx, reps, profile_chunk, profile_mixed,
prefill_rows.
"""

from __future__ import annotations

import cProfile
import time
from typing import Any

import torch

from ..lib.context import Context
from ..lib.slices import SMOKE_SLICE, SliceSpec, build_engine, build_hf, free_engine, prompts
from ..lib.timing import guarded, sync
from .slice_steps import cprofile_rows, kernel_events

DEVICE = "cuda"


def run(ctx: Context) -> dict[str, Any]:
    device, small = ctx.device, ctx.smoke
    dtype = "bfloat16" if ctx.on_gpu else "float32"
    spec = SMOKE_SLICE if small else SliceSpec()
    s = {
        "ctx": ctx.option("ctx", 256 if small else 16384),
        "chunks": ctx.option("chunks", [1, 16] if small else [1, 16, 128, 512, 2048]),
        "decodes": ctx.option("decodes", 4 if small else 32),
        "decode_ctx": ctx.option("decode_ctx", 128 if small else 2048),
        "reps": ctx.option("reps", 1 if small else 3),
        "profile_chunk": ctx.option("profile_chunk", 16 if small else 128),
        "prefill_rows": ctx.option("prefill_rows", 0),
        "profile_mixed": ctx.option("profile_mixed", 0),
    }
    result: dict[str, Any] = {"slice": {"layers": len(spec.layer_types)}, "settings": s}
    hf = build_hf(spec, device, getattr(torch, dtype))
    longest = s["ctx"] + max(s["chunks"]) + 64
    engine = build_engine(hf, device, dtype, max_model_len=longest, max_num_seqs=s["decodes"] + 2,
                          num_virtual_tokens=4 * longest + (s["decodes"] + 2) * (s["decode_ctx"] + 256),
                          prefill_rows=s["prefill_rows"])
    del hf
    try:
        base = prompts(spec.vocab_size, 1, s["ctx"], seed=11)[0]
        result["chunk_ms"] = guarded(lambda: _chunks(engine, base, s, spec.vocab_size, device))
        result["mixed_ms"] = guarded(lambda: _mixed(engine, base, s, spec.vocab_size, device))
        rows = result["mixed_ms"].pop("rows", None) if isinstance(result["mixed_ms"], dict) else None
        if s["prefill_rows"]:
            result["mixed_rows"] = rows
        result["profile"] = guarded(lambda: _profile(engine, base, s, spec.vocab_size, device))
        if s["profile_mixed"]:
            result["profile_mixed"] = guarded(
                lambda: _profile_mixed(engine, base, s, spec.vocab_size, device))
    finally:
        free_engine(engine)
    return result


def _tail(vocab: int, n: int, seed: int) -> list[int]:
    return prompts(vocab, 1, n, seed=1000 + seed)[0]


def _cache(engine: Any, base: list[int]) -> None:
    from antumbra import SamplingParams

    engine.generate([base], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))


def _first_token_ms(engine: Any, prompt: list[int], device: str) -> float:
    """Stepped on this thread (not the engine's driver), so that a profiler here sees the step."""
    from antumbra import SamplingParams

    core = engine.core
    sync(device)
    start = time.perf_counter()
    rid = core.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while rid in core.requests and not core.requests[rid].finished:
        core.step()
    core.drain()
    sync(device)
    return (time.perf_counter() - start) * 1e3


def _chunks(engine: Any, base: list[int], s: dict[str, Any], vocab: int, device: str) -> dict[str, Any]:
    engine.clear_cache()
    _cache(engine, base)
    out: dict[str, Any] = {}
    for n in s["chunks"]:
        _first_token_ms(engine, base + _tail(vocab, n, 0), device)  # compiles what this size needs
        runs = [_first_token_ms(engine, base + _tail(vocab, n, 1 + r), device) for r in range(s["reps"])]
        out[f"n{n}"] = min(runs)
    sizes = sorted(s["chunks"])
    if len(sizes) >= 2:
        a, b = sizes[-2], sizes[-1]
        out["prefill_us_per_token"] = (out[f"n{b}"] - out[f"n{a}"]) * 1e3 / (b - a)
    return out


def _step_ms(engine: Any, device: str) -> float:
    engine.core.drain()
    sync(device)
    start = time.perf_counter()
    engine.core.step()
    engine.core.drain()
    sync(device)
    return (time.perf_counter() - start) * 1e3


def _chunk_step_ms(engine: Any, prompt: list[int], device: str) -> tuple[float, bool]:
    """The step that takes `prompt`'s uncached chunk beside the decoding requests -> (its ms, whether
    it ran as prompt rows); the prompt's request is then stepped to its end."""
    from antumbra import SamplingParams

    core = engine.core
    rid = core.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    row_steps = engine.runner.num_prompt_row_steps
    took = _step_ms(engine, device)
    as_rows = engine.runner.num_prompt_row_steps > row_steps
    while rid in core.requests and not core.requests[rid].finished:
        core.step()
    return took, as_rows


def _mixed(engine: Any, base: list[int], s: dict[str, Any], vocab: int, device: str) -> dict[str, Any]:
    core = engine.core
    rids = _decoding(engine, base, s, vocab, device)
    try:
        decode = sorted(_step_ms(engine, device) for _ in range(8))
        out: dict[str, Any] = {"decode_ms": decode[len(decode) // 2], "rows": {}}
        for n in s["chunks"]:
            # the first compiles what this size needs
            runs = [_chunk_step_ms(engine, base + _tail(vocab, n, 50 + r), device)
                    for r in range(1 + s["reps"])]
            out[f"n{n}"] = min(ms for ms, _ in runs[1:])
            out["rows"][f"n{n}"] = runs[-1][1]
        return out
    finally:
        for r in rids:
            core.abort(r)
        engine.core.drain()


def _decoding(engine: Any, base: list[int], s: dict[str, Any], vocab: int, device: str) -> list[str]:
    """`base` cached and `decodes` requests decoding (a few steps settled) -> their ids."""
    from antumbra import SamplingParams

    engine.clear_cache()
    _cache(engine, base)
    decoding = prompts(vocab, s["decodes"], s["decode_ctx"], seed=23)
    params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    core = engine.core
    rids = [core.add_request(p, params) for p in decoding]
    while not all(core.requests[r].output_token_ids for r in rids):
        core.step()
    for _ in range(4):
        _step_ms(engine, device)
    return rids


def _profile(engine: Any, base: list[int], s: dict[str, Any], vocab: int, device: str) -> dict[str, Any]:
    n = s["profile_chunk"]
    engine.clear_cache()
    _cache(engine, base)
    _first_token_ms(engine, base + _tail(vocab, n, 70), device)

    def one(seed: int) -> float:
        return _first_token_ms(engine, base + _tail(vocab, n, seed), device)

    return {"chunk": n, **_profiled(one, device)}


def _profile_mixed(engine: Any, base: list[int], s: dict[str, Any], vocab: int, device: str
                   ) -> dict[str, Any]:
    """One step of a `profile_mixed`-token chunk beside the decodes, profiled as `_profile` does."""
    n, core = s["profile_mixed"], engine.core
    rids = _decoding(engine, base, s, vocab, device)
    as_rows: list[bool] = []

    def one(seed: int) -> float:
        took, rows = _chunk_step_ms(engine, base + _tail(vocab, n, seed), device)
        as_rows.append(rows)
        return took

    try:
        one(80)  # compiles what this size needs
        return {"chunk": n, "decodes": s["decodes"], **_profiled(one, device, seed=81),
                "ran_as_rows": all(as_rows)}
    finally:
        for r in rids:
            core.abort(r)
        core.drain()


def _profiled(step_ms: Any, device: str, seed: int = 71) -> dict[str, Any]:
    """`step_ms(seed)` run once under cProfile and once under the torch profiler -> the host's
    functions and the device's kernels."""
    from torch.profiler import ProfilerActivity, profile

    prof = cProfile.Profile()
    prof.enable()
    host_ms = step_ms(seed)
    prof.disable()
    rows = cprofile_rows(prof, 1, min_us=200)
    activities = [ProfilerActivity.CUDA] if device.startswith("cuda") else [ProfilerActivity.CPU]
    with profile(activities=activities) as kprof:
        wall_ms = step_ms(seed + 1)
    kernels = kernel_events(kprof)
    return {
        "wall_ms_cprofiled": host_ms, "wall_ms": wall_ms,
        "device_busy_ms": sum(e.device_time_total for e in kernels) / 1e3,
        "launches": sum(e.count for e in kernels),
        "kernels": [{"name": e.key[:90], "ms": e.device_time_total / 1e3, "calls": e.count}
                    for e in kernels[:40]],
        "host": rows[:80],
    }
