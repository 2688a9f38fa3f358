"""OpenAI's error shape at the REST edge: the exception the ingress raises and the body it answers.

Every failure a client sees is `{"error": {"message", "type", "param", "code"}}`; `ApiError`
carries that and its HTTP status and headers, `ErrorResponse` documents it in the OpenAPI schema.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ApiError(Exception):
    """An error answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unavailable(message: str, retry_after_s: int | None = None) -> ApiError:
    """A 503 the client may retry (after `Retry-After` seconds when given)."""
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else {}
    return ApiError(503, message, type="server_error", code="service_unavailable", headers=headers)
