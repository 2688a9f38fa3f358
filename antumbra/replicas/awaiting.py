"""Waiting on requests handed to a `Driver`: to completion from any thread, or snapshot by snapshot
on an event loop.

The engine and its composed parts (training, disaggregation) all wait this way; each function takes
the driver it submits to, so none of them needs the engine. A caller that stops waiting (an
exception, a cancelled coroutine) aborts what it submitted: nothing is left running unobserved.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Protocol

from .driver import Driver, Sink
from .request import Request, RequestOutput


class Aborts(Protocol):
    """What a stream's consumer needs of whoever runs its request: a way to stop it."""

    def abort(self, request_id: str) -> bool: ...


def wait_all(driver: Driver, requests: list[Request]) -> list[RequestOutput]:
    """Submit the requests together and block until each has finished; -> their final outputs in
    order. A request the engine fails raises its error (RequestFailedError)."""
    futures: list[Future] = []
    try:
        futures = [Future() for _ in requests]
        driver.submit_all(requests, [future_sink(f) for f in futures])
        return [f.result() for f in futures]
    except BaseException:
        for request in requests:
            driver.abort(request.request_id)
        raise


async def wait_one(driver: Driver, request: Request) -> RequestOutput:
    """`wait_all` of one request for an event loop; a cancelled caller aborts the request."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def sink(item: RequestOutput | BaseException) -> None:
        def settle() -> None:
            if done.done():
                return
            if isinstance(item, BaseException):
                done.set_exception(item)
            elif item.finished:
                done.set_result(item)

        if not loop.is_closed():
            loop.call_soon_threadsafe(settle)

    driver.submit(request, sink)
    try:
        return await done
    except asyncio.CancelledError:
        driver.abort(request.request_id)
        raise


async def stream_outputs(driver: Aborts, submit: Callable[[Sink], str]) -> AsyncIterator[RequestOutput]:
    """Snapshots of the request `submit(sink)` queues (-> its id) as it advances; the last one has
    `finish_reason` set. A consumer that stops reading before then aborts the request."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def sink(item: RequestOutput | BaseException) -> None:
        if not loop.is_closed():  # the consumer's loop may be gone (it stopped reading)
            loop.call_soon_threadsafe(queue.put_nowait, item)

    rid = submit(sink)
    finished = False
    held: RequestOutput | BaseException | None = None  # taken from the queue, not handed over yet
    try:
        while not finished:
            item = held if held is not None else await queue.get()
            held = None
            if isinstance(item, BaseException):
                finished = True
                raise item
            # A consumer that fell behind gets everything queued as one snapshot: one item per
            # step is what costs it time (a Serve replica pays a hop per item), not the tokens.
            while not item.finished and not queue.empty():
                later = queue.get_nowait()
                if isinstance(later, BaseException):
                    held = later
                    break
                item = merged(item, later)
            finished = item.finished
            yield item
    finally:
        if not finished:
            driver.abort(rid)


def merged(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """`later` (cumulative fields are the latest) with the new tokens and text of both."""
    return dataclasses.replace(later, new_token_ids=earlier.new_token_ids + later.new_token_ids,
                               new_text=earlier.new_text + later.new_text)


def future_sink(future: Future) -> Sink:
    """A sink that settles `future` with the request's final output, or its error."""

    def sink(item: RequestOutput | BaseException) -> None:
        if future.done():  # the engine died after the request finished: nothing left to say
            return
        if isinstance(item, BaseException):
            future.set_exception(item)
        elif item.finished:
            future.set_result(item)

    return sink
