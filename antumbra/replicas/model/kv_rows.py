"""What the KV and indexer-key pools store per row, by numerics mode, and the codecs between
rows and values.

`exact` stores every row as its values in the model dtype. `release` (numerics.py) stores:

* **KV rows** (SWA rows and main compressed entries), for head_dim d with r RoPE channels, as bytes:

      [0, d-r)             e4m3 codes of the non-RoPE channels
      [d-r, d-r+n)         one UE8M0 exponent byte (k + 127) per 64 of them, n = ceil((d-r)/64)
      up to a multiple of 8: zero padding
      then r * s bytes     the RoPE channels in the model dtype (s bytes each), kept for precision

  At V4 widths (d = 512, r = 64, bf16) that is 448 + 7 + 1 + 128 = 584 bytes against 1024 in bf16.
* **Indexer keys** (Hadamard-rotated), for width d: d/2 bytes of e2m1 codes packed two a byte (low
  nibble first), then one exponent byte per 32 channels, padded to a multiple of 4: 68 bytes at
  d = 128 against 256.

Invariant: `decode(encode(x))` equals what the plain pools store in the same numerics
(`Numerics.kv` / `Numerics.indexer` of x, cast to the model dtype), bit for bit; so the storage
changes capacity, never results. A format that stores codes requires the matching quantisation to
be on: rows encoded in one mode are never read in another.
"""

from __future__ import annotations

import torch

from antumbra.cachestore.row_format import RowFormat
from antumbra.kernels.kv_codes.layout import Fp4Keys, Fp8Rows

from .numerics import Numerics
from .quant import KV_FP8_BLOCK, MXFP4_BLOCK, fp4_decode, fp4_encode, fp8_decode, fp8_encode, hadamard_rotate

FP8_KV = "fp8_e4m3_ue8m0_b64_rope_plain"
FP4_KEYS = "e2m1_ue8m0_b32"


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ------------------------------------------------------------------------------ formats


def kv_row_format(
    numerics: Numerics, head_dim: int, rope_dim: int, dtype: torch.dtype, packed: bool = True
) -> RowFormat:
    """Format of SWA and main compressed rows; `packed=False` keeps the model dtype in any mode."""
    if not (packed and numerics.kv_fp8):
        return RowFormat.plain(head_dim, dtype)
    _nope, _scales, rope_at = _kv_layout(head_dim, rope_dim)
    width = _round_up(rope_at + rope_dim * dtype.itemsize, 8)
    return RowFormat(FP8_KV, width, torch.uint8, head_dim, dtype)


def index_row_format(
    numerics: Numerics, index_head_dim: int, dtype: torch.dtype, packed: bool = True
) -> RowFormat:
    """Format of the indexer's compressed keys."""
    if not (packed and numerics.indexer_fp4):
        return RowFormat.plain(index_head_dim, dtype)
    codes, scales = _index_layout(index_head_dim)
    return RowFormat(FP4_KEYS, _round_up(codes + scales, 4), torch.uint8, index_head_dim, dtype)


def fp8_rows(fmt: RowFormat, rope_dim: int) -> Fp8Rows | None:
    """The kernels' view of FP8 KV rows (None for plain rows)."""
    if fmt.is_plain:
        return None
    if fmt.encoding != FP8_KV:
        raise ValueError(f"not an FP8 KV row format: {fmt.encoding!r}")
    _nope, _scales, rope_at = _kv_layout(fmt.head_dim, rope_dim)
    return Fp8Rows(fmt.head_dim, rope_dim, rope_at, fmt.width)


def fp4_keys(fmt: RowFormat) -> Fp4Keys | None:
    """The kernels' view of FP4 indexer keys (None for plain rows)."""
    if fmt.is_plain:
        return None
    if fmt.encoding != FP4_KEYS:
        raise ValueError(f"not an FP4 indexer key format: {fmt.encoding!r}")
    return Fp4Keys(fmt.head_dim, fmt.width)


# ------------------------------------------------------------------------------ KV rows


