"""The slice served through the whole platform on one GPU, against the engine driven directly.

One run: the platform (Ray Serve, a local Redis, a tenant, the cache-affinity router, one replica
on the GPU) serves a release-layout checkpoint of the V4-Flash slice (`slice_checkpoint.py`).
Through the official `openai` client it first answers the request kinds users send (OpenAI's
default temperature 1 with no seed, top-p, a seeded request twice, chat, streaming); then, at
concurrency 1 / 8 / 32, independent prompts of 1K-16K tokens with 256 new tokens each, streamed
over plain HTTP (SSE parsed here; the openai client's own per-element request encoding would be
timed as the platform's): TTFT p50 / p99, inter-token latency p50 / p99 and output tokens/s, and
the replica's own TTFT (arrival there to first token) and inter-chunk gaps p50 / p99 (between two
of a stream's chunks as the replica yields them), which split the TTFT and the gaps between the
ingress path and the replica with its engine. The highest level then runs again with fresh prompts
for each client of `hops`: plain HTTP from a process of its own, a Serve handle to the replica from
a process of its own (no ingress, no proxy), plain HTTP from this process again; each pass's gaps
against the replica's of the same streams say which hop makes the inter-token tail
(`itl_p99_vs_decode_step_c*_<hop>`). After the platform stops,
the same workload runs through `Engine.stream` in this process on the same checkpoint and
settings, and the ratios give the platform's overhead. Then, on that engine, a pure-decode step
at each level's batch (the level's first prompts all decoding, nothing prefilled beside them) is
timed: the inter-token latency of decodes while prompts arrive is reported against it
(`itl_p99_vs_decode_step_c*`), with the steps whose decodes ran fixed-shape beside a prefill chunk.

    python -m benchmarks run platform --only platform_vs_engine [--smoke] [--set concurrency=1,8,32]
        [--set itl_budget_ms=9.6] [--set prefill_rows=64]

Options: model (a checkpoint directory), concurrency, itl_budget_ms (the engines' inter-token
budget, `SchedulerConfig.itl_budget_ms`; unset: none), prefill_rows (prompt tokens a step beside
decodes runs on the decode graphs, `FastPathConfig.prefill_rows`; 0: none),
gil_switch_interval_us (the replica's, a number or "python" for Python's 5000; unset: the
platform's default), engine_process (on / off: the replica's engine in a process of its own or
not; unset: the platform's default), hops (the clients of more passes at the highest level:
driver, process, handle; see `HOPS`), serve_loops (one / separate: Serve's event loops,
`PlatformConfig.serve_loops`; unset: the platform's default), new_tokens (a stream's length),
haproxy (on: Serve's HAProxy mode in front of the ingress replicas instead of Serve's proxy),
ingress_replicas (how many the platform runs; default 4), ingress_gil_switch_interval_us (every
ingress replica's, a number; unset or "python": Python's 5000, the platform's default), publisher
(off: no replica publishes its cache to the prefix directory; default on), engine_gil_ab (on: the
engine driven directly also runs each level at the replica's GIL switch interval).
Each pass also reports `process_cpu`: the CPU time of Serve's proxy, each deployment's replicas
(with their engine processes) and this process over the pass, per streamed chunk; and the ingress
replicas' event-loop lag and garbage collections over the pass (`ingress_loop_lag_*`, `ingress_gc_*`,
`ingress/loop_lag.py`); and, in both runs, how the engine's step and prompt counters moved over a
level (`engine_*`, `ENGINE_COUNTERS`) and the busiest threads of the process the engine steps in, as
cores (`engine_process_busiest_threads_cores`, `busiest_threads_cores`) and with their names
(`engine_process_busiest_threads`, `busiest_threads`: [name, cores]). Without
`model` it serves the slice checkpoint (`engine/slice_checkpoint.cached_slice`); a smoke run serves
the tiny checkpoint on the CPU with short prompts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from antumbra.platform.launch.app import INGRESS_DEPLOYMENT
from antumbra.platform.launch.platform_config import (
    DEFAULT_GIL_SWITCH_INTERVAL_US,
    model_deployment_name,
)
from antumbra.platform.replica.engine_child import thread_names

from ..engine.cold_start import MAX_MODEL_LEN, SMOKE_MAX_MODEL_LEN, engine_settings
from ..engine.slice_steps import settle, step_to_first_tokens, stepped_by_hand
from ..lib.context import Context
from ..lib.timing import percentile, timed_steps_ms
from .process_cpu import (
    busiest_threads,
    cpu_per_chunk,
    cpu_seconds,
    engine_process_pids,
    thread_seconds,
)
from .stream_load import (
    HAPROXY_ENV,
    Load,
    Sample,
    handle_in_own_process,
    http_in_own_process,
    http_level,
    level,
    timed,
)

DEVICE = "cuda"

MODEL_NAME = "v4-flash-slice"
INGRESS_REPLICAS = 4  # SSE framing and the per-item hop cost CPU per token: one core would cap c32


@dataclass(frozen=True)
class Workload:
    new_tokens: int = 256
    min_prompt: int = 1024
    max_prompt: int = 16384
    smoke: bool = False  # the tiny checkpoint on the CPU: checks the script, measures nothing
    decode_steps: int = 32  # timed pure-decode steps per level
    itl_budget_ms: float | None = None  # the engines' SchedulerConfig.itl_budget_ms
    prefill_rows: int = 0  # the engines' FastPathConfig.prefill_rows
    # The engine run once more per level first with its prompt rows steps not launched overlapped
    # (`OverlapStepper.launch_rows`), as `c{N}_rows_not_launched`
    rows_ab: bool = False
    # The replica's GIL switch interval (`ModelSpec.gil_switch_interval_us`); None: Python's own
    gil_switch_interval_us: float | None = DEFAULT_GIL_SWITCH_INTERVAL_US
    # The replica's engine in a process of its own (`ModelSpec.engine_process`); None: the platform's default
    engine_process: bool | None = None
    # Serve's event loops (`PlatformConfig.serve_loops`); None: the platform's default
    serve_loops: str | None = None
    # Serve's HAProxy mode in front of the ingress replicas instead of Serve's proxy (the
    # environment of the cluster the run starts: `RAY_SERVE_ENABLE_HA_PROXY`)
    haproxy: bool = False
    # More passes at the highest level, each with fresh prompts, read by other clients (`HOPS`)
    hops: tuple[str, ...] = ("process", "handle", "driver")
    ingress_replicas: int = INGRESS_REPLICAS
    # The replicas publish their cache to the prefix directory (`PlatformConfig.publisher`)
    publisher: bool = True
    # The engine driven directly runs each level once more, with fresh prompts of the same lengths,
    # at the replica's GIL switch interval (`c{N}_at_replica_gil`), each run from an empty cache
    engine_gil_ab: bool = False
    # Each ingress replica's GIL switch interval (`PlatformConfig.ingress_gil_switch_interval_us`);
    # None: Python's own, the platform's default
    ingress_gil_switch_interval_us: float | None = None


# The clients of the passes after the levels: "driver", plain HTTP in this process (the Ray driver, as
# the levels are read); "process", plain HTTP in a process of its own; "handle", the model deployment's
# `generate` through a Serve handle in a process of its own (no ingress, no proxy).
HOPS = ("driver", "process", "handle")
DEPLOYMENTS = (INGRESS_DEPLOYMENT, model_deployment_name(MODEL_NAME))  # the replicas whose CPU time is taken
IDLE_S = 5.0  # the platform unloaded, before the levels: each process kind's CPU time at rest

SMOKE = Workload(new_tokens=8, min_prompt=32, max_prompt=256, smoke=True, decode_steps=4)


def _settings(work: Workload) -> dict[str, Any]:
    settings = engine_settings(work.smoke)
    if work.itl_budget_ms is not None:
        settings["scheduler"] = dataclasses.replace(settings["scheduler"], itl_budget_ms=work.itl_budget_ms)
    if work.prefill_rows:
        from antumbra.config import FastPathConfig

        settings["fast"] = FastPathConfig(prefill_rows=work.prefill_rows)
    return settings


def _prompts(vocab: int, count: int, seed: int, work: Workload) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(work.min_prompt, work.max_prompt + 1, (count,), generator=g).tolist()
    return _random_ids(lengths, vocab, g)


def _random_ids(lengths: list[int], vocab: int, g: torch.Generator) -> list[list[int]]:
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]



# ---------------------------------------------------------------- through the platform


def _replica_call(method: str) -> Any:
    from ray import serve

    from antumbra.platform.launch.app import model_deployment_name
    from antumbra.platform.launch.serve_cli import APP_NAME

    handle = serve.get_deployment_handle(model_deployment_name(MODEL_NAME), app_name=APP_NAME)
    return getattr(handle, method).remote().result(timeout_s=30)


def _ingress_lags(ingress_replicas: int) -> dict[str, Any]:
    """Every ingress replica's event-loop lags and garbage collections (seconds) since the last read
    (`ingress/loop_lag.py`), as `ingress_*` figures: calls spread by Serve's router until each replica
    answered, or 8 calls a replica were made."""
    from ray import serve

    from antumbra.platform.launch.serve_cli import APP_NAME

    handle = serve.get_deployment_handle(INGRESS_DEPLOYMENT, app_name=APP_NAME)
    answers: dict[str, list[dict[str, Any]]] = {}
    for _ in range(8 * ingress_replicas):
        answer = handle.take_loop_lags.remote().result(timeout_s=30)
        answers.setdefault(answer["replica_id"], []).append(answer)
        if len(answers) >= ingress_replicas:
            break
    every = [a for replica in answers.values() for a in replica]
    lags = [lag for a in every for lag in a["lags_s"]]
    full = [seconds for a in every for generation, seconds in a["gc_pauses"] if generation == 2]
    young = [seconds for a in every for generation, seconds in a["gc_pauses"] if generation < 2]
    return {"ingress_loop_lag_p99_s": percentile(lags, 0.99) if lags else None,
            "ingress_loop_lag_p999_s": percentile(lags, 0.999) if lags else None,
            "ingress_loop_lag_max_s": max(lags, default=None), "ingress_loop_lag_samples": len(lags),
            "ingress_gc_full": len(full), "ingress_gc_full_max_s": max(full, default=None),
            "ingress_gc_young": len(young), "ingress_gc_young_max_s": max(young, default=None),
            "ingress_gil_switch_interval_us": sorted({a["gil_switch_interval_us"] for a in every})}


# The engine's counters whose change over a level is reported beside it (`engine_stats.core_stats`), in
# both runs: the same prompts through the platform and straight to the engine should take the same
# steps, compute the same prompt tokens and preempt alike; where they do not, that is the difference.
ENGINE_COUNTERS = ("num_steps", "num_generated_tokens", "computed_prompt_tokens", "cached_tokens",
                   "preemptions", "replays", "replayed_tokens")


def engine_counters(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The change of each of `ENGINE_COUNTERS` from `before` to `after` (two `stats()` readings)."""
    return {f"engine_{name}": after[name] - before[name] for name in ENGINE_COUNTERS}


