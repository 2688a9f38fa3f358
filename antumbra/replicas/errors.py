"""Errors the engine raises for bad requests; the platform maps them to HTTP 400."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request cannot be served as given; nothing was admitted or changed."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
