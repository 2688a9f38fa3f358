"""Lightning-indexer scores fused with radix-select top-k, emitting pool rows.

`reference` holds the definition (`indexer_topk_reference`, `topk_rows_reference`);
`triton` the kernels (`indexer_topk`, `topk_rows`). The Triton module is imported on
first use so that importing this package does not define kernels before
`TRITON_INTERPRET` is set.
"""

from __future__ import annotations

from typing import Any

from .reference import indexer_scores_reference, indexer_topk_reference, topk_rows_reference

__all__ = [
    "indexer_scores_reference",
    "indexer_topk_reference",
    "topk_rows_reference",
    "indexer_topk",
    "topk_rows",
]


def __getattr__(name: str) -> Any:
    if name in ("indexer_topk", "topk_rows"):
        from . import triton as _kernels

        return getattr(_kernels, name)
    raise AttributeError(name)