def _replica_ttfts() -> list[float]:
    return _replica_call("take_ttft_samples")


def _replica_gaps() -> list[float]:
    return _replica_call("take_gap_samples")


def _free_port() -> int:
    """A port free now, below the ephemeral range (and above Ray's worker ports): a port the kernel
    handed out and took back could be handed to one of Ray's own sockets before the proxy binds it."""
    for port in random.Random().sample(range(20000, 30000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-29999")


async def _smoke(client: Any) -> dict[str, Any]:
    """The request kinds users send, each through the openai client; -> what each returned."""
    ids = list(range(100, 164))
    out: dict[str, Any] = {}
    default = await client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=16)  # temperature 1
    out["default_temperature"] = default.usage.completion_tokens
    top_p = await client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=16, temperature=0.8, top_p=0.9
    )
    out["top_p"] = top_p.usage.completion_tokens
    seeded = [
        await client.completions.create(
            model=MODEL_NAME,
            prompt=ids,
            max_tokens=16,
            temperature=1.0,
            seed=5,
            extra_body={"ignore_eos": True},
        )
        for _ in range(2)
    ]
    out["seeded_repeatable"] = seeded[0].choices[0].text == seeded[1].choices[0].text
    chat = await client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=8
    )
    out["chat_finish_reason"] = chat.choices[0].finish_reason
    pieces = [
        c
        async for c in await client.completions.create(
            model=MODEL_NAME, prompt=ids, max_tokens=8, stream=True, temperature=0.7, extra_body={"top_k": 20}
        )
    ]
    out["stream_chunks"] = len(pieces)
    out["all_ok"] = (out["default_temperature"] > 0 and out["top_p"] > 0 and out["seeded_repeatable"]
                     and out["stream_chunks"] > 0)
    return out


