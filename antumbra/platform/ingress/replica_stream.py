"""Calling a model replica: start a generation, read its items, cancel it.

A generation is one streaming handle call (`ModelServer.generate`) yielding dict items (see
`platform.messages`). Over capacity (`max_queued_requests`) the call fails with a 503; a replica that
dies before the first item is retried on another replica; a replica silent for `idle_timeout_s`
is a timeout, never a hang. A replica lost after the first item (`lost_replica`) ends a stream with
an error event; a non-streaming answer, of which the client has seen nothing yet, starts over on
another replica (`generation.complete`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from antumbra.platform.ingress.errors import REPLICA_GONE, replica_error
from antumbra.platform.ingress.openai_errors import ApiError
from antumbra.platform.messages import REPLICA_UNAVAILABLE, Delta, ErrorItem, GenerateRequest, StreamItem

log = logging.getLogger(__name__)


RETRIES_HEADER = "x-antumbra-retries"


@dataclass
class Retries:
    """How often a generation started again on another replica; answered as `RETRIES_HEADER`."""

    count: int = 0

    def header(self) -> dict[str, str]:
        return {RETRIES_HEADER: str(self.count)}


def cancel(response: Any) -> None:
    """Cancel a handle call (the replica's engine aborts the request), ignoring how it had ended.

    `DeploymentResponseGenerator.cancel()` re-raises the call's own failure (a `BackPressureError`,
    say) when it never reached a replica; there is nothing left to cancel then.
    """
    with contextlib.suppress(Exception):
        response.cancel()


async def next_item(response: Any, idle_timeout_s: float) -> StreamItem | None:
    """The next item of a replica stream, None at its end; a silent replica times out."""
    try:
        async with asyncio.timeout(idle_timeout_s):
            return await response.__anext__()
    except StopAsyncIteration:
        return None


async def call_ended(response: Any, timeout_s: float) -> None:
    """Wait until a handle call has ended as Ray Serve counts it: its stream closed, failed or was
    cancelled (or `timeout_s` passed). The item that finishes a generation arrives before the
    replica's stream closes, and Ray Serve's router holds the replica's slot until then."""
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                await response.__anext__()
    except Exception:  # StopAsyncIteration (closed), the call's failure, its cancellation, the timeout
        return


def lost_replica(exc: BaseException) -> bool:
    """Whether a generation failed because its replica died or its engine stopped: nothing about the
    request itself, so it may run again elsewhere."""
    return isinstance(exc, REPLICA_GONE) or (isinstance(exc, ApiError) and exc.code == REPLICA_UNAVAILABLE)


def _item_error(item: ErrorItem, *, detailed: bool) -> ApiError:
    """The ApiError of a replica's error item (with its `param` and `code` when `detailed`)."""
    detail = item["error"]
    if not detailed:
        return ApiError(item.get("status", 500), detail["message"], type=detail["type"])
    return ApiError(
        item.get("status", 500),
        detail["message"],
        type=detail["type"],
        param=detail.get("param"),
        code=detail.get("code"),
    )


async def open_stream(
    stream_handle: Any,
    request: GenerateRequest,
    *,
    attempts: int,
    idle_timeout_s: float,
    retries: Retries | None = None,
) -> tuple[Delta, Any]:
    """Start the generation and wait for its first item; retry replicas that die before it, or
    whose engine has stopped (nothing of the request ran there).

    Returns the first item and the handle call; raises the OpenAI-shaped error of a failure.
    """
    for attempt in range(attempts):
        response = None
        try:
            # Backpressure (a full queue) can surface from `.remote()` itself or from the first item.
            response = stream_handle.generate.remote(request)
            first = await next_item(response, idle_timeout_s)
        except BaseException as exc:
            if response is not None:
                cancel(response)
            if not isinstance(exc, Exception):  # cancelled: the client is gone
                raise
            if isinstance(exc, REPLICA_GONE) and attempt + 1 < attempts:
                log.warning("replica failed before the first token of %s; retrying", request.request_id)
                if retries is not None:
                    retries.count += 1
                continue
            raise replica_error(exc) from None
        if first is None:
            raise ApiError(500, "the model replica returned no output", type="server_error")
        if "error" in first:
            cancel(response)
            if first["error"]["code"] == REPLICA_UNAVAILABLE and attempt + 1 < attempts:
                log.warning("replica's engine stopped before %s ran; retrying", request.request_id)
                if retries is not None:
                    retries.count += 1
                continue
            raise _item_error(first, detailed=True)
        return first, response
    raise AssertionError("unreachable")


async def items(first: Delta, response: Any, idle_timeout_s: float, choices: int = 1) -> AsyncIterator[Delta]:
    """`first`, then the rest of the stream up to the item that finishes the last of its `choices`
    (items carry their choice's `index` when n > 1); errors raise."""
    item: StreamItem | None = first
    unfinished = set(range(choices))
    while item is not None:
        if "error" in item:
            raise _item_error(item, detailed=item["error"]["code"] == REPLICA_UNAVAILABLE)
        yield item
        if item.get("finish_reason") is not None:
            unfinished.discard(item.get("index", 0))
            if not unfinished:
                return
        item = await next_item(response, idle_timeout_s)
    raise ApiError(500, "the model replica ended the stream without finishing", type="server_error")
