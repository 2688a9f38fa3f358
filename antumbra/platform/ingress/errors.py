"""The failures the ingress meets, and the OpenAI-shaped errors it answers them with.

Every error reaches a client as `{"error": {"message", "type", "param", "code"}}`
(`openai_errors.ApiError`); `add_error_handlers` gives FastAPI's own failures (validation,
unknown routes, anything unexpected) that shape too.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.exceptions import ActorUnavailableError, RayActorError, TaskCancelledError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RequestCancelledError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from antumbra.platform.ingress.openai_errors import ApiError, invalid, unavailable
from antumbra.platform.ingress.openai_requests import validation_error

log = logging.getLogger(__name__)
# Serve's own logger: its lines carry the request id and reach the replica's log at INFO, beside
# Serve's access line of the same request.
SERVE_LOG = logging.getLogger("ray.serve")

REDIS_ERRORS = (RedisError, OSError, TimeoutError)  # Redis down, unreachable or slow
REPLICA_GONE = (RayActorError, ActorUnavailableError)  # the model replica died or cannot be reached
# The client went away: Serve cancels the request, and a response still reading or writing sees one of these.
CLIENT_GONE = (TaskCancelledError, RequestCancelledError, ClientDisconnect)


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _on_api_error(_: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc)


async def _on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(validation_error(exc.errors()))


async def _on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    err = ApiError(exc.status_code, str(exc.detail), type=kind, headers=dict(exc.headers or {}))
    return error_response(err)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, CLIENT_GONE):  # nobody is left to answer: one line, no traceback
        SERVE_LOG.info("client disconnected during %s %s", request.method, request.url.path)
        return error_response(ApiError(499, "the client disconnected", type="server_error", code="cancelled"))
    log.exception("unhandled error in the ingress")
    return error_response(
        ApiError(500, "internal server error", type="server_error", code="internal_error")
    )


def add_error_handlers(app: FastAPI) -> None:
    """Answer every failure of `app` in OpenAI's error shape."""
    app.exception_handler(ApiError)(_on_api_error)
    app.exception_handler(RequestValidationError)(_on_validation_error)
    app.exception_handler(StarletteHTTPException)(_on_http_error)
    app.exception_handler(Exception)(_on_unexpected)


def context_error(max_len: int, prompt: int, completion: int | None, param: str) -> ApiError:
    """A 400 `context_length_exceeded`: the prompt alone (`completion=None`), or with the
    completion, is too long."""
    if completion is None:
        message = (
            f"This model's maximum context length is {max_len} tokens. However, your prompt has "
            f"{prompt} tokens (at least one generated token must also fit)."
        )
    else:
        message = (
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{prompt + completion} tokens ({prompt} in the prompt, {completion} for the completion)."
        )
    return invalid(message, param, code="context_length_exceeded")


def model_not_ready(model: str) -> ApiError:
    return unavailable(f"the model `{model}` is not ready", retry_after_s=5)


def replica_error(exc: BaseException) -> ApiError:
    """The OpenAI-shaped error for a failure between the ingress and a replica."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, BackPressureError):
        wait = max(1, round(exc.retry_after_s or 1))
        return unavailable("the model is over capacity; retry shortly", retry_after_s=wait)
    if isinstance(exc, (DeploymentUnavailableError, *REPLICA_GONE)):
        return unavailable("the model replica became unavailable", retry_after_s=1)
    if isinstance(exc, TimeoutError):
        return ApiError(503, "the model replica stopped responding", type="server_error", code="timeout")
    if isinstance(exc, RequestCancelledError | asyncio.CancelledError):
        return ApiError(499, "the request was cancelled", type="server_error", code="cancelled")
    log.error("generation failed: %r", exc)
    return ApiError(500, "the model replica failed", type="server_error", code="internal_error")
