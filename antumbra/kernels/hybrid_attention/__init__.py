"""Hybrid sparse attention: SWA window + compressed extras (C4 top-k or C128) + per-head sink.

`reference.hybrid_attention_reference` is the definition; `triton` holds the kernels
(`hybrid_attention_decode`, `hybrid_attention_prefill`). The Triton module is imported
on first use so that importing this package does not define kernels before
`TRITON_INTERPRET` is set.
"""

from __future__ import annotations

from typing import Any

from .reference import hybrid_attention_reference

__all__ = ["hybrid_attention_reference", "hybrid_attention_decode", "hybrid_attention_prefill"]


def __getattr__(name: str) -> Any:
    if name in ("hybrid_attention_decode", "hybrid_attention_prefill", "hybrid_attention"):
        from . import triton as _kernels

        return getattr(_kernels, name)
    raise AttributeError(name)
