"""Timings of the engine on the slice: prefill, decode steps (overlapped and not, the captured graph
alone), transformers' generate on the same weights, the decode step's byte floor, and the profiles
that say where a step's time goes."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..lib.slices import prompts
from ..lib.timing import sync, timed_steps_ms


@contextlib.contextmanager
def stepped_by_hand(engine: Any, timeout_s: float = 120.0) -> Iterator[Any]:
    """The engine's core, for this thread to step: the driver's work done first (a stream's last
    snapshot can arrive while the driver still resolves an overlapped step) and its lock held, so
    the driver steps nothing meanwhile."""
    if not engine.wait_idle(timeout_s):
        raise RuntimeError(f"the engine's driver did not go idle within {timeout_s:.0f} s")
    with engine.driver.lock:
        yield engine.core


def step_to_first_tokens(core: Any, request_ids: list[str]) -> None:
    """Step `core` until every request of `request_ids` has an output token; a request that ends
    before is an error that says how it ended."""
    while True:
        ended = [out for out in core.step() if out.finished and out.request_id in request_ids]
        if ended:
            out = ended[0]
            raise RuntimeError(f"request {out.request_id} ended before the timed steps: "
                               f"{out.finish_reason} after {len(out.token_ids)} tokens ({out.error})")
        if all(core.requests[r].output_token_ids for r in request_ids):
            return


def settle(engine: Any) -> None:
    """Apply any overlapped step still in flight (its requests were aborted)."""
    engine.core.drain()
    engine.core.stash = []


def engine_prefill_s(engine: Any, prompt: list[int], device: str) -> float:
    """Time to the first token of one prompt, nothing cached."""
    from antumbra import SamplingParams

    engine.clear_cache()
    sync(device)
    start = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    sync(device)
    return time.perf_counter() - start


def engine_decode_ms(engine: Any, prompts: list[list[int]], device: str, steps: int, warmup: int = 3) -> dict:
    """ms per decode step with every prompt decoding; the prefix is cached by one finished request first."""
    from antumbra import SamplingParams

    engine.clear_cache()
    engine.generate([prompts[0]], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    # Long enough that no request finishes while others ramp up or during the timed steps (a
    # shrinking batch would time other graph sizes and their captures); all are aborted after.
    params = SamplingParams(
        max_tokens=engine.max_model_len - len(prompts[0]) - 1, temperature=0.0, ignore_eos=True
    )
    ids = [engine.core.add_request(p, params) for p in prompts]
    fast = engine.runner.fast
    if fast is not None:
        fast.validate = True  # the ramp-up checks every fast step's rows; the timed steps do not
    while any(len(engine.core.requests[r].output_token_ids) < 1 for r in ids):
        engine.core.step()
    for _ in range(warmup):
        engine.core.step()
    if fast is not None:
        fast.validate = False
    fast_steps = fast.num_steps if fast else 0
    overlap = engine.core.overlap
    overlapped, drains = overlap.num_overlapped_steps, overlap.num_drains
    step_ms = timed_steps_ms(engine, steps, device)
    on_fast = (fast.num_steps - fast_steps) if fast else 0
    on_overlap = overlap.num_overlapped_steps - overlapped
    drained = overlap.num_drains - drains  # timed steps that waited for the last one's tokens first
    running = len(engine.core.scheduler.running)
    no_overlap_ms = None
    if overlap.enabled:  # the same steps with the host waiting for each step's tokens
        overlap.enabled = False
        no_overlap_ms = timed_steps_ms(engine, steps, device)
        overlap.enabled = True
    diagnosis = {}
    if len(prompts) >= 32 and device.startswith("cuda"):  # where the host's time goes at large batches
        diagnosis = {"sync_probe": _sync_probe(engine, steps), "host_profile": host_profile(engine, steps)}
    graph_ms = _graph_replay_ms(fast, len(prompts), device)
    overlap_ms = _overlap_replay_ms(fast, len(prompts), device)
    for r in ids:
        engine.core.abort(r)
    settle(engine)
    return {"step_ms": step_ms, "tokens_per_s": len(prompts) * 1e3 / step_ms, "fast_path_steps": on_fast,
            "overlapped_steps": on_overlap, "drained_steps": drained,
            "running": running, "all_running": running == len(prompts),
            "timed_steps": steps, "graph_replay_ms": graph_ms, "graph_replay_ms_overlap_indexer": overlap_ms,
            "step_ms_no_overlap": no_overlap_ms, **diagnosis}


def _sync_probe(engine: Any, steps: int) -> dict[str, Any]:
    """Synchronising CUDA calls the host makes in `steps` decode steps (torch's sync debug mode: a
    pageable copy, `.item()`, a stream sync; not the event waits the overlap means to make), each
    with the innermost project frames of its call stack, and the drains among those steps."""
    drains = engine.core.overlap.num_drains

    def run() -> None:
        for _ in range(steps):
            engine.core.step()

    found = _syncs_during(run)
    return {"steps": steps, "syncs": found, "drains": engine.core.overlap.num_drains - drains}


def prefill_sync_probe(engine: Any, prompt: list[int], device: str) -> dict[str, Any]:
    """`_sync_probe` over one prefill (nothing cached, as `engine_prefill_s`): the synchronising
    calls by call site. A copy from pageable memory made with non_blocking=True does not warn (it
    still waits, in the driver): `prefill_profile`'s pageable_copies counts those."""
    found = _syncs_during(lambda: engine_prefill_s(engine, prompt, device))
    return {"syncs": found, "total": sum(found.values())}


