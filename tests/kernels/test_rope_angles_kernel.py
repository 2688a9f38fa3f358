"""The cos / sin table kernel against its reference, and the reference against the model's table.

Runs in the Triton interpreter on CPU (outputs poisoned first), compiled where a CUDA device is
present. On CPU the interpreter's cos / sin are NumPy's, within an ulp of torch's; on a GPU the
compiled kernel is torch's CUDA chain bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from antumbra.config import RopeConfig
from antumbra.kernels.rope import angles as angles_triton
from antumbra.kernels.rope import cos_sin, cos_sin_reference
from antumbra.replicas.model.rope import RotaryTable, inverse_frequencies

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
YARN = RopeConfig(theta=10000.0, rope_dim=64, yarn_factor=16.0, yarn_original_max_position=65536,
                  attention_factor=1.25)
PLAIN = RopeConfig(theta=10000.0, rope_dim=12)


@pytest.fixture(autouse=True)
def poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        angles_triton, "_empty",
        lambda *shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device),
    )


def _positions(shape: tuple[int, ...], device: str = DEVICE) -> torch.Tensor:
    """Positions from 0 to a million tokens (the long contexts' large angles)."""
    g = torch.Generator().manual_seed(sum(shape))
    pos = torch.randint(0, 1 << 20, shape, generator=g)
    pos.view(-1)[0] = 0
    return pos.to(device)


@pytest.mark.parametrize("rope", [YARN, PLAIN], ids=["yarn", "plain"])
@pytest.mark.parametrize("shape", [(1,), (33,), (4, 3)], ids=lambda s: "x".join(map(str, s)))
def test_kernel_is_the_reference(rope, shape):
    pos = _positions(shape)
    inv_freq = inverse_frequencies(rope).to(DEVICE)
    cos, sin = cos_sin(pos, inv_freq, rope.attention_factor)
    want_cos, want_sin = cos_sin_reference(pos, inv_freq, rope.attention_factor)
    assert cos.shape == sin.shape == (*shape, rope.rope_dim // 2) and cos.dtype == torch.float32
    assert not cos.isnan().any() and not sin.isnan().any()
    if DEVICE == "cuda":
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    else:  # NumPy's float32 cos / sin against torch's: an ulp, relative to the factor
        ulp = 2.0**-23 * rope.attention_factor
        torch.testing.assert_close(cos, want_cos, rtol=0.0, atol=2 * ulp)
        torch.testing.assert_close(sin, want_sin, rtol=0.0, atol=2 * ulp)


def test_reference_is_the_models_table():
    table = RotaryTable(YARN, "cpu")
    pos = _positions((9,), "cpu")
    got, want = table.cos_sin(pos), cos_sin_reference(pos, table.inv_freq, YARN.attention_factor)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bad_inputs_are_refused():
    inv_freq = inverse_frequencies(PLAIN).to(DEVICE)
    with pytest.raises(AssertionError, match="integers"):
        cos_sin(torch.ones(3, device=DEVICE), inv_freq, 1.0)
    with pytest.raises(AssertionError, match="float32"):
        cos_sin(torch.ones(3, dtype=torch.long, device=DEVICE), inv_freq.double(), 1.0)
    cos, sin = cos_sin(torch.ones(0, dtype=torch.long, device=DEVICE), inv_freq, 1.0)
    assert cos.shape == sin.shape == (0, PLAIN.rope_dim // 2)


@pytest.mark.gpu
def test_the_models_table_on_cuda_is_the_torch_chain():
    table = RotaryTable(YARN, "cuda")
    pos = _positions((64,), "cuda")
    got, want = table.cos_sin(pos), cos_sin_reference(pos, table.inv_freq, YARN.attention_factor)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