async def _pass(run: Awaitable[dict[str, Any]], ingress_replicas: int) -> dict[str, Any]:
    """A level's figures with the CPU time each kind of the platform's processes spent on it
    (`process_cpu.py`), the ingress replicas' event-loop lag over it and the replica's own view of
    its streams."""
    await asyncio.to_thread(_ingress_lags, ingress_replicas)  # from here on
    counters = await asyncio.to_thread(_replica_call, "engine_stats")
    engines = engine_process_pids(model_deployment_name(MODEL_NAME))
    threads = {pid: thread_seconds(pid) for pid in engines}
    before = cpu_seconds(DEPLOYMENTS)
    stats = await run
    after = cpu_seconds(DEPLOYMENTS)
    stats["process_cpu"] = cpu_per_chunk(before, after, stats["wall_s"], stats["output_tokens"])
    names = await asyncio.to_thread(_replica_call, "engine_thread_names")
    busiest = busiest_threads(engines, threads, stats["wall_s"], names)
    stats["engine_process_busiest_threads"] = busiest
    stats["engine_process_busiest_threads_cores"] = [cores for _, cores in busiest]
    stats |= engine_counters(counters, await asyncio.to_thread(_replica_call, "engine_stats"))
    stats |= await asyncio.to_thread(_ingress_lags, ingress_replicas)
    return await _with_replica_view(stats)


