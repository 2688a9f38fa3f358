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
        rope_triton,
        "_empty",
        lambda *shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device),
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


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize(("shape", "rope_dim"), [((3, 5, 40), 8), ((6, 24), 24)])
def test_fused_rms_norm_then_rope(shape, rope_dim, weighted):
    from antumbra.replicas.model.norms import RMSNorm, unweighted_rms_norm

    g = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=g) * 3
    angles = torch.rand(shape[0], rope_dim // 2, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    eps = 1e-6
    weight = torch.rand(shape[-1], generator=g) + 0.5 if weighted else None
    got = rope(x, cos, sin, norm_eps=eps, norm_weight=weight)
    want = rope_reference(x.view(shape[0], -1, shape[-1]), cos, sin, norm_eps=eps, norm_weight=weight).view(
        shape
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The reference is the model's norm followed by its rope.
    if weighted:
        norm = RMSNorm(shape[-1], eps)
        norm.weight.data.copy_(weight)
        normed = norm(x)
    else:
        normed = unweighted_rms_norm(x, eps)
    torch.testing.assert_close(want, apply_rope(normed, cos, sin), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_written_into_a_pool_are_the_tensor_results(dtype):
    """`out`, `out_rows`: each token's normed, rotated key lands in its pool row, bit for bit what the
    call without them returns; every other row of the pool is left as it was."""
    g = torch.Generator().manual_seed(9)
    tokens, d, rope_dim = 5, 40, 8
    x = (torch.randn(tokens, d, generator=g) * 3).to(dtype)
    angles = torch.rand(tokens, rope_dim // 2, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    weight = torch.rand(d, generator=g) + 0.5
    want = rope(x, cos, sin, norm_eps=1e-6, norm_weight=weight)
    pool = torch.full((12, d), -7.0, dtype=dtype)
    rows = torch.tensor([9, 0, 4, 11, 2])
    assert rope(x, cos, sin, norm_eps=1e-6, norm_weight=weight, out=pool, out_rows=rows) is pool
    assert torch.equal(pool[rows], want)
    kept = torch.ones(12, dtype=torch.bool)
    kept[rows] = False
    assert (pool[kept] == -7.0).all()