def _syncs_during(fn: Any) -> dict[str, int]:
    """Calls of `fn` that synchronise with the device (torch.cuda.set_sync_debug_mode(1)), by their
    innermost project frames."""
    import traceback
    import warnings

    found: dict[str, int] = {}

    def record(*_args: Any, **_kwargs: Any) -> None:
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "antumbra" in f.filename or "benchmarks" in f.filename]
        if frames and frames[-1].name == "_syncs_during":
            return  # switching the mode on warns once
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(frames[-5:]))
        found[where] = found.get(where, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode(1)
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return found



def _overlap_replay_ms(fast: Any, batch: int, device: str) -> float | None:
    """The same graph captured with the CSA indexers on a second stream (the last step's inputs,
    replayed: it rewrites the same rows with the same values), then the configured mode again."""
    if fast is None or not fast.use_graphs:
        return None
    was = fast.overlap_indexer
    fast.set_overlap_indexer(not was)
    flipped = _graph_replay_ms(fast, batch, device)
    fast.set_overlap_indexer(was)
    return flipped if not was else _graph_replay_ms(fast, batch, device)


def _graph_replay_ms(fast: Any, batch: int, device: str, reps: int = 20) -> float | None:
    """The captured decode graph alone (no scheduling, sampling or host copies)."""
    if fast is None or not fast.use_graphs:
        return None
    graph, _ = fast.graph_for(batch)
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_ev.record()
    for _ in range(reps):
        graph.replay()
    end_ev.record()
    end_ev.synchronize()
    return start_ev.elapsed_time(end_ev) / reps


def profile_fast_step(engine: Any, prompt: list[int], device: str, steps: int = 3) -> dict[str, Any]:
    """Kernel-level breakdown of the fixed-shape decode step run eagerly (no graph): how many
    launches a step makes and where its device time goes."""
    return profile_fast_steps(engine, [prompt], device, steps)


def profile_fast_steps(engine: Any, batch_prompts: list[list[int]], device: str, steps: int = 3,
                       host_steps: int = 20) -> dict[str, Any]:
    """The same breakdown with every prompt of `batch_prompts` decoding in the step."""
    from torch.profiler import ProfilerActivity, profile

    from antumbra import SamplingParams

    fast = engine.runner.fast
    if fast is None or not device.startswith("cuda"):
        return {"skipped": "no fast path on this device"}
    engine.clear_cache()
    params = SamplingParams(max_tokens=steps + host_steps + 64, temperature=0.0, ignore_eos=True)
    rids = [engine.core.add_request(p, params) for p in batch_prompts]
    while not all(engine.core.requests[r].output_token_ids for r in rids):
        engine.core.step()
    engine.core.step()
    host = host_profile(engine, steps=host_steps)
    saved, fast.use_graphs = fast.use_graphs, False
    try:
        sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.core.step()
            sync(device)
        sites = launch_sites(engine, device, steps)
    finally:
        fast.use_graphs = saved
        for rid in rids:
            engine.core.abort(rid)
    rows = kernel_events(prof)
    total_us = sum(e.device_time_total for e in rows) / steps
    launches = sum(e.count for e in rows) / steps
    top = [{"name": e.key[:90], "us_per_step": e.device_time_total / steps, "calls_per_step": e.count / steps}
           for e in rows[:80]]
    return {"kernel_us_per_step": total_us, "launches_per_step": launches, "top": top, "host": host,
            "torch_launch_sites": sites}


def launch_sites(engine: Any, device: str, steps: int, top: int = 60) -> list[dict[str, Any]]:
    """The torch ops that launch kernels in `steps` eager steps, by the engine's functions that
    called them: op, `site` (the innermost three antumbra functions, `file(first line): name`),
    calls and device microseconds a step, the most device time first (on a CPU: CPU time). Triton
    kernels launched from Python are not torch ops and do not appear; this names the glue between
    them."""
    from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sync(device)
    # verbose: without it the profiler keeps no Python stack for the ops it records
    with profile(activities=activities, with_stack=True,
                 experimental_config=_ExperimentalConfig(verbose=True)) as prof:
        for _ in range(steps):
            engine.core.step()
        sync(device)
    return op_sites(prof, steps, on_device=device.startswith("cuda"))[:top]


def op_sites(prof: Any, steps: int, on_device: bool) -> list[dict[str, Any]]:
    """A profile's aten ops with their own time (device time, else CPU time) grouped by op and the
    innermost three antumbra frames of their Python stack, per step, the most time first."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for e in prof.key_averages(group_by_stack_n=16):
        own_us = e.self_device_time_total if on_device else e.self_cpu_time_total
        if own_us <= 0 or not e.key.startswith("aten::"):
            continue
        frames = [f for f in e.stack if "antumbra/" in f][:3]
        site = " < ".join(f.split("antumbra/")[-1] for f in frames)
        row = rows.setdefault((e.key, site), {"op": e.key, "site": site, "calls_per_step": 0.0,
                                              "us_per_step": 0.0})
        row["calls_per_step"] += e.count / steps
        row["us_per_step"] += own_us / steps
    return sorted(rows.values(), key=lambda r: r["us_per_step"], reverse=True)


def prefill_profile(engine: Any, prompt: list[int], device: str) -> dict[str, Any]:
    """Kernel-level breakdown of one prefill (nothing cached): device time per kernel name, the
    device's busy time against the wall time (the rest is the device waiting for the host)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall_s = engine_prefill_s(engine, prompt, device)
    rows = kernel_events(prof)
    busy_us = sum(e.device_time_total for e in rows)
    top = [{"name": e.key[:90], "ms": e.device_time_total / 1e3, "calls": e.count} for e in rows[:40]]
    pageable = sum(e.count for e in rows if "Pageable" in e.key)  # each waited for the stream
    return {"wall_s": wall_s, "device_busy_s": busy_us / 1e6, "pageable_copies": pageable, "top": top}


def host_profile(engine: Any, steps: int) -> dict[str, Any]:
    """Where the host's time of a graph-mode step goes: cProfile's cumulative time per function
    (microseconds per step), the functions above 20 us."""
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.core.step()
    prof.disable()
    return {"steps": steps, "rows": cprofile_rows(prof, steps, min_us=20)[:60]}


def cprofile_rows(prof: Any, steps: int, min_us: float) -> list[dict[str, Any]]:
    """cProfile's functions whose cumulative time per step is at least `min_us`, the largest first:
    cumulative and own microseconds and calls, each per step."""
    import pstats

    rows = []
    for (file, line, func), (_cc, ncalls, tottime, cumtime, _callers) in (
            pstats.Stats(prof).stats.items()):  # type: ignore[attr-defined]
        us = cumtime * 1e6 / steps
        if us >= min_us:
            rows.append({"function": f"{Path(file).name}:{line}:{func}", "us_per_step": us,
                         "self_us_per_step": tottime * 1e6 / steps, "calls_per_step": ncalls / steps})
    rows.sort(key=lambda r: r["us_per_step"], reverse=True)
    return rows


def kernel_events(prof: Any) -> list[Any]:
    """A torch profile's kernels (events with device time), the most device time first."""
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda e: e.device_time_total, reverse=True)
    return rows


