"""Reading a request's JSON body: bounded in size before and while reading, strict JSON only.

The body is parsed on the ingress's event loop, which every stream's chunks pass, and a parser holds
the GIL for the whole call, so a long prompt's parse delays those chunks. pydantic-core's parser
reads a body of token ids in about half the time of `json.loads`; `json.loads` parses only what it
refuses (lone surrogates, nesting past its depth), so what is accepted and what each error says
stay as they were.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pydantic_core
from fastapi import Request

from antumbra.platform.ingress.openai_errors import ApiError, invalid


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _short(exc: BaseException) -> str:
    return "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]


async def read_json(request: Request, limit_bytes: int) -> Any:
    """The body as JSON; 413 past `limit_bytes` (from Content-Length, or while reading a chunked
    body), 400 for an empty body or anything but strict JSON (no NaN, no runaway nesting)."""
    too_large = ApiError(413, f"the request body exceeds {limit_bytes} bytes", code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise invalid("invalid Content-Length header")
        if int(length) > limit_bytes:
            raise too_large
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit_bytes:
            raise too_large
    if not data:
        raise invalid("the request body is empty; send a JSON object")
    return parse_body(bytes(data))


def parse_body(data: bytes) -> Any:
    """`data` as strict JSON (no NaN or Infinity); 400 for anything else."""
    with contextlib.suppress(ValueError):  # the reference parser below decides, and names the error
        return pydantic_core.from_json(data, allow_inf_nan=False)
    try:
        return json.loads(data, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise invalid(f"the request body is not valid JSON: {_short(exc)}") from None
