"""Lightning-indexer scores fused with radix-select top-k, emitting pool rows.

`reference` holds the definition (`indexer_topk_reference`, `topk_rows_reference`);
`triton` the kernels (`indexer_topk`, the two-launch `topk_rows`); `onepass` the one-launch
select and the `topk_rows` that picks between them. The Triton module is imported on
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
    if name == "indexer_topk":
        from . import triton as _kernels

        return _kernels.indexer_topk
    if name == "topk_rows":  # the one-launch select where it fits, else the two launches
        from . import onepass as _onepass

        return _onepass.topk_rows
    raise AttributeError(name)
