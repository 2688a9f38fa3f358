"""Release-numerics codec kernels (CPU interpreter) against the model's PyTorch codecs, bit for bit.

`fp8_roundtrip` / `indexer_roundtrip` against `quant.fp8_roundtrip` / `Numerics.indexer`; the row
stores against `kv_rows.encode_kv` / `encode_index` (whole rows, padding included), on values that
span many binades with an all-zero block and blocks under the scale floors.
"""

from __future__ import annotations

import pytest
import torch

from antumbra.kernels.kv_codes import triton as codes
from antumbra.replicas.model.kv_rows import (
    encode_index,
    encode_kv,
    fp4_keys,
    fp8_rows,
    index_row_format,
    kv_row_format,
)
from antumbra.replicas.model.numerics import RELEASE
from antumbra.replicas.model.quant import FP8_BLOCK, fp8_roundtrip

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _values(rows: int, width: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    binades = torch.randint(-20, 20, (rows, width), generator=g).float()
    x = torch.randn(rows, width, generator=g) * torch.exp2(binades)
    x[0, : min(64, width)] = 0.0  # an all-zero block
    x[1] *= 1e-9  # under the floors
    x[2, 3] = 2.0**-130  # a subnormal input
    return x.to(dtype)


@DTYPES
def test_fp8_roundtrip_matches_quant(dtype) -> None:
    x = _values(5, 3 * 128 + 40, 1, dtype).view(5, 1, -1)  # a partial last block, leading dims kept
    got = codes.fp8_roundtrip(x)
    assert got.shape == x.shape and got.dtype == dtype
    assert torch.equal(got, fp8_roundtrip(x, FP8_BLOCK))


@DTYPES
@pytest.mark.parametrize("width", [16, 32, 128])
def test_indexer_roundtrip_matches_numerics(dtype, width) -> None:
    q = _values(6, width, 2, dtype).view(3, 2, width)
    assert torch.equal(codes.indexer_roundtrip(q), RELEASE.indexer(q))


@DTYPES
@pytest.mark.parametrize(("head_dim", "rope_dim"), [(64, 16), (128, 32), (512, 64)])
def test_store_fp8_rows_matches_encode_kv(dtype, head_dim, rope_dim) -> None:
    fmt = kv_row_format(RELEASE, head_dim, rope_dim, dtype)
    values = _values(4, head_dim, 3, dtype)
    pool = torch.full((9, fmt.width), 0xAB, dtype=torch.uint8)  # poisoned: every byte must be written
    rows = torch.tensor([7, 0, 3, 5])
    layout = fp8_rows(fmt, rope_dim)
    assert layout is not None
    codes.store_fp8_rows(values, pool, rows, layout)
    assert torch.equal(pool[rows], encode_kv(fmt, values, rope_dim, RELEASE))
    untouched = torch.tensor([1, 2, 4, 6, 8])
    assert (pool[untouched] == 0xAB).all()


@DTYPES
@pytest.mark.parametrize("width", [16, 32, 128])
def test_store_fp4_keys_matches_encode_index(dtype, width) -> None:
    fmt = index_row_format(RELEASE, width, dtype)
    values = _values(3, width, 4, dtype)
    pool = torch.full((5, fmt.width), 0xAB, dtype=torch.uint8)
    rows = torch.tensor([4, 1, 2])
    layout = fp4_keys(fmt)
    assert layout is not None
    codes.store_fp4_keys(values, pool, rows, layout)
    assert torch.equal(pool[rows], encode_index(fmt, values, RELEASE))
    assert (pool[torch.tensor([0, 3])] == 0xAB).all()