def _kv_layout(head_dim: int, rope_dim: int) -> tuple[int, int, int]:
    """-> (non-RoPE channels, their exponent bytes, byte offset of the RoPE channels)."""
    nope = head_dim - rope_dim
    scales = -(-nope // KV_FP8_BLOCK)
    return nope, scales, _round_up(nope + scales, 8)


def _index_layout(dim: int) -> tuple[int, int]:
    """-> (bytes of packed e2m1 codes, exponent bytes after them)."""
    return dim // 2, -(-dim // MXFP4_BLOCK)


def encode_kv(fmt: RowFormat, x: torch.Tensor, rope_dim: int, numerics: Numerics) -> torch.Tensor:
    """KV values `[N, d]` (RoPE applied, model dtype) -> pool rows `[N, fmt.width]` of `fmt.dtype`."""
    if fmt.is_plain:
        return numerics.kv(x, rope_dim).to(fmt.dtype)
    if fmt.encoding != FP8_KV or not numerics.kv_fp8:
        raise ValueError(
            f"KV rows stored as {fmt.encoding!r} need FP8 KV numerics; to switch numerics after the pools "
            "exist, store rows in the model dtype (CacheConfig.kv_storage='model_dtype')"
        )
    nope, scales, rope_at = _kv_layout(fmt.head_dim, rope_dim)
    codes, exps = fp8_encode(x[..., :nope], KV_FP8_BLOCK)
    rows = torch.zeros(*x.shape[:-1], fmt.width, dtype=torch.uint8, device=x.device)
    rows[..., :nope] = codes
    rows[..., nope : nope + scales] = exps
    rope_bytes = x[..., nope:].to(fmt.value_dtype).contiguous().view(torch.uint8)
    rows[..., rope_at : rope_at + rope_bytes.shape[-1]] = rope_bytes
    return rows


def decode_kv(fmt: RowFormat, rows: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Pool rows `[..., fmt.width]` -> KV values `[..., d]` in the model dtype (plain rows as they are)."""
    if fmt.is_plain:
        return rows
    nope, scales, rope_at = _kv_layout(fmt.head_dim, rope_dim)
    nope_values = fp8_decode(rows[..., :nope], rows[..., nope : nope + scales], KV_FP8_BLOCK)
    rope_bytes = rope_dim * fmt.value_dtype.itemsize
    rope = rows[..., rope_at : rope_at + rope_bytes].contiguous().view(fmt.value_dtype)
    return torch.cat([nope_values.to(fmt.value_dtype), rope], dim=-1)


# ------------------------------------------------------------------------------ indexer keys


def encode_index(fmt: RowFormat, x: torch.Tensor, numerics: Numerics) -> torch.Tensor:
    """Indexer keys `[N, d]` (RoPE applied, not yet rotated) -> pool rows `[N, fmt.width]`."""
    if fmt.is_plain:
        return numerics.indexer(x).to(fmt.dtype)
    if fmt.encoding != FP4_KEYS or not numerics.indexer_fp4:
        raise ValueError(
            f"indexer keys stored as {fmt.encoding!r} need FP4 indexer numerics; to switch numerics "
            "after the pools exist, store rows in the model dtype (CacheConfig.kv_storage='model_dtype')"
        )
    half, scales = _index_layout(fmt.head_dim)
    codes, exps = fp4_encode(hadamard_rotate(x), MXFP4_BLOCK)
    rows = torch.zeros(*x.shape[:-1], fmt.width, dtype=torch.uint8, device=x.device)
    rows[..., :half] = codes
    rows[..., half : half + scales] = exps
    return rows


def decode_index(fmt: RowFormat, rows: torch.Tensor) -> torch.Tensor:
    """Pool rows `[..., fmt.width]` -> rotated indexer keys `[..., d]` in the model dtype."""
    if fmt.is_plain:
        return rows
    half, scales = _index_layout(fmt.head_dim)
    return fp4_decode(rows[..., :half], rows[..., half : half + scales], MXFP4_BLOCK).to(fmt.value_dtype)
