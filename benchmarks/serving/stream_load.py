"""Timed streams for the platform benchmark: a stream's sample, a concurrency level, and the clients
that read the same kind of stream at different depths of the platform.

- `http_level`: SSE over plain HTTP through Serve's proxy and the ingress, what users see;
- `handle_level`: the model replica's `generate` through a Serve deployment handle, as the ingress
  calls it: no proxy, no ingress, only Ray's streaming between the replica and its caller.

`in_own_process` runs either in a spawned process, which shares no interpreter with the Ray driver
that started the platform (a real client never does). The client's gaps less the replica's own
(`ModelServer.take_gap_samples`) are what each hop adds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Any

from ..lib.timing import percentile

# Serve's HAProxy mode for a cluster a benchmark starts (`serve_env.serve_environment` around the
# platform's start): the HAProxy that Ray ships in front of the ingress replicas, which serve HTTP
# themselves, instead of Serve's proxy. Measured, not offered as a platform setting.
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}


@dataclass
class Sample:
    ttft_s: float
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0


async def timed(chunks: AsyncIterator[tuple[int, bool]], started: float) -> Sample:
    """Consume a stream of (tokens, timed) per chunk, from `started` (before the request was sent):
    the first timed chunk gives the TTFT, the later ones the gaps; untimed tokens only count."""
    sample: Sample | None = None
    last = started
    async for count, is_timed in chunks:
        now = time.perf_counter()
        if count <= 0:
            continue
        if not is_timed:
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


async def level(one: Callable[[list[int]], Awaitable[Sample]], prompts: list[list[int]],
                concurrency: int) -> dict[str, Any]:
    """`prompts` streamed `concurrency` at a time: throughput, TTFT and inter-token percentiles."""
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


@dataclass(frozen=True)
class Load:
    """One level's streams: greedy, `new_tokens` each, never stopped early."""

    model: str
    prompts: list[list[int]]
    concurrency: int
    new_tokens: int


async def http_level(base_url: str, api_key: str | None, load: Load) -> dict[str, Any]:
    """The level over plain HTTP (SSE parsed here). The openai client walks every element of the
    request body in Python (about 25 ms per 1000 prompt tokens), which would be timed as the
    platform's. Every body is encoded before the level starts: encoding a long prompt's body on
    this loop as its request starts would hold up the chunks of the streams already running here,
    and their gaps would be timed as the platform's."""
    import httpx

    http = httpx.AsyncClient(base_url=base_url, timeout=600, headers={"Authorization": f"Bearer {api_key}"},
                             limits=httpx.Limits(max_connections=256, max_keepalive_connections=256))
    bodies = {id(prompt): json.dumps({"model": load.model, "prompt": prompt, "max_tokens": load.new_tokens,
                                      "temperature": 0.0, "stream": True, "ignore_eos": True,
                                      "stream_options": {"include_usage": True}})
              for prompt in load.prompts}

    async def one(prompt: list[int]) -> Sample:
        body = bodies[id(prompt)]
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
        return await timed(counts(), started)

    try:
        return await level(one, load.prompts, load.concurrency)
    finally:
        await http.aclose()


async def handle_level(deployment: str, app: str, load: Load) -> dict[str, Any]:
    """The level through a Serve handle to the model deployment, the call the ingress makes."""
    from ray import serve

    from antumbra.platform.messages import GenerateRequest
    from antumbra.replicas.sampling_params import SamplingParams

    handle = serve.get_deployment_handle(deployment, app_name=app).options(stream=True)
    params = SamplingParams(max_tokens=load.new_tokens, temperature=0.0, ignore_eos=True)

    async def one(prompt: list[int]) -> Sample:
        request = GenerateRequest(request_id=f"hop-{uuid.uuid4().hex}", token_ids=prompt, params=params,
                                  namespace=f"{load.model}:stream-load")
        started = time.perf_counter()

        async def counts() -> AsyncIterator[tuple[int, bool]]:
            response: Any = handle.generate.remote(request)  # a stream: the handle's options say so
            async for item in response:
                if "error" in item:
                    raise RuntimeError(f"the replica answered an error: {item['error']}")
                yield len(item["token_ids"]), True
        return await timed(counts(), started)

    return await level(one, load.prompts, load.concurrency)


def _http_level_sync(base_url: str, api_key: str | None, load: Load) -> dict[str, Any]:
    return asyncio.run(http_level(base_url, api_key, load))


def _handle_level_sync(gcs_address: str, deployment: str, app: str, load: Load) -> dict[str, Any]:
    import ray

    ray.init(address=gcs_address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        return asyncio.run(handle_level(deployment, app, load))
    finally:
        ray.shutdown()


def http_in_own_process(base_url: str, api_key: str | None, load: Load) -> dict[str, Any]:
    """`http_level` in a spawned process: its own interpreter, its own GIL."""
    return _in_own_process(_http_level_sync, base_url, api_key, load)


def handle_in_own_process(gcs_address: str, deployment: str, app: str, load: Load) -> dict[str, Any]:
    """`handle_level` in a spawned process that joins the Ray cluster at `gcs_address` as a driver."""
    return _in_own_process(_handle_level_sync, gcs_address, deployment, app, load)


def _in_own_process(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()
