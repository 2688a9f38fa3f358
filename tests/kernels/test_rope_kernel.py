"""The rope kernel against its reference, and the reference against the model's `apply_rope`.

Runs in the Triton interpreter on CPU: pass-through widths that are not powers of two, no
pass-through at all, one or several middle rows, both directions, outputs poisoned first.
"""

from __future__ import annotations

import pytest
import torch

from antumbra.kernels.rope import rope, rope_reference
from antumbra.kernels.rope import triton as rope_triton
from antumbra.replicas.model.rope import apply_rope


@pytest.fixture(autouse=True)
def poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        rope_triton, "_empty", lambda *shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device)
    )


@pytest.mark.parametrize(
    ("shape", "rope_dim", "dtype"),
    [
        ((3, 5, 40), 8, torch.float32),  # 32 pass-through channels, 5 heads
        ((7, 40), 8, torch.float32),  # one row per token (the latent KV)
        ((2, 3, 32), 32, torch.float32),  # the whole head rotated
        ((4, 17, 24), 16, torch.bfloat16),  # more rows than one program's block
    ],
)
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_matches_reference_and_model(shape, rope_dim, dtype, inverse):
    g = torch.Generator().manual_seed(sum(shape) + rope_dim)
    x = torch.randn(shape, generator=g).to(dtype)
    angles = torch.rand(shape[0], rope_dim // 2, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    got = rope(x, cos, sin, inverse=inverse)
    want = rope_reference(x.view(shape[0], -1, shape[-1]), cos, sin, inverse=inverse).view(shape)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert not got.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    model = apply_rope(x, cos, -sin if inverse else sin)
    torch.testing.assert_close(want, model, rtol=0, atol=0)


def test_rotation_then_inverse_is_the_identity():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 48, generator=g)
    angles = torch.rand(5, 8, generator=g) * 6
    back = rope(rope(x, angles.cos(), angles.sin()), angles.cos(), angles.sin(), inverse=True)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)
