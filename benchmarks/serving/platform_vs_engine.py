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
ingress path and the replica with its engine. After the platform stops,
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
not; unset: the platform's default). Without
`model` it serves the slice checkpoint (`engine/slice_checkpoint.cached_slice`); a smoke run serves
the tiny checkpoint on the CPU with short prompts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import torch

from antumbra.platform.launch.platform_config import DEFAULT_GIL_SWITCH_INTERVAL_US

from ..engine.cold_start import MAX_MODEL_LEN, SMOKE_MAX_MODEL_LEN, engine_settings
from ..engine.slice_steps import settle
from ..lib.context import Context
from ..lib.timing import percentile, timed_steps_ms

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


SMOKE = Workload(new_tokens=8, min_prompt=32, max_prompt=256, smoke=True, decode_steps=4)


def _settings(work: Workload) -> dict[str, Any]:
    settings = engine_settings(work.smoke)
    if work.itl_budget_ms is not None:
        settings["scheduler"] = dataclasses.replace(settings["scheduler"], itl_budget_ms=work.itl_budget_ms)
    if work.prefill_rows:
        from antumbra.config import FastPathConfig

        settings["fast"] = FastPathConfig(prefill_rows=work.prefill_rows)
    return settings


@dataclass
class Sample:
    ttft_s: float
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0


def _prompts(vocab: int, count: int, seed: int, work: Workload) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(work.min_prompt, work.max_prompt + 1, (count,), generator=g).tolist()
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]



async def _timed(chunks: AsyncIterator[tuple[int, bool]], started: float) -> Sample:
    """Consume a stream of (tokens, timed) per chunk, from `started` (before the request was sent):
    the first timed chunk gives the TTFT, the later ones the gaps; untimed tokens only count."""
    sample: Sample | None = None
    last = started
    async for count, timed in chunks:
        now = time.perf_counter()
        if count <= 0:
            continue
        if not timed:
            assert sample is not None, "tokens reported before the first chunk"
            sample.tokens += count
            continue
        if sample is None:
            sample = Sample(ttft_s=now - started)
        else:
            sample.gaps_s.extend([(now - last) / count] * count)
        sample.tokens += count
        last = now
    assert sample is not None, "the stream produced no token"
    return sample


async def _level(
    one: Callable[[list[int]], Awaitable[Sample]], prompts: list[list[int]], concurrency: int
) -> dict:
    queue = list(prompts)
    samples: list[Sample] = []

    async def worker() -> None:
        while queue:
            samples.append(await one(queue.pop()))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    ttfts = [s.ttft_s for s in samples]
    gaps = [g for s in samples for g in s.gaps_s]
    tokens = sum(s.tokens for s in samples)
    return {
        "requests": len(samples),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "itl_p50_s": percentile(gaps, 0.5) if gaps else None,
        "itl_p99_s": percentile(gaps, 0.99) if gaps else None,
    }


# ---------------------------------------------------------------- through the platform


def _replica_call(method: str) -> Any:
    from ray import serve

    from antumbra.platform.launch.app import model_deployment_name
    from antumbra.platform.launch.serve_cli import APP_NAME

    handle = serve.get_deployment_handle(model_deployment_name(MODEL_NAME), app_name=APP_NAME)
    return getattr(handle, method).remote().result(timeout_s=30)


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


