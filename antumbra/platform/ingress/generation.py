"""One admitted generation: what it runs, how it ends (exactly once), and its non-streaming answer."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from fastapi.responses import JSONResponse

from antumbra.platform.ingress.admission import Admission
from antumbra.platform.ingress.chat_setup import ChatSetup
from antumbra.platform.ingress.choices_response import ChoicesBuilder
from antumbra.platform.ingress.errors import replica_error
from antumbra.platform.ingress.observation import RequestRecord
from antumbra.platform.ingress.openai_requests import Kind
from antumbra.platform.ingress.openai_responses import ResponseBuilder
from antumbra.platform.ingress.replica_stream import Retries, call_ended, cancel, items, lost_replica
from antumbra.platform.ingress.served_model import ServedModel
from antumbra.platform.ingress.tenant_spec import Tenant
from antumbra.platform.ingress.usage import UsageRecord
from antumbra.platform.ingress.usage_open import RequestUsage
from antumbra.platform.messages import Delta, GenerateRequest

log = logging.getLogger(__name__)

# Starts the generation again (and `Finisher.restart`s it): -> its first item and handle call.
Reopen = Callable[[], Awaitable[tuple[Delta, Any]]]


@dataclass
class Generation:
    """A validated request ready to run, and what the response needs to say about it."""

    kind: Kind
    model: ServedModel
    tenant: Tenant
    body: Any  # CompletionRequest | ChatCompletionRequest
    gen: GenerateRequest
    response_id: str
    created: int
    started: float
    top_logprobs: int | None  # how many alternatives to report per token, None: no logprobs
    chat: ChatSetup | None = None  # chat: what the answer may hold (reasoning, tool calls)


def response_builder(gen: Generation) -> ResponseBuilder:
    tokenizer = gen.model.tokenizer
    fields: dict[str, Any] = dict(
        kind=gen.kind,
        response_id=gen.response_id,
        created=gen.created,
        model=gen.model.name,
        prompt_tokens=len(gen.gen.token_ids),
        top_logprobs=gen.top_logprobs,
        decode=lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False),
        chat_output=gen.chat.output_parser if gen.chat else None,
    )

    def one() -> ResponseBuilder:  # each choice makes its own parser of the answer
        return ResponseBuilder(**fields)

    return ChoicesBuilder([one() for _ in range(gen.gen.n)], **fields) if gen.gen.n > 1 else one()


def generation_record(
    gen: Generation,
    endpoint: str,
    ttft: float | None,
    status: int,
    error_type: str | None = None,
    acc: ResponseBuilder | None = None,
) -> RequestRecord:
    return RequestRecord(
        tenant_id=gen.tenant.id,
        model=gen.model.name,
        endpoint=endpoint,
        status=status,
        stream=bool(gen.body.stream),
        prompt_tokens=len(gen.gen.token_ids),
        cached_tokens=acc.cached_tokens if acc else 0,
        completion_tokens=acc.completion_tokens if acc else 0,
        ttft_s=ttft,
        duration_s=time.monotonic() - gen.started,
        error_type=error_type,
        **speculation_counts(acc),
    )


def speculation_counts(acc: ResponseBuilder | None) -> dict[str, int]:
    counts = acc.extension.speculation if acc is not None else None
    if counts is None:
        return {}
    return {"drafted_tokens": counts.drafted_tokens, "accepted_tokens": counts.accepted_tokens}


def usage_record(gen: Generation, acc: ResponseBuilder, received_tokens: int) -> UsageRecord:
    """The request's usage: its prompt, and of its completion what the client received."""
    return UsageRecord(
        request_id=gen.gen.request_id,
        tenant_id=gen.tenant.id,
        model=gen.model.name,
        finished_at_s=time.time(),
        prompt_tokens=acc.prompt_tokens,
        cached_tokens=acc.cached_tokens,
        completion_tokens=received_tokens,
        reasoning_tokens=min(acc.reasoning_tokens, received_tokens),
    )