async def _with_replica_view(stats: dict[str, Any]) -> dict[str, Any]:
    """A level's client figures with the replica's own of the same streams: arrival at the replica to
    its first token (the rest of the TTFT is the ingress, the router and the hops between them), and
    the gaps between two chunks of a stream as the replica yields them (the client's gaps less these
    are what the hops after the replica add)."""
    ttfts = await asyncio.to_thread(_replica_ttfts)
    gaps = await asyncio.to_thread(_replica_gaps)
    return {**stats, "replica_ttft_p50_s": percentile(ttfts, 0.5) if ttfts else None,
            "replica_itl_p50_s": percentile(gaps, 0.5) if gaps else None,
            "replica_itl_p99_s": percentile(gaps, 0.99) if gaps else None}


async def _hop_level(hop: str, platform: Any, load: Load) -> dict[str, Any]:
    """One more level read by another client (`HOPS`)."""
    if hop == "driver":
        return await http_level(platform.base_url, platform.api_key, load)
    if hop == "process":
        return await asyncio.to_thread(http_in_own_process, platform.base_url, platform.api_key, load)
    import ray

    from antumbra.platform.launch.serve_cli import APP_NAME

    gcs = ray.get_runtime_context().gcs_address
    deployment = model_deployment_name(MODEL_NAME)
    return await asyncio.to_thread(handle_in_own_process, gcs, deployment, APP_NAME, load)


