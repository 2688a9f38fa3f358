"""`n > 1` on a replica: several choices for one prompt, the prompt computed once.

The prefill request and the choices' parameters and seeds are the engine's
(`replicas/choices.py`, which `Engine.generate(n=...)` uses too, so both give the same choices for
the same seed). Each choice has its own request id and finish reason; the outputs of all choices
come back interleaved, tagged with the choice's index. Cancelling the stream (a client gone)
cancels every choice, which aborts it in the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

from antumbra.platform.messages import GenerateRequest
from antumbra.replicas.choices import PREFILL_PARAMS, choice_params

Stream = Callable[[GenerateRequest], AsyncIterator[Any]]  # a request's engine outputs (RequestOutput)


def choice_requests(request: GenerateRequest) -> tuple[GenerateRequest, list[GenerateRequest]]:
    """(the prefill request, the n choice requests) of a request with `n` > 1."""
    prefill = dataclasses.replace(
        request, request_id=f"{request.request_id}-prompt", n=1, params=PREFILL_PARAMS
    )
    choices = [
        dataclasses.replace(request, request_id=f"{request.request_id}-{i}", n=1, params=params)
        for i, params in enumerate(choice_params(request.params, request.n))
    ]
    return prefill, choices


async def fan_out(request: GenerateRequest, stream: Stream) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, output) as each choice advances, until all n have finished."""
    prefill, choices = choice_requests(request)
    async for _ in stream(prefill):  # computes the prompt; its one token is dropped
        continue
    queue: asyncio.Queue[tuple[int, Any] | BaseException] = asyncio.Queue()

    async def pump(index: int, choice: GenerateRequest) -> None:
        try:
            async for out in stream(choice):
                queue.put_nowait((index, out))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            queue.put_nowait(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise

    tasks = [asyncio.ensure_future(pump(i, c)) for i, c in enumerate(choices)]
    unfinished = set(range(len(choices)))
    try:
        while unfinished:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            index, out = item
            if out.finished:
                unfinished.discard(index)
            yield index, out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
