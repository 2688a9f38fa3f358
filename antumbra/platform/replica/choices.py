"""`n > 1`: several choices for one prompt, the prompt computed once.

A request with `n` choices runs as one prefill request, then `n` choice requests:

1. The prefill request (greedy, one token, its token dropped) computes the prompt; when it
   finishes its full pages enter the replica's prefix cache, as any finished request's do.
2. The choices are then queued together: each is admitted over the cached prefix, so it only
   computes the prompt's last partial page (the engine keeps at least one token to compute, for
   the logits it samples from), and they decode side by side in one batch.

Each choice has its own request id, finish reason and seed (`choice_seed`): with a seed the n
choices are reproducible, choice 0 drawing exactly what the same request with n = 1 draws. The
outputs of all choices come back interleaved, tagged with the choice's index. Cancelling the
stream (a client gone) cancels every choice, which aborts it in the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

from antumbra.platform.messages import GenerateRequest
from antumbra.replicas.sampling_params import SamplingParams

_SEED_STRIDE = 0x9E3779B97F4A7C15  # odd (golden ratio * 2^64): choices' seeds never coincide mod 2^64
_SEED_SPAN = 1 << 64

Stream = Callable[[GenerateRequest], AsyncIterator[Any]]  # a request's engine outputs (RequestOutput)


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request seeded with `seed` (None stays None: every choice
    then draws its own from the engine). Choice 0 keeps the request's seed."""
    if seed is None or index == 0:
        return seed
    return (seed + index * _SEED_STRIDE) % _SEED_SPAN


def choice_requests(request: GenerateRequest) -> tuple[GenerateRequest, list[GenerateRequest]]:
    """(the prefill request, the n choice requests) of a request with `n` > 1."""
    prefill = dataclasses.replace(
        request, request_id=f"{request.request_id}-prompt", n=1,
        params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
    )
    choices = [
        dataclasses.replace(
            request, request_id=f"{request.request_id}-{i}", n=1,
            params=dataclasses.replace(request.params, seed=choice_seed(request.params.seed, i)),
        )
        for i in range(request.n)
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