def platform_run(model_dir: str, levels: list[int], vocab: int, work: Workload) -> dict[str, Any]:
    from openai import AsyncOpenAI

    from antumbra.platform.launch.serve_cli import local_platform
    from antumbra.platform.launch.serve_env import serve_environment

    settings = _settings(work)
    sched = settings["scheduler"]
    config = {"ingress_replicas": work.ingress_replicas,
              "ingress_gil_switch_interval_us": work.ingress_gil_switch_interval_us, "models": {MODEL_NAME: {
        "path": model_dir, "device": settings["device"], "dtype": settings["dtype"],
        "max_model_len": SMOKE_MAX_MODEL_LEN if work.smoke else MAX_MODEL_LEN, "warmup": "on",
        "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
        "max_ongoing_requests": 64, "itl_budget_ms": work.itl_budget_ms, "prefill_rows": work.prefill_rows,
        "num_virtual_tokens": settings["cache"].num_virtual_tokens,
        "gil_switch_interval_us": work.gil_switch_interval_us, "engine_process": work.engine_process,
    }}}
    if work.serve_loops is not None:
        config["serve_loops"] = work.serve_loops
    if not work.publisher:
        config["publisher"] = None
    result: dict[str, Any] = {}
    started = time.monotonic()
    with serve_environment(HAPROXY_ENV if work.haproxy else {}), \
            local_platform(config, port=_free_port()) as platform:
        result["start_s"] = time.monotonic() - started
        client = AsyncOpenAI(base_url=platform.base_url + "/v1", api_key=platform.api_key, max_retries=0,
                             timeout=600)

        async def drive() -> None:
            stats = await asyncio.to_thread(_replica_call, "engine_stats")
            result["gil_switch_interval_us"] = stats["gil_switch_interval_us"]
            result["smoke"] = await _smoke(client)
            await asyncio.to_thread(_replica_ttfts)  # drop the smoke requests' samples
            await asyncio.to_thread(_replica_gaps)
            # What each process kind spends unloaded, to set against the levels' figures.
            before, idle_started = cpu_seconds(DEPLOYMENTS), time.perf_counter()
            await asyncio.sleep(IDLE_S)
            idle_s = time.perf_counter() - idle_started
            result["idle_cpu"] = cpu_per_chunk(before, cpu_seconds(DEPLOYMENTS), idle_s, 0)
            for c in levels:
                load = Load(MODEL_NAME, _prompts(vocab, max(2 * c, 8), c, work), c, work.new_tokens)
                result[f"c{c}"] = await _pass(http_level(platform.base_url, platform.api_key, load),
                                              work.ingress_replicas)
                print("platform", c, result[f"c{c}"], flush=True)
            c = max(levels)
            for i, hop in enumerate(work.hops, start=1):  # fresh prompts: none cached by a pass before
                prompts = _prompts(vocab, max(2 * c, 8), c + 1000 * i, work)
                load = Load(MODEL_NAME, prompts, c, work.new_tokens)
                result[f"c{c}_{hop}"] = await _pass(_hop_level(hop, platform, load), work.ingress_replicas)
                print("platform", c, hop, result[f"c{c}_{hop}"], flush=True)
            await client.close()

        asyncio.run(drive())
    return result


# ---------------------------------------------------------------- the engine directly


def engine_run(model_dir: str, levels: list[int], vocab: int, work: Workload) -> dict[str, Any]:
    from antumbra import Engine, SamplingParams
    from antumbra.kernels.variants import compile_watch

    engine = Engine.from_pretrained(model_dir, **_settings(work))
    params = SamplingParams(max_tokens=work.new_tokens, temperature=0.0, ignore_eos=True)

    async def one(prompt: list[int]) -> Sample:
        started = time.perf_counter()

        async def counts() -> AsyncIterator[tuple[int, bool]]:
            async for out in engine.stream(prompt, params):
                yield len(out.new_token_ids), True
        return await timed(counts(), started)

    result: dict[str, Any] = {}
    with compile_watch() as watch:  # mixed batches of every size: nothing may compile after the warm-up
        for c in levels:
            if work.rows_ab:
                engine.core.overlap.launch_rows = False
                result[f"c{c}_rows_not_launched"] = asyncio.run(
                    level(one, _prompts(vocab, max(2 * c, 8), c, work), c))
                engine.core.overlap.launch_rows = True
                print("engine rows not launched", c, result[f"c{c}_rows_not_launched"], flush=True)
            mixed, rows = engine.runner.num_mixed_steps, engine.runner.num_prompt_row_steps
            launched, drains = engine.core.overlap.num_rows_launches, engine.core.overlap.num_drains
            prompts = _prompts(vocab, max(2 * c, 8), c, work)
            if work.engine_gil_ab:
                engine.clear_cache()  # both runs of the A/B start from an empty prefix cache
            counters, threads = engine.stats(), {os.getpid(): thread_seconds(os.getpid())}
            result[f"c{c}"] = asyncio.run(level(one, prompts, c))
            result[f"c{c}"] |= engine_counters(counters, engine.stats())
            busiest = busiest_threads([os.getpid()], threads, result[f"c{c}"]["wall_s"], thread_names())
            result[f"c{c}"]["busiest_threads"] = busiest
            result[f"c{c}"]["busiest_threads_cores"] = [cores for _, cores in busiest]
            result[f"c{c}"]["mixed_steps"] = engine.runner.num_mixed_steps - mixed
            result[f"c{c}"]["prompt_row_steps"] = engine.runner.num_prompt_row_steps - rows
            # Of those, launched overlapped; and the drains (tokens in flight read before scheduling).
            result[f"c{c}"]["prompt_row_launches"] = engine.core.overlap.num_rows_launches - launched
            result[f"c{c}"]["overlap_drains"] = engine.core.overlap.num_drains - drains
            print("engine", c, result[f"c{c}"], flush=True)
            if work.engine_gil_ab and work.gil_switch_interval_us is not None:
                result[f"c{c}_at_replica_gil"] = _level_at_interval(
                    engine, lambda ps, c=c: asyncio.run(level(one, ps, c)),
                    same_lengths(prompts, vocab, seed=c + 500), work.gil_switch_interval_us)
                print("engine at the replica's GIL interval", c, result[f"c{c}_at_replica_gil"], flush=True)
        for c in levels:
            prompts = _prompts(vocab, max(2 * c, 8), c, work)[:c]
            result[f"c{c}"]["decode_step_ms"] = _decode_step_ms(engine, prompts, work)
            print("engine decode step", c, result[f"c{c}"]["decode_step_ms"], "ms", flush=True)
    result["kernel_misses_after_warmup"] = watch.count
    result["missed_kernels"] = sorted({str(e) for e in watch.events})[:20]
    engine.check_integrity()
    return result


