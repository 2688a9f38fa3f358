"""The slice served through the whole platform on one GPU, against the engine driven directly.

One run: the platform (Ray Serve, a local Redis, a tenant, the cache-affinity router, one replica
on the GPU) serves a release-layout checkpoint of the V4-Flash slice (`slice_checkpoint.py`).
Through the official `openai` client it first answers the request kinds users send (OpenAI's
default temperature 1 with no seed, top-p, a seeded request twice, chat, streaming); then, at
concurrency 1 / 8 / 32, independent prompts of 1K-16K tokens with 256 new tokens each, streamed:
TTFT p50 / p99, inter-token latency p50 / p99 and output tokens/s. After the platform stops,
the same workload runs through `Engine.stream` in this process on the same checkpoint and
settings, and the ratios give the platform's overhead.

    python -m benchmarks.serve_gpu --model DIR [--concurrency 1,8,32]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .cold_start_gpu import MAX_MODEL_LEN, SMOKE_MAX_MODEL_LEN, engine_settings
from .common import environment, write_result

MODEL_NAME = "v4-flash-slice"


@dataclass(frozen=True)
class Workload:
    new_tokens: int = 256
    min_prompt: int = 1024
    max_prompt: int = 16384
    smoke: bool = False  # the tiny checkpoint on the CPU: checks the script, measures nothing


SMOKE = Workload(new_tokens=8, min_prompt=32, max_prompt=256, smoke=True)


@dataclass
class Sample:
    ttft_s: float
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0


def _prompts(vocab: int, count: int, seed: int, work: Workload) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(work.min_prompt, work.max_prompt + 1, (count,), generator=g).tolist()
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def _timed(chunks: AsyncIterator[int]) -> Sample:
    """Consume a stream of per-chunk token counts, timing the first and the gaps between chunks."""
    started = time.perf_counter()
    sample: Sample | None = None
    last = started
    async for count in chunks:
        now = time.perf_counter()
        if count <= 0:
            continue
        if sample is None:
            sample = Sample(ttft_s=now - started)
        else:
            sample.gaps_s.extend([(now - last) / count] * count)
        sample.tokens += count
        last = now
    assert sample is not None, "the stream produced no token"
    return sample


async def _level(one: Callable[[list[int]], Awaitable[Sample]], prompts: list[list[int]], concurrency: int) -> dict:
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
        "requests": len(samples), "output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall,
        "ttft_p50_s": _pct(ttfts, 0.5), "ttft_p99_s": _pct(ttfts, 0.99),
        "itl_p50_s": _pct(gaps, 0.5) if gaps else None, "itl_p99_s": _pct(gaps, 0.99) if gaps else None,
    }


# ---------------------------------------------------------------- through the platform


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _smoke(client: Any) -> dict[str, Any]:
    """The request kinds users send, each through the openai client; -> what each returned."""
    ids = list(range(100, 164))
    out: dict[str, Any] = {}
    default = await client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=16)  # temperature 1
    out["default_temperature"] = default.usage.completion_tokens
    top_p = await client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=16, temperature=0.8, top_p=0.9)
    out["top_p"] = top_p.usage.completion_tokens
    seeded = [await client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=16, temperature=1.0, seed=5,
                                              extra_body={"ignore_eos": True}) for _ in range(2)]
    out["seeded_repeatable"] = seeded[0].choices[0].text == seeded[1].choices[0].text
    chat = await client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hello"}],
                                                max_tokens=8)
    out["chat_finish_reason"] = chat.choices[0].finish_reason
    pieces = [c async for c in await client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8,
                                                               stream=True, temperature=0.7, top_k=20)]
    out["stream_chunks"] = len(pieces)
    out["all_ok"] = (out["default_temperature"] > 0 and out["top_p"] > 0 and out["seeded_repeatable"]
                     and out["stream_chunks"] > 0)
    return out


def platform_run(model_dir: str, levels: list[int], vocab: int, work: Workload) -> dict[str, Any]:
    from openai import AsyncOpenAI

    from antumbra.platform.launch.serve_cli import local_platform

    settings = engine_settings(work.smoke)
    sched = settings["scheduler"]
    config = {"models": {MODEL_NAME: {
        "path": model_dir, "device": settings["device"], "dtype": settings["dtype"],
        "max_model_len": SMOKE_MAX_MODEL_LEN if work.smoke else MAX_MODEL_LEN, "warmup": "on",
        "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
        "max_ongoing_requests": 64,
        "num_virtual_tokens": settings["cache"].num_virtual_tokens,
    }}}
    result: dict[str, Any] = {}
    started = time.monotonic()
    with local_platform(config, port=_free_port()) as platform:
        result["start_s"] = time.monotonic() - started
        client = AsyncOpenAI(base_url=platform.base_url + "/v1", api_key=platform.api_key, max_retries=0,
                             timeout=600)

        async def one(prompt: list[int]) -> Sample:
            stream = await client.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=work.new_tokens, temperature=0.0, stream=True,
                extra_body={"ignore_eos": True},
            )

            async def counts() -> AsyncIterator[int]:
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].text:
                        yield 1
            return await _timed(counts())

        async def drive() -> None:
            result["smoke"] = await _smoke(client)
            for c in levels:
                result[f"c{c}"] = await _level(one, _prompts(vocab, max(2 * c, 8), c, work), c)
                print("platform", c, result[f"c{c}"], flush=True)
            await client.close()

        asyncio.run(drive())
    return result


# ---------------------------------------------------------------- the engine directly


def engine_run(model_dir: str, levels: list[int], vocab: int, work: Workload) -> dict[str, Any]:
    from antumbra import Engine, SamplingParams
    from antumbra.kernels.variants import compile_watch

    engine = Engine.from_pretrained(model_dir, **engine_settings(work.smoke))
    params = SamplingParams(max_tokens=work.new_tokens, temperature=0.0, ignore_eos=True)

    async def one(prompt: list[int]) -> Sample:
        async def counts() -> AsyncIterator[int]:
            async for out in engine.stream(prompt, params):
                yield len(out.new_token_ids)
        return await _timed(counts())

    result: dict[str, Any] = {}
    with compile_watch() as watch:  # mixed batches of every size: nothing may compile after the warm-up
        for c in levels:
            result[f"c{c}"] = asyncio.run(_level(one, _prompts(vocab, max(2 * c, 8), c, work), c))
            print("engine", c, result[f"c{c}"], flush=True)
    result["kernel_misses_after_warmup"] = watch.count
    result["missed_kernels"] = sorted({str(e) for e in watch.events})[:20]
    engine.check_integrity()
    return result


def run(model_dir: str, levels: list[int], work: Workload) -> dict[str, Any]:
    from antumbra.config import ModelConfig
    from antumbra.replicas.model.checkpoint import load_hf_config

    vocab = ModelConfig.from_hf(load_hf_config(model_dir)).vocab_size
    result: dict[str, Any] = {**environment(), "levels": levels, "workload": asdict(work),
                              "prompt_tokens": f"uniform {work.min_prompt}..{work.max_prompt}, independent"}
    result["platform"] = platform_run(model_dir, levels, vocab, work)
    result["engine"] = engine_run(model_dir, levels, vocab, work)
    result["checks_ok"] = bool(result["platform"].get("smoke", {}).get("all_ok")) and \
        result["engine"]["kernel_misses_after_warmup"] == 0
    if result["checks_ok"]:
        ratios = {}
        for c in levels:
            p, e = result["platform"][f"c{c}"], result["engine"][f"c{c}"]
            ratios[f"platform_vs_engine_throughput_c{c}"] = p["output_tokens_per_s"] / e["output_tokens_per_s"]
            ratios[f"platform_minus_engine_ttft_p50_ms_c{c}"] = (p["ttft_p50_s"] - e["ttft_p50_s"]) * 1e3
        result["ratios"] = ratios
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--smoke", action="store_true", help="the CPU and short prompts: checks the script")
    args = parser.parse_args()
    work = SMOKE if args.smoke else Workload()
    result = run(args.model, [int(c) for c in args.concurrency.split(",")], work)
    print(write_result("cpu-serve-smoke" if args.smoke else "h200-serve", result))
    print({"checks_ok": result["checks_ok"], "ratios": result.get("ratios")})


if __name__ == "__main__":
    main()
