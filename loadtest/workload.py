"""The multi-tenant chat workload the Locust users drive, without Locust (so it tests in isolation).

* Tenants: `TenantLoad(name, api_key, rps, weight, max_tokens, message_words)`: each user of a
  tenant aims at `rps` requests per second; users are spread over tenants in proportion to
  `weight` by smooth weighted round robin (`TenantAssigner`), so the first `sum(weights)` users
  already match the proportions; `max_tokens` and `message_words` give a tenant its own request
  shape (None: the workload's). From `ANTUMBRA_LOADTEST_TENANTS`: a JSON list of objects,
  `@file.json`, or the compact form `name:key[:rps[:weight]],...` (API keys contain no ':' or ',').
* Shared system prompts: each tenant has `system_prompts` long system prompts, built from a
  fixed word list with a seed derived from the tenant's name, so every user (and every
  Locust worker process) of a tenant shares them exactly: the prefix the cache can reuse.
* Multi-turn chat: a `Conversation` starts on one of its tenant's system prompts, adds a
  random user message per turn and the assistant's answer after it, and starts over after
  `turns` turns.
* Streams: `read_sse` reads an OpenAI SSE stream and measures time to first token (first
  chunk with content) and the gaps between content chunks (inter-token latency).
"""

from __future__ import annotations

import json
import os
import random
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part over new sound take only little work know place year live me back give most very "
    "after thing our just name good sentence man think say great where help through much before line right "
    "too mean old any same tell boy follow came want show also around form three small set put end does "
    "another well large must big even such because turn here why ask went men read need land different home "
    "us move try kind hand picture again change off play spell air away animal house point page letter "
    "mother answer found study still learn should america world high every near add food between own below "
    "country plant last school father keep tree never start city earth eye light thought head under story"
).split()


@dataclass(frozen=True)
class TenantLoad:
    """One tenant's share of the load: its key, per-user request rate and share of users."""

    name: str
    api_key: str
    rps: float = 1.0
    weight: float = 1.0
    max_tokens: int | None = None  # this tenant's completion length (None: the workload's)
    message_words: int | None = None  # this tenant's user message length (None: the workload's)

    def __post_init__(self) -> None:
        if not self.name or not self.api_key:
            raise ValueError("a tenant needs a name and an API key")
        if self.rps <= 0 or self.weight <= 0:
            raise ValueError(f"tenant {self.name!r}: rps and weight must be positive")
        if any(v is not None and v < 1 for v in (self.max_tokens, self.message_words)):
            raise ValueError(f"tenant {self.name!r}: max_tokens and message_words must be >= 1")


TENANT_FIELDS = ("name", "api_key", "rps", "weight", "max_tokens", "message_words")


def parse_tenants(spec: str) -> list[TenantLoad]:
    """Tenants from JSON (`[{"name", "api_key", "rps"?, "weight"?, "max_tokens"?, "message_words"?}]`),
    `@path` to such JSON, or the compact `name:key[:rps[:weight]],...`."""
    spec = spec.strip()
    if not spec:
        raise ValueError("no tenants given: set ANTUMBRA_LOADTEST_TENANTS (name:api_key[:rps[:weight]],...)")
    if spec.startswith("@"):
        spec = Path(spec[1:]).read_text()
    if spec.lstrip().startswith("["):
        items = json.loads(spec)
        return [
            TenantLoad(**{k: item[k] for k in TENANT_FIELDS if k in item})
            for item in items
        ]
    tenants = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        fields = part.split(":")
        if len(fields) < 2 or len(fields) > 4:
            raise ValueError(f"tenant {part!r}: expected name:key[:rps[:weight]]")
        rps = float(fields[2]) if len(fields) > 2 else 1.0
        weight = float(fields[3]) if len(fields) > 3 else 1.0
        tenants.append(TenantLoad(fields[0], fields[1], rps, weight))
    return tenants


@dataclass(frozen=True)
class WorkloadConfig:
    """Knobs of the workload; `from_env` reads them from `ANTUMBRA_LOADTEST_*` variables."""

    tenants: tuple[TenantLoad, ...]
    model: str | None = None  # None: the first model /v1/models lists
    max_tokens: int = 16
    turns: int = 3
    system_prompts: int = 2
    system_words: int = 120
    message_words: int = 12
    stream_ratio: float = 0.75
    temperature: float = 0.0
    request_timeout_s: float = 120.0
    report_path: str | None = None  # where the locustfile writes per-tenant token totals at the end
    seed: int = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkloadConfig:
        e = os.environ if environ is None else environ

        def get(name: str, default: str) -> str:
            return e.get(f"ANTUMBRA_LOADTEST_{name}", "").strip() or default

        return cls(
            tenants=tuple(parse_tenants(get("TENANTS", ""))),
            model=get("MODEL", "") or None,
            max_tokens=int(get("MAX_TOKENS", "16")),
            turns=int(get("TURNS", "3")),
            system_prompts=int(get("SYSTEM_PROMPTS", "2")),
            system_words=int(get("SYSTEM_WORDS", "120")),
            message_words=int(get("MESSAGE_WORDS", "12")),
            stream_ratio=float(get("STREAM_RATIO", "0.75")),
            temperature=float(get("TEMPERATURE", "0")),
            request_timeout_s=float(get("TIMEOUT_S", "120")),
            report_path=get("REPORT", "") or None,
            seed=int(get("SEED", "0")),
        )


