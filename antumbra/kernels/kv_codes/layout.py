"""Byte layouts of the release pools' rows, as the kernels address them.

The model owns the formats (`replicas/model/kv_rows.py`: `kv_row_format`, `index_row_format`) and
builds these from them; the kernels only need the offsets.

* FP8 KV row of `width` bytes, head_dim d = nope + rope:
      [0, nope)                 e4m3 codes of the non-RoPE channels
      [nope, nope + nope/64)    one UE8M0 exponent byte (k + 127) per 64 of them
      [rope_at, rope_at + rope * itemsize)   the RoPE channels in the model dtype
  `rope_at` and `width` are multiples of 8, so the RoPE channels are aligned for any model dtype.
* FP4 indexer key of `width` bytes, d channels: d/2 bytes of e2m1 codes, two a byte (element 2j in
  the low nibble of byte j), then one UE8M0 exponent byte per 32 channels at byte d/2.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_SCALE_BLOCK = 64  # non-RoPE KV channels per exponent byte
KEY_SCALE_BLOCK = 32  # indexer-key channels per exponent byte


@dataclass(frozen=True)
class Fp8Rows:
    head_dim: int  # values a row decodes to
    rope_dim: int  # trailing channels kept in the model dtype
    rope_at: int  # byte offset of the RoPE channels
    width: int  # bytes a row

    @property
    def nope(self) -> int:
        return self.head_dim - self.rope_dim

    def __post_init__(self) -> None:
        scales = -(-self.nope // KV_SCALE_BLOCK)
        if self.rope_at % 8 or self.width % 8 or self.rope_at < self.nope + scales:
            raise ValueError(f"FP8 row layout {self}: offsets must be multiples of 8 past the scales")


@dataclass(frozen=True)
class Fp4Keys:
    head_dim: int  # channels a key decodes to (even)
    width: int  # bytes a key

    def __post_init__(self) -> None:
        scales = -(-self.head_dim // KEY_SCALE_BLOCK)
        if self.head_dim % 2 or self.width < self.head_dim // 2 + scales:
            raise ValueError(f"FP4 key layout {self}: an even head_dim, a width past the scales")
