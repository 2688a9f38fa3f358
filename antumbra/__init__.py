"""Antumbra: a multi-tenant serving platform for DeepSeek-V4-style hybrid-attention models.

The public names load on first use (PEP 562): `from antumbra import env` or a platform process that
never runs a model (the ingress) does not import the engine, torch or Triton.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from antumbra.replicas.engine import Engine
    from antumbra.replicas.request import RequestOutput
    from antumbra.replicas.sampling_params import SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]

_WHERE = {
    "Engine": "antumbra.replicas.engine",
    "RequestOutput": "antumbra.replicas.request",
    "SamplingParams": "antumbra.replicas.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'antumbra' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