def platform_run(model_dir: str, levels: list[int], vocab: int, work: Workload) -> dict[str, Any]:
    from openai import AsyncOpenAI

    from antumbra.platform.launch.serve_cli import local_platform

    settings = _settings(work)
    sched = settings["scheduler"]
    config = {"ingress_replicas": INGRESS_REPLICAS, "models": {MODEL_NAME: {
        "path": model_dir, "device": settings["device"], "dtype": settings["dtype"],
        "max_model_len": SMOKE_MAX_MODEL_LEN if work.smoke else MAX_MODEL_LEN, "warmup": "on",
        "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
        "max_ongoing_requests": 64, "itl_budget_ms": work.itl_budget_ms, "prefill_rows": work.prefill_rows,
        "num_virtual_tokens": settings["cache"].num_virtual_tokens,
        "gil_switch_interval_us": work.gil_switch_interval_us, "engine_process": work.engine_process,
    }}}
    result: dict[str, Any] = {}
    started = time.monotonic()
    with local_platform(config, port=_free_port()) as platform:
        result["start_s"] = time.monotonic() - started
        client = AsyncOpenAI(base_url=platform.base_url + "/v1", api_key=platform.api_key, max_retries=0,
                             timeout=600)

        http = httpx.AsyncClient(base_url=platform.base_url, timeout=600,
                                 headers={"Authorization": f"Bearer {platform.api_key}"},
                                 limits=httpx.Limits(max_connections=256, max_keepalive_connections=256))

        async def one(prompt: list[int]) -> Sample:
            # A plain HTTP client for the timed load: the openai client walks every element of the
            # request body in Python (about 25 ms per 1000 prompt tokens here), which would be timed
            # as the platform's. The body is encoded before the clock starts, as a client would.
            body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": work.new_tokens,
                               "temperature": 0.0, "stream": True, "ignore_eos": True,
                               "stream_options": {"include_usage": True}})
            started = time.perf_counter()

            async def counts() -> AsyncIterator[tuple[int, bool]]:
                # One chunk per engine snapshot; a token need not add text (a byte tokenizer holds back
                # incomplete characters), so chunks time the steps and the usage chunk counts the tokens.
                seen = 0
                async with http.stream("POST", "/v1/completions", content=body,
                                       headers={"Content-Type": "application/json"}) as response:
                    response.raise_for_status()
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("choices"):
                            seen += 1
                            yield 1, True
                        elif chunk.get("usage"):
                            yield chunk["usage"]["completion_tokens"] - seen, False
            return await _timed(counts(), started)

        async def drive() -> None:
            stats = await asyncio.to_thread(_replica_call, "engine_stats")
            result["gil_switch_interval_us"] = stats["gil_switch_interval_us"]
            result["smoke"] = await _smoke(client)
            await asyncio.to_thread(_replica_ttfts)  # drop the smoke requests' samples
            await asyncio.to_thread(_replica_gaps)
            for c in levels:
                result[f"c{c}"] = await _level(one, _prompts(vocab, max(2 * c, 8), c, work), c)
                # Arrival at the replica to its first token: the rest of the TTFT is the ingress,
                # the router and the hops between them.
                replica = await asyncio.to_thread(_replica_ttfts)
                result[f"c{c}"]["replica_ttft_p50_s"] = percentile(replica, 0.5) if replica else None
                # Between two chunks of a stream as the replica yields them: the client's gaps less
                # these are what the ingress, Serve's proxy and the network add.
                gaps = await asyncio.to_thread(_replica_gaps)
                result[f"c{c}"]["replica_itl_p50_s"] = percentile(gaps, 0.5) if gaps else None
                result[f"c{c}"]["replica_itl_p99_s"] = percentile(gaps, 0.99) if gaps else None
                print("platform", c, result[f"c{c}"], flush=True)
            await client.close()
            await http.aclose()

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
        return await _timed(counts(), started)

    result: dict[str, Any] = {}
    with compile_watch() as watch:  # mixed batches of every size: nothing may compile after the warm-up
        for c in levels:
            if work.rows_ab:
                engine.core.overlap.launch_rows = False
                result[f"c{c}_rows_not_launched"] = asyncio.run(
                    _level(one, _prompts(vocab, max(2 * c, 8), c, work), c))
                engine.core.overlap.launch_rows = True
                print("engine rows not launched", c, result[f"c{c}_rows_not_launched"], flush=True)
            mixed, rows = engine.runner.num_mixed_steps, engine.runner.num_prompt_row_steps
            launched, drains = engine.core.overlap.num_rows_launches, engine.core.overlap.num_drains
            result[f"c{c}"] = asyncio.run(_level(one, _prompts(vocab, max(2 * c, 8), c, work), c))
            result[f"c{c}"]["mixed_steps"] = engine.runner.num_mixed_steps - mixed
            result[f"c{c}"]["prompt_row_steps"] = engine.runner.num_prompt_row_steps - rows
            # Of those, launched overlapped; and the drains (tokens in flight read before scheduling).
            result[f"c{c}"]["prompt_row_launches"] = engine.core.overlap.num_rows_launches - launched
            result[f"c{c}"]["overlap_drains"] = engine.core.overlap.num_drains - drains
            print("engine", c, result[f"c{c}"], flush=True)
        for c in levels:
            prompts = _prompts(vocab, max(2 * c, 8), c, work)[:c]
            result[f"c{c}"]["decode_step_ms"] = _decode_step_ms(engine, prompts, work)
            print("engine decode step", c, result[f"c{c}"]["decode_step_ms"], "ms", flush=True)
    result["kernel_misses_after_warmup"] = watch.count
    result["missed_kernels"] = sorted({str(e) for e in watch.events})[:20]
    engine.check_integrity()
    return result