def same_lengths(prompts: list[list[int]], vocab: int, seed: int) -> list[list[int]]:
    """Prompts of the same lengths as `prompts` with fresh random ids: the same work for the engine,
    none of it cached by a run over `prompts`."""
    return _random_ids([len(p) for p in prompts], vocab, torch.Generator().manual_seed(seed))


def _level_at_interval(engine: Any, run_level: Callable[[list[list[int]]], dict[str, Any]],
                       prompts: list[list[int]], interval_us: float) -> dict[str, Any]:
    """A level run with this process's GIL switch interval at `interval_us` (the replica's, which its
    engine process steps at), then Python's back: whether the interval alone slows the engine."""
    previous = sys.getswitchinterval()
    engine.clear_cache()
    counters = engine.stats()
    sys.setswitchinterval(interval_us * 1e-6)
    try:
        stats = run_level(prompts)
    finally:
        sys.setswitchinterval(previous)
    return {**stats, **engine_counters(counters, engine.stats()), "gil_switch_interval_us": interval_us}


def _decode_step_ms(engine: Any, prompts: list[list[int]], work: Workload) -> float:
    """ms per step of `engine` with every prompt decoding and nothing else scheduled: the pure-decode
    step at that batch, as the engine runs it (fixed-shape, overlapped where that applies)."""
    from antumbra import SamplingParams

    # Long enough that no request finishes while the others are prefilled or while timed.
    params = SamplingParams(max_tokens=engine.max_model_len - max(len(p) for p in prompts) - 1,
                            temperature=0.0, ignore_eos=True)
    with stepped_by_hand(engine) as core:
        ids = [core.add_request(p, params) for p in prompts]
        step_to_first_tokens(core, ids)
        for _ in range(3):  # every request past its first token: no step left with a prefill
            core.step()
        step_ms = timed_steps_ms(engine, work.decode_steps, str(core.device))
        for r in ids:
            core.abort(r)
        settle(engine)
    return step_ms


def measure(model_dir: str, levels: list[int], work: Workload) -> dict[str, Any]:
    from antumbra.config import ModelConfig
    from antumbra.replicas.model.checkpoint_files import load_hf_config

    vocab = ModelConfig.from_hf(load_hf_config(model_dir)).vocab_size
    result: dict[str, Any] = {"model": model_dir, "levels": levels, "workload": asdict(work),
                              "ingress_replicas": work.ingress_replicas,
                              "prompt_tokens": f"uniform {work.min_prompt}..{work.max_prompt}, independent"}
    result["platform"] = platform_run(model_dir, levels, vocab, work)
    result["engine"] = engine_run(model_dir, levels, vocab, work)
    result["checks_ok"] = bool(result["platform"].get("smoke", {}).get("all_ok")) and \
        result["engine"]["kernel_misses_after_warmup"] == 0
    if result["checks_ok"]:
        ratios = {}
        for c in levels:
            p, e = result["platform"][f"c{c}"], result["engine"][f"c{c}"]
            ratios[f"platform_vs_engine_throughput_c{c}"] = (
                p["output_tokens_per_s"] / e["output_tokens_per_s"]
            )
            ratios[f"platform_minus_engine_ttft_p50_ms_c{c}"] = (p["ttft_p50_s"] - e["ttft_p50_s"]) * 1e3
            # Decodes while prompts arrive, against a step of decodes alone at that batch: as the client
            # read them and as the replica yielded them, for the level and for its passes by other
            # clients (`hops`, at the highest level: which hop makes the tail).
            for suffix in ("", *(f"_{hop}" for hop in work.hops)):
                level_stats = result["platform"].get(f"c{c}{suffix}", {})
                for key in ("itl_p99_s", "replica_itl_p99_s"):
                    if level_stats.get(key) is not None:
                        figure = f"{key.removesuffix('_s')}_vs_decode_step_c{c}{suffix}"
                        ratios[figure] = level_stats[key] * 1e3 / e["decode_step_ms"]
            if (at_gil := result["engine"].get(f"c{c}_at_replica_gil")) is not None:
                ratios[f"engine_at_replica_gil_vs_default_throughput_c{c}"] = (
                    at_gil["output_tokens_per_s"] / e["output_tokens_per_s"])
            for name in (f"c{c}", f"c{c}_rows_not_launched"):
                engine_level = result["engine"].get(name)
                if engine_level is not None and engine_level["itl_p99_s"] is not None:
                    ratios[f"engine_itl_p99_vs_decode_step_{name}"] = (
                        engine_level["itl_p99_s"] * 1e3 / e["decode_step_ms"])
        result["ratios"] = ratios
    return result