def hf_run(model: Any, prompts: list[list[int]], device: str, new_tokens: int) -> dict:
    """transformers' generate: prefill alone (1 new token); the decode step from the difference of
    two runs that share the prefill (`new_tokens` and 2 * `new_tokens` new tokens)."""
    ids = torch.tensor(prompts, device=device)

    def timed(n: int) -> tuple[float, Any]:
        sync(device)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        sync(device)
        return time.perf_counter() - start, out

    try:
        with torch.no_grad():
            model.generate(ids[:, :64], max_new_tokens=2, do_sample=False)  # warm-up outside the timing
            prefill_s, first = timed(1)
            short_s, _ = timed(new_tokens)
            long_s, out = timed(2 * new_tokens)
    except torch.OutOfMemoryError as exc:
        return {"error": "out of memory", "detail": str(exc).splitlines()[0][:300]}
    finally:
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    step_ms = (long_s - short_s) * 1e3 / new_tokens
    return {"prefill_s": prefill_s, "step_ms": step_ms, "tokens_per_s": len(prompts) * 1e3 / step_ms,
            "first_token": first[:, -1].tolist(), "tokens": out[:, ids.shape[1]:].tolist()}


# ---------------------------------------------------------------- floors and checks


def logits_agreement(engine: Any, hf_model: Any, vocab: int, device: str, length: int = 384) -> dict:
    """Last-position logits of one prompt (at most the engine's context), ours against transformers."""
    length = min(length, engine.max_model_len - 1)
    prompt = prompts(vocab, 1, length, seed=11, shared=0)[0]
    engine.clear_cache()
    ours = engine.prompt_logits(prompt)[-1].double()
    with torch.no_grad():
        theirs = hf_model(torch.tensor([prompt], device=device)).logits[0, -1].double().cpu()
    rel = ((ours - theirs).norm() / theirs.norm()).item()
    return {"prompt_len": length, "rel_err": rel, "same_argmax": int(ours.argmax()) == int(theirs.argmax())}
