"""Steady multi-tenant load through the official openai client, and what each request came to.

`SteadyLoad` runs closed-loop workers per tenant (each sends its next request when the last one
ended) until told to stop; every request becomes an `Outcome`. Prompts and the stream / plain mix
come from a seeded `random.Random`, so a run's requests are reproducible.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

from tests.faults.app import MODEL, FaultApp

WORDS = ("river", "stone", "cloud", "lantern", "orchard", "copper", "meadow", "signal", "harbor", "ember",
         "quiet", "spiral", "window", "falcon", "silver", "thread")


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class Outcome:
    tenant: str
    stream: bool
    started: float
    ended: float = 0.0
    ok: bool = False
    status: int | None = None  # HTTP status of a refused or failed request (None: 200)
    error: str | None = None
    error_event: bool = False  # a stream that ended with an SSE error event (an OpenAI error object)
    code: str | None = None  # the OpenAI error code, when there was an error body
    ttft: float | None = None  # seconds to the first streamed token
    tokens: int = 0  # completion tokens received (chunks, or with `logprobs` the tokens they name)
    chunks: int = 0  # streamed chunks that carried a choice
    answered: bool = False  # the server answered 200: a replica took the request
    prompt_tokens: int | None = None  # from the usage the client saw, if any
    cached_tokens: int = 0  # prompt tokens the engine found cached (from usage)
    retry_after: str | None = None
    retry_after_ms: str | None = None
    disconnected: bool = False  # the client closed it on purpose
    id: str | None = None  # the response id (the engine's request id)
    retries: int = 0  # times the ingress started it again on another replica (x-antumbra-retries)
    openai_shape: bool = False  # an error body of exactly {"error": {message, type, param, code}}
    prompt: str | list[int] | None = None
    text: str | None = None  # a non-streaming answer's text

    @property
    def failed(self) -> bool:
        return not self.ok and not self.disconnected

    @property
    def retry_wait_s(self) -> float:
        """How long the official client would wait before its retry: `retry-after-ms` first, then
        `Retry-After`, else a second."""
        if self.retry_after_ms is not None:
            return float(self.retry_after_ms) / 1000
        return float(self.retry_after or 1)


async def request(
    client: openai.AsyncOpenAI,
    tenant: str,
    prompt: str | list[int],
    max_tokens: int,
    *,
    stream: bool,
    model: str = MODEL,
    disconnect_after: int | None = None,
    on_token: Callable[[Outcome], None] | None = None,
    cut: asyncio.Event | None = None,
    logprobs: bool = False,
) -> Outcome:
    """One completion; never raises for what the server answers (that goes into the Outcome).

    A stream's chunk may carry several tokens; with `logprobs` each chunk names its tokens, and
    `tokens` counts those (else one per chunk).

    `disconnect_after=k` closes a stream once k tokens arrived (0: right after the response started);
    `cut` closes it at the first token after the event is set.
    """
    out = Outcome(tenant, stream, time.monotonic(), prompt=prompt)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "extra_body": {"ignore_eos": True}}
    if logprobs:
        body["logprobs"] = 1
    try:
        if not stream:
            raw = await client.completions.with_raw_response.create(**body)  # type: ignore[call-overload]
            out.retries = int(raw.headers.get("x-antumbra-retries", 0))
            reply = raw.parse()
            out.answered = True
            out.id = reply.id
            out.prompt_tokens = reply.usage.prompt_tokens if reply.usage else None
            out.tokens = reply.usage.completion_tokens if reply.usage else 0
            details = reply.usage.prompt_tokens_details if reply.usage else None
            out.cached_tokens = (details.cached_tokens or 0) if details else 0
            out.text = reply.choices[0].text if reply.choices else None
            out.ok = out.tokens == max_tokens
        else:
            chunks = await client.completions.create(  # type: ignore[call-overload]
                **body, stream=True, stream_options={"include_usage": True}
            )
            out.retries = int(chunks.response.headers.get("x-antumbra-retries", 0))
            out.answered = True
            try:
                if disconnect_after == 0:
                    out.disconnected = True
                    return out
                async for chunk in chunks:
                    if chunk.usage is not None:
                        out.prompt_tokens = chunk.usage.prompt_tokens
                        if chunk.usage.prompt_tokens_details is not None:
                            out.cached_tokens = chunk.usage.prompt_tokens_details.cached_tokens or 0
                    if not chunk.choices:
                        continue
                    if out.ttft is None:
                        out.ttft = time.monotonic() - out.started
                        out.id = chunk.id
                    out.chunks += 1
                    out.tokens += _chunk_tokens(chunk.choices[0], logprobs)
                    if on_token is not None:
                        on_token(out)
                    if (disconnect_after is not None and out.tokens >= disconnect_after) or (
                        cut is not None and cut.is_set()
                    ):
                        out.disconnected = True
                        return out
                    if chunk.choices[0].finish_reason is not None:
                        out.ok = True
            finally:
                await chunks.close()
    except openai.APIStatusError as exc:
        out.status = exc.status_code
        out.error = exc.message
        out.retry_after = exc.response.headers.get("retry-after")
        out.retry_after_ms = exc.response.headers.get("retry-after-ms")
        out.code = _code(exc.body)
        out.openai_shape = _openai_shape(exc.response)
    except openai.APIConnectionError as exc:  # the connection broke: no answer, not an error event
        out.error = str(exc)
    except openai.APIError as exc:
        # The client raises this for an SSE event that carries an OpenAI error object, with that
        # object as the body; a broken connection is the APIConnectionError above.
        out.error_event = _error_object(exc.body)
        out.error = str(exc)
        out.code = _code(exc.body)
    finally:
        out.ended = time.monotonic()
    return out


def _chunk_tokens(choice: Any, logprobs: bool) -> int:
    if not logprobs:
        return 1
    return len(choice.logprobs.tokens or []) if choice.logprobs is not None else 0


def _openai_shape(response: httpx.Response) -> bool:
    try:
        body = response.json()
    except ValueError:
        return False
    return (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict)
            and set(body["error"]) == {"message", "type", "param", "code"} and bool(body["error"]["message"]))


def _error_object(body: object) -> bool:
    """An OpenAI error object: a message, and the type and code fields (either may be null)."""
    return isinstance(body, dict) and isinstance(body.get("message"), str) and bool(body["message"]) \
        and {"type", "code"} <= set(body)


def _code(body: object) -> str | None:
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict):
            code = inner.get("code")
            return str(code) if code is not None else None
    return None


@dataclass
class SteadyLoad:
    """Closed-loop workers: `workers` per tenant, alternately streaming and not (`stream_every`)."""

    app: FaultApp
    tenants: tuple[str, ...] = ("alpha", "beta")
    workers: int = 2
    max_tokens: int = 12
    prompt_words: int = 12
    stream_every: int = 2  # every n-th request of a worker streams (1: all)
    seed: int = 0
    pause_s: float = 0.0
    on_token: Callable[[Outcome], None] | None = None  # for every streamed token
    logprobs: bool = False  # count each stream's tokens by the tokens its chunks name
    outcomes: list[Outcome] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> list[Outcome]:
        clients = {t: self.app.client(t) for t in self.tenants}
        try:
            jobs = [self._worker(clients[t], t, w, stop) for t in self.tenants for w in range(self.workers)]
            await asyncio.gather(*jobs)
        finally:
            for c in clients.values():
                await c.close()
        return self.outcomes

    async def _worker(self, client: openai.AsyncOpenAI, tenant: str, index: int, stop: asyncio.Event) -> None:
        rng = random.Random(f"{self.seed}:{tenant}:{index}")
        n = 0
        while not stop.is_set():
            prompt = f"{tenant} {index} {n}: {sentence(rng, self.prompt_words)}"
            stream = (n + index) % self.stream_every == 0
            out = await request(client, tenant, prompt, self.max_tokens, stream=stream,
                                on_token=self.on_token, logprobs=self.logprobs)
            self.outcomes.append(out)
            n += 1
            if self.pause_s:
                await asyncio.sleep(self.pause_s)


def median(values: list[float]) -> float:
    assert values, "no samples"
    return statistics.median(values)


def summary(outcomes: list[Outcome]) -> str:
    """A line for assertion messages: counts by kind, and the first few failures."""
    failed = [o for o in outcomes if o.failed]
    kinds = {"ok": sum(o.ok for o in outcomes), "failed": len(failed),
             "disconnected": sum(o.disconnected for o in outcomes)}
    sample = [(o.tenant, o.stream, o.status, o.code, (o.error or "")[:120]) for o in failed[:5]]
    return f"{kinds} first failures: {sample}"