class TenantAssigner:
    """Smooth weighted round robin: each `next()` picks the tenant with the largest running credit."""

    def __init__(self, tenants: Iterable[TenantLoad]) -> None:
        self.tenants = list(tenants)
        if not self.tenants:
            raise ValueError("no tenants to assign")
        self._credit = [0.0] * len(self.tenants)
        self._total = sum(t.weight for t in self.tenants)

    def next(self) -> TenantLoad:
        for i, tenant in enumerate(self.tenants):
            self._credit[i] += tenant.weight
        best = max(range(len(self.tenants)), key=lambda i: self._credit[i])
        self._credit[best] -= self._total
        return self.tenants[best]


def _tenant_seed(name: str, seed: int) -> int:
    return zlib.crc32(name.encode()) ^ seed


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def system_prompts(tenant: str, count: int, num_words: int, seed: int = 0) -> list[str]:
    """The tenant's shared system prompts: the same for every user and process."""
    rng = random.Random(_tenant_seed(tenant, seed))
    return [f"You are assistant {i} of {tenant}. " + words(rng, num_words) for i in range(count)]


@dataclass
class Conversation:
    """A multi-turn chat on one of the tenant's shared system prompts."""

    system_prompts: list[str]
    turns: int
    message_words: int
    rng: random.Random
    messages: list[dict[str, str]] = field(default_factory=list)
    turn: int = 0

    def next_messages(self) -> list[dict[str, str]]:
        """The messages of the next request: history plus a new user message (a new chat every `turns`)."""
        if self.turn >= self.turns or not self.messages:
            self.messages = [{"role": "system", "content": self.rng.choice(self.system_prompts)}]
            self.turn = 0
        self.messages.append({"role": "user", "content": words(self.rng, self.message_words) + "?"})
        self.turn += 1
        return list(self.messages)

    def answer(self, text: str) -> None:
        """Record the assistant's reply (an empty or failed reply ends the chat)."""
        if text:
            self.messages.append({"role": "assistant", "content": text})
        else:
            self.turn = self.turns


def chat_body(
    model: str,
    messages: list[dict[str, str]],
    config: WorkloadConfig,
    stream: bool,
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """A chat request; `max_tokens` is the tenant's own (None: the workload's)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens or config.max_tokens,
        "temperature": config.temperature,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class StreamResult:
    """What one SSE stream delivered and when (seconds from the request's start)."""

    text: str = ""
    ttft_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    done: bool = False
    error: str | None = None
    num_bytes: int = 0

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive content chunks."""
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def cached_tokens(self) -> int:
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)


def read_sse(
    lines: Iterable[bytes | str], start: float, clock: Callable[[], float] = time.perf_counter
) -> StreamResult:
    """Read `data:` lines of an OpenAI chat/completions stream until `[DONE]`.

    Content arrives in `choices[0].delta.content` (chat) or `choices[0].text` (completions);
    an object with an `error` key is an error event. TTFT is the first content chunk's
    arrival minus `start`.
    """
    out = StreamResult()
    for raw in lines:
        line = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        out.num_bytes += len(line) + 1
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            out.done = True
            break
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            out.error = f"malformed SSE data: {data[:100]!r}"
            break
        if "error" in event:
            err = event["error"]
            out.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            break
        if event.get("usage"):
            out.usage = event["usage"]
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            piece = delta.get("content") or choice.get("text") or ""
            if piece:
                now = clock() - start
                if out.ttft_s is None:
                    out.ttft_s = now
                out.chunk_times_s.append(now)
                out.text += piece
    if not out.done and out.error is None:
        out.error = "stream ended without [DONE]"
    return out


@dataclass
class TenantTotals:
    """Per-tenant token counts over a run (what the summary's cached-token ratio is made of)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, usage: Mapping[str, Any] | None) -> None:
        self.requests += 1
        if not usage:
            return
        self.prompt_tokens += int(usage.get("prompt_tokens") or 0)
        self.completion_tokens += int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        self.cached_tokens += int(details.get("cached_tokens") or 0)
