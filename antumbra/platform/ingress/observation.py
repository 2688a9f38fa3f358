"""What the ingress reports about each generation request, to a configurable observer (metrics)."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestRecord:
    """One finished generation request, for metrics (`IngressSettings.request_observer`)."""

    tenant_id: str | None
    model: str | None
    endpoint: str
    status: int
    stream: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    duration_s: float = 0.0
    error_type: str | None = None
    drafted_tokens: int = 0  # speculative decoding: draft tokens verified for the request
    accepted_tokens: int = 0  # ... and accepted


def _import_callable(path: str) -> Callable[..., Any]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class RequestObserver:
    """Calls the `"module:callable"` at `target` (None: nothing) with each `RequestRecord`."""

    def __init__(self, target: str | None) -> None:
        self._observer = _import_callable(target) if target else None

    def __call__(self, record: RequestRecord) -> None:
        if self._observer is None:
            return
        try:
            self._observer(record)
        except Exception:  # metrics must never fail a request
            log.exception("request observer failed")
