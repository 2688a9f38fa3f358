"""Server-sent events for a streaming generation: one chunk per replica delta, then `[DONE]`.

Once the 200 and its headers are out, a failure can only travel in the stream: it becomes an
error event (OpenAI's error shape) followed by `[DONE]`, so a client never waits on a dead stream.

The stream's usage entry is opened before the first event and kept up with what was sent
(`Finisher.open_usage`, `before_send`, `sent`), so a crash of the ingress loses at most the bound
that `usage_open` documents.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from antumbra.platform.ingress.errors import CLIENT_GONE, SERVE_LOG, replica_error
from antumbra.platform.ingress.generation import Finisher, Generation
from antumbra.platform.ingress.replica_stream import items
from antumbra.platform.messages import Delta

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SSEResponse(StreamingResponse):
    """A streaming response that ends its generation (`finisher.abandon`) however it ends, even if its
    body never started (a client that disconnects before the first event must still release the
    replica). A client that goes away is one line in the log, not a traceback."""

    def __init__(
        self, content: AsyncIterator[str], finisher: Finisher, response_id: str, **kwargs: Any
    ) -> None:
        super().__init__(content, **kwargs)
        self._finisher = finisher
        self._response_id = response_id

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except CLIENT_GONE:
            pass  # Serve cancelled the request because the client went away: logged below
        finally:
            self._finisher.abandon()
            if self._finisher.status == 499:
                SERVE_LOG.info("client disconnected from stream %s after %d completion tokens",
                               self._response_id, self._finisher.delivered)


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def sse_events(
    gen: Generation, first: Delta, response: Any, finisher: Finisher, idle_timeout_s: float
) -> AsyncIterator[str]:
    """SSE events: one chunk per delta, a usage chunk if asked, `[DONE]`; a failure is an error event."""
    acc = finisher.acc
    try:
        await finisher.open_usage()
        if gen.kind == "chat":
            yield sse_event(acc.role_chunk())
        async for item in items(first, response, idle_timeout_s, gen.gen.n):
            chunks = acc.chunks(item, acc.add(item))
            await finisher.before_send()
            for chunk in chunks:
                yield sse_event(chunk)
            finisher.sent()  # resumed: the server sent the chunks
        if gen.body.include_usage:
            yield sse_event(acc.usage_chunk())
        finisher.finish(200)
        yield DONE
    except Exception as exc:
        err = replica_error(exc)
        log.warning("stream %s failed: %s", gen.response_id, err.message)
        finisher.finish(err.status, err.type)
        yield sse_event(err.body())
        yield DONE
    finally:
        finisher.abandon()  # cancelled or closed early: no-op if finished above


def sse_response(
    gen: Generation, first: Delta, response: Any, finisher: Finisher, idle_timeout_s: float
) -> SSEResponse:
    """The streaming answer of an admitted generation (its rate-limit headers included)."""
    events = sse_events(gen, first, response, finisher, idle_timeout_s)
    headers = {**finisher.headers, **SSE_HEADERS}
    return SSEResponse(events, finisher, gen.response_id, media_type="text/event-stream", headers=headers)