def _on(value: Any) -> bool:
    return str(value).lower() in ("1", "true", "on")


def _setting(value: Any) -> bool | None:
    """An on / off option; unset: None."""
    return None if str(value) == "" else _on(value)


def gil_interval_us(text: str, default: float | None = DEFAULT_GIL_SWITCH_INTERVAL_US) -> float | None:
    """A GIL switch interval option: "" the platform's `default`, "python" Python's own (None)."""
    if not text:
        return default
    return None if text == "python" else float(text)


def hops_option(text: str) -> tuple[str, ...]:
    """A `hops` option: comma-separated names of `HOPS`, or "" for none."""
    hops = tuple(h for h in text.split(",") if h)
    unknown = sorted(set(hops) - set(HOPS))
    if unknown:
        raise ValueError(f"unknown hops {unknown}: choose from {list(HOPS)}")
    return hops


def run(ctx: Context) -> dict[str, Any]:
    """Options: model (a checkpoint directory), concurrency, itl_budget_ms, prefill_rows, rows_ab,
    gil_switch_interval_us, engine_process, hops, serve_loops, new_tokens, haproxy, ingress_replicas,
    ingress_gil_switch_interval_us, publisher, engine_gil_ab."""
    import tempfile
    from pathlib import Path

    budget = ctx.option("itl_budget_ms", "")
    gil = gil_interval_us(ctx.option("gil_switch_interval_us", ""))
    base = SMOKE if ctx.smoke else Workload()
    work = dataclasses.replace(base, new_tokens=int(ctx.option("new_tokens", base.new_tokens)),
                               itl_budget_ms=float(budget) if budget else None, gil_switch_interval_us=gil,
                               prefill_rows=int(ctx.option("prefill_rows", 0)),
                               rows_ab=_on(ctx.option("rows_ab", "")),
                               engine_process=_setting(ctx.option("engine_process", "")),
                               hops=hops_option(ctx.option("hops", ",".join(Workload.hops))),
                               serve_loops=ctx.option("serve_loops", "") or None,
                               haproxy=_on(ctx.option("haproxy", "")),
                               ingress_replicas=int(ctx.option("ingress_replicas", INGRESS_REPLICAS)),
                               ingress_gil_switch_interval_us=gil_interval_us(
                                   ctx.option("ingress_gil_switch_interval_us", ""), default=None),
                               publisher=_on(ctx.option("publisher", "on")),
                               engine_gil_ab=_on(ctx.option("engine_gil_ab", "")))
    levels = ctx.option("concurrency", [1, 2] if ctx.smoke else [1, 8, 32])
    with tempfile.TemporaryDirectory() as tmp:
        model = ctx.option("model", "")
        if not model and ctx.smoke:
            from antumbra.replicas.model.tiny import make_tiny_checkpoint

            model = str(make_tiny_checkpoint(Path(tmp) / "tiny"))
        elif not model:
            from ..engine.slice_checkpoint import cached_slice

            model = str(cached_slice(ctx.device, smoke=False))
        return measure(model, levels, work)