def _decode_step_ms(engine: Any, prompts: list[list[int]], work: Workload) -> float:
    """ms per step of `engine` with every prompt decoding and nothing else scheduled: the pure-decode
    step at that batch, as the engine runs it (fixed-shape, overlapped where that applies)."""
    from antumbra import SamplingParams

    # Long enough that no request finishes while the others are prefilled or while timed.
    params = SamplingParams(max_tokens=engine.max_model_len - max(len(p) for p in prompts) - 1,
                            temperature=0.0, ignore_eos=True)
    ids = [engine.core.add_request(p, params) for p in prompts]
    while any(len(engine.core.requests[r].output_token_ids) < 1 for r in ids):
        engine.core.step()
    for _ in range(3):  # every request past its first token: no step left with a prefill
        engine.core.step()
    step_ms = timed_steps_ms(engine, work.decode_steps, str(engine.core.device))
    for r in ids:
        engine.core.abort(r)
    settle(engine)
    return step_ms


def measure(model_dir: str, levels: list[int], work: Workload) -> dict[str, Any]:
    from antumbra.config import ModelConfig
    from antumbra.replicas.model.checkpoint_files import load_hf_config

    vocab = ModelConfig.from_hf(load_hf_config(model_dir)).vocab_size
    result: dict[str, Any] = {"model": model_dir, "levels": levels, "workload": asdict(work),
                              "ingress_replicas": INGRESS_REPLICAS,
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
            # Decodes while prompts arrive, against a step of decodes alone at that batch.
            if p["itl_p99_s"] is not None:
                ratios[f"itl_p99_vs_decode_step_c{c}"] = p["itl_p99_s"] * 1e3 / e["decode_step_ms"]
            if p.get("replica_itl_p99_s") is not None:  # the same gaps as the replica yielded them
                ratios[f"replica_itl_p99_vs_decode_step_c{c}"] = (
                    p["replica_itl_p99_s"] * 1e3 / e["decode_step_ms"])
            for name in (f"c{c}", f"c{c}_rows_not_launched"):
                level = result["engine"].get(name)
                if level is not None and level["itl_p99_s"] is not None:
                    ratios[f"engine_itl_p99_vs_decode_step_{name}"] = (
                        level["itl_p99_s"] * 1e3 / e["decode_step_ms"])
        result["ratios"] = ratios
    return result


def _on(value: Any) -> bool:
    return str(value).lower() in ("1", "true", "on")


def _setting(value: Any) -> bool | None:
    """An on / off option; unset: None."""
    return None if str(value) == "" else _on(value)


def gil_interval_us(text: str) -> float | None:
    """A `gil_switch_interval_us` option: "" the platform's default, "python" Python's own (None)."""
    if not text:
        return DEFAULT_GIL_SWITCH_INTERVAL_US
    return None if text == "python" else float(text)


def run(ctx: Context) -> dict[str, Any]:
    """Options: model (a checkpoint directory), concurrency, itl_budget_ms, prefill_rows, rows_ab,
    gil_switch_interval_us, engine_process."""
    import tempfile
    from pathlib import Path

    budget = ctx.option("itl_budget_ms", "")
    gil = gil_interval_us(ctx.option("gil_switch_interval_us", ""))
    work = dataclasses.replace(SMOKE if ctx.smoke else Workload(),
                               itl_budget_ms=float(budget) if budget else None, gil_switch_interval_us=gil,
                               prefill_rows=int(ctx.option("prefill_rows", 0)),
                               rows_ab=_on(ctx.option("rows_ab", "")),
                               engine_process=_setting(ctx.option("engine_process", "")))
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