@dataclass
class Finisher:
    """Ends one admitted generation exactly once, however it ends.

    It cancels the replica call if the request did not finish (the engine then aborts it and
    frees its KV), settles the tenant's limits with the tokens really used (the model's capacity
    slot once the replica call has ended: `call_ended`), and reports the
    request and its usage (`meter`). `abandon()` is the path of a client that went away (status 499).

    Usage counts the prompt of every request a replica took, and of the completion what the client
    received: all of it for a 200; for a stream, the tokens of the chunks sent before it ended
    (`delivered`, which the SSE writer advances through `sent`); for a non-streaming request that
    failed, none. A stream's usage so far is also kept in an open entry while it runs
    (`open_usage`, `before_send`, `sent`; `usage_open`), so a crash of this ingress loses at most a
    bounded tail of it.
    """

    acc: ResponseBuilder
    response: Any  # DeploymentResponseGenerator
    admission: Admission
    tasks: set[asyncio.Task]
    record: Callable[..., RequestRecord]
    observe: Callable[[RequestRecord], None]
    retries: Retries = field(default_factory=Retries)
    meter: RequestUsage | None = None
    delivered: int = 0  # completion tokens of the stream chunks sent so far
    status: int | None = None  # how it ended (499: the client went away), None while it runs
    call_end_timeout_s: float = 10.0  # the capacity slot goes back at the replica call's end, or after this

    @property
    def headers(self) -> dict[str, str]:
        """The response's headers: the tenant's rate limits and how often the generation was retried."""
        return {**self.admission.headers, **self.retries.header()}

    def finish(self, status: int, error_type: str | None = None) -> None:
        # No awaits: this runs in `finally` blocks of cancelled tasks too.
        if self.status is not None:
            return
        self.status = status
        if self.acc.finish_reason is None:
            cancel(self.response)
        self.admission.settle(self.acc.prompt_tokens + self.acc.completion_tokens, self.tasks,
                              partial(call_ended, self.response, self.call_end_timeout_s))
        self.observe(self.record(status, error_type, self.acc))
        if self.meter is not None:
            received = self.acc.completion_tokens if status == 200 else self.delivered
            self.meter.finish(self.acc, received)

    def abandon(self) -> None:
        self.finish(499)

    async def open_usage(self) -> None:
        """A stream: open its usage entry before anything is sent."""
        if self.meter is not None:
            await self.meter.open(self.acc)

    async def before_send(self) -> None:
        """Before the chunks of the delta just gathered go out: wait if the open entry lags too far."""
        if self.meter is not None:
            await self.meter.before_send(self.delivered, self.acc.completion_tokens - self.delivered)

    def sent(self) -> None:
        """The chunks of every delta gathered so far are handed to Serve's transport. The open entry
        takes them one delta later: what was handed over just now may still be inside the transport
        if this process dies, and an entry must not count what its client never got (`usage_open`)."""
        passed_transport = self.delivered
        self.delivered = self.acc.completion_tokens
        if self.meter is not None and self.status is None:
            self.meter.sent(self.acc, passed_transport)

    def restart(self, acc: ResponseBuilder, response: Any) -> None:
        """The generation starts over (a new handle call, nothing gathered yet)."""
        cancel(self.response)
        self.acc, self.response = acc, response


async def complete(
    first: Delta,
    response: Any,
    finisher: Finisher,
    idle_timeout_s: float,
    reopen: Reopen | None = None,
    retries: int = 0,
    choices: int = 1,
) -> JSONResponse:
    """A non-streaming answer: gather every delta, then one response body.

    A replica lost midway (`lost_replica`) costs the client nothing it has seen: the generation
    starts over through `reopen` (the request router picks a live replica), at most `retries` times.
    `choices`: the request's `n` (the stream ends once every choice has finished).
    """
    try:
        while True:
            try:
                async for item in items(first, response, idle_timeout_s, choices):
                    finisher.acc.add(item)
                break
            except Exception as exc:
                if reopen is None or retries <= 0 or not lost_replica(exc):
                    raise
                retries -= 1
                done = finisher.acc.completion_tokens
                log.warning("replica lost after %d tokens; starting over: %r", done, exc)
                cancel(response)
                finisher.retries.count += 1
                first, response = await reopen()
    except Exception as exc:
        error = replica_error(exc)
        error.headers = {**finisher.headers, **error.headers}
        finisher.finish(error.status, error.type)
        raise error from None
    except BaseException:
        finisher.finish(499)  # the client went away (nginx's convention; for metrics only)
        raise
    finisher.finish(200)
    return JSONResponse(finisher.acc.response().model_dump(), headers=finisher.headers)
