"""Errors the engine raises; the platform maps bad requests to HTTP 400, failures to 500 / 503."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request cannot be served as given; nothing was admitted or changed."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestFailedError(RuntimeError):
    """The engine failed this request while serving it (a step raised); it released all it held
    and the engine went on serving the others."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id} failed: {message}")
        self.request_id = request_id


class FatalEngineError(RuntimeError):
    """The engine cannot continue (its device failed, or its cache lost integrity): every request
    fails, and the replica reports unhealthy so that it is replaced."""


class EngineDeadError(RuntimeError):
    """A request reached an engine that has stopped after a fatal error."""
