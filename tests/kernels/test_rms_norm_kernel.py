"""The RMS norm kernel against its reference, and the reference against the model's `RMSNorm`.

Runs in the Triton interpreter on CPU: widths that are not powers of two, several rows, bf16
and fp32, outputs poisoned first.
"""

from __future__ import annotations

import pytest
import torch

from antumbra.kernels.rms_norm import rms_norm, rms_norm_reference
from antumbra.kernels.rms_norm import triton as rms_triton
from antumbra.replicas.model.norms import RMSNorm


@pytest.fixture(autouse=True)
def poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        rms_triton,
        "_empty",
        lambda *shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device),
    )


@pytest.mark.parametrize(("shape", "dtype"), [((5, 40), torch.float32), ((3, 2, 96), torch.float32),
                                              ((7, 200), torch.bfloat16), ((1, 4096), torch.float32)])
def test_rms_norm_matches_reference_and_model(shape, dtype):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    weight = torch.rand(shape[-1], generator=g) + 0.5
    got = rms_norm(x, weight, 1e-6)
    want = rms_norm_reference(x, weight, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype and not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    norm = RMSNorm(shape[-1], 1e-6)
    norm.weight.data.copy_(weight)
    torch.testing.assert_close(want, norm(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [128, 1024])
def test_rms_norm_fp8_is_the_norm_then_its_fp8_round_trip(dtype, width):
    """Both outputs bit for bit: the norm as `rms_norm`, the second as `quant.fp8_roundtrip` of it."""
    from antumbra.replicas.model.quant import FP8_BLOCK, fp8_roundtrip

    g = torch.Generator().manual_seed(width)
    scales = torch.exp2(torch.randint(-8, 8, (3, 2, 1), generator=g).float())
    x = (torch.randn(3, 2, width, generator=g) * scales).to(dtype)
    x[0, 0] = 0.0  # a zero row: every block under the scale floor
    weight = torch.rand(width, generator=g) + 0.5
    assert rms_triton.fuses_fp8(width) and not rms_triton.fuses_fp8(96) and not rms_triton.fuses_fp8(384)
    normed, rounded = rms_triton.rms_norm_fp8(x, weight, 1e-6)
    assert normed.shape == rounded.shape == x.shape and normed.dtype == rounded.dtype == dtype
    assert torch.equal(normed, rms_norm(x, weight, 1e-6))
    assert torch.equal(rounded, fp8_roundtrip(normed, FP8_BLOCK))
    assert not torch.equal(rounded, normed)  # the round trip did change values
