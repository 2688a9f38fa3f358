"""How the rows of a KV pool are stored.

The pools only allocate, copy and move rows; what a row's elements mean is decided by the model
(`replicas/model/kv_rows.py`), which encodes rows on write and decodes them on read. A format is
therefore opaque here: a width, an element dtype, and the dtype its rows decode to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PLAIN = "plain"  # the values themselves, in the model dtype


@dataclass(frozen=True)
class RowFormat:
    """One pool row: `width` elements of `dtype`, decoding to `head_dim` values of `value_dtype`.

    `encoding` names the codec ("plain": width == head_dim and dtype == value_dtype).
    """

    encoding: str
    width: int
    dtype: torch.dtype
    head_dim: int
    value_dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.width < 1 or self.head_dim < 1:
            raise ValueError(f"row format {self.encoding!r}: width and head_dim must be positive")
        if self.encoding == PLAIN and (self.width != self.head_dim or self.dtype != self.value_dtype):
            raise ValueError("a plain row stores its head_dim values in the value dtype")

    @staticmethod
    def plain(head_dim: int, dtype: torch.dtype) -> RowFormat:
        return RowFormat(PLAIN, head_dim, dtype, head_dim, dtype)

    @property
    def is_plain(self) -> bool:
        return self.encoding == PLAIN

    @property
    def row_bytes(self) -> int:
        return self.width * self.dtype.itemsize
