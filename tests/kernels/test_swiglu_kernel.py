"""The fused shared-expert SwiGLU kernel against its reference, and the reference against the model.

Runs in the Triton interpreter on CPU (outputs poisoned first), compiled where a CUDA device is
present. bfloat16 is compared bit for bit everywhere: every bfloat16 gate value once, then rows
with the FP8 round trip. In float32 the interpreter's exp is NumPy's, which differs from torch's
CPU exp by an ulp on some inputs, so on CPU float32 is compared within a few ulps, and the fused
round trip bit for bit against the round trip of the kernel's own unrounded output; on a GPU both
dtypes are compared bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from antumbra.kernels.swiglu import swiglu, swiglu_constexprs, swiglu_reference
from antumbra.kernels.swiglu import triton as swiglu_triton

LIMIT = 7.0
SHAPES = [(1, 128), (3, 256), (64, 128), (64, 256), (3, 160)]  # 160: a partial round-trip block
ON_GPU = pytest.mark.gpu
# Where the kernel runs: compiled on a CUDA device, else in the interpreter (tests/conftest.py).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter's NumPy warns where exp overflows and on NaN inputs; the values are torch's.
pytestmark = pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")


@pytest.fixture(autouse=True)
def poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        swiglu_triton,
        "_empty",
        lambda *shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device),
    )


def _inputs(
    shape: tuple[int, int], dtype: torch.dtype, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """gate, up with a third of each beyond +-LIMIT, and rows of block scales 2^-8 .. 2^4 apart."""
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    scales = torch.exp2(torch.randint(-8, 5, (shape[0], 1), generator=g).float())
    gate = torch.randn(shape, generator=g) * 2 * LIMIT * scales.clamp(min=0.5)
    up = torch.randn(shape, generator=g) * 2 * LIMIT * scales
    return gate.to(dtype).to(device), up.to(dtype).to(device)


def _assert_clamps_matter(gate: torch.Tensor, up: torch.Tensor) -> None:
    assert (gate > LIMIT).any() and (up > LIMIT).any() and (up < -LIMIT).any()


@pytest.mark.parametrize("fp8", [False, True], ids=["plain", "fp8"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bf16_is_the_reference_bit_for_bit(shape, fp8):
    gate, up = _inputs(shape, torch.bfloat16, DEVICE)
    _assert_clamps_matter(gate, up)
    got = swiglu(gate, up, LIMIT, fp8)
    assert got.shape == shape and got.dtype == torch.bfloat16 and not got.isnan().any()
    assert torch.equal(got, swiglu_reference(gate, up, LIMIT, fp8))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_float32_is_the_reference_up_to_exp(shape):
    """Within a few ulps of the reference (the interpreter's exp; compiled, exactly); the fused round
    trip is the model's round trip of the kernel's unrounded output, bit for bit."""
    from antumbra.replicas.model.quant import FP8_BLOCK, fp8_roundtrip

    gate, up = _inputs(shape, torch.float32, DEVICE)
    _assert_clamps_matter(gate, up)
    plain, rounded = swiglu(gate, up, LIMIT), swiglu(gate, up, LIMIT, fp8_round_trip=True)
    assert plain.dtype == rounded.dtype == torch.float32 and not rounded.isnan().any()
    want = swiglu_reference(gate, up, LIMIT, False)
    torch.testing.assert_close(plain, want, rtol=5e-7, atol=1e-30)  # silu within about 2 ulps
    assert (plain == want).float().mean() > 0.5
    assert torch.equal(rounded, fp8_roundtrip(plain, FP8_BLOCK))
    assert not torch.equal(rounded, plain)  # the round trip did change values


def test_every_bf16_gate_value_gives_torchs_silu():
    """All 2^16 bfloat16 patterns as gates (NaNs, infinities, subnormals), up = 1 and a limit past
    every finite value: silu alone, rounded as torch rounds it. NaNs stay NaN, in place."""
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = gate.reshape(64, 1024).to(DEVICE)
    up = torch.ones_like(gate)
    got, want = swiglu(gate, up, 3e38), swiglu_reference(gate, up, 3e38, False)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and nan.sum() == 255  # the NaN patterns, and -inf / inf
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))  # the sign of zeros too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_is_the_models_swiglu_then_its_round_trip(dtype):
    from antumbra.replicas.model.moe import swiglu as model_swiglu
    from antumbra.replicas.model.quant import FP8_BLOCK, fp8_roundtrip

    for shape in SHAPES:
        gate, up = _inputs(shape, dtype)
        gate[0, :128] = 0.0  # a block under the scale floor
        model = model_swiglu(gate, up, LIMIT)
        assert torch.equal(swiglu_reference(gate, up, LIMIT, False), model)
        assert torch.equal(swiglu_reference(gate, up, LIMIT, True), fp8_roundtrip(model, FP8_BLOCK))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_halves_of_one_projection_are_read_in_place(dtype):
    """gate and up as the two halves of one [T, 2I] output (the grouped MoE's fused gate / up GEMM):
    strided rows, the same values as the contiguous copies give."""
    gate, up = _inputs((5, 160), dtype, DEVICE)
    both = torch.cat([gate, up], dim=1)
    got = swiglu(both[:, :160], both[:, 160:], LIMIT)
    assert got.is_contiguous() and not got.isnan().any()
    assert torch.equal(got, swiglu(gate, up, LIMIT))
    if dtype == torch.bfloat16:
        assert torch.equal(got, swiglu_reference(gate, up, LIMIT, False))


def test_constexprs_follow_the_width_only():
    v4 = swiglu_constexprs(2048, True)
    assert v4["INTER"] == 2048 and v4["BLOCKS"] == 8 and v4["FP8"] is True
    assert swiglu_constexprs(160, False)["BLOCKS"] == 2 and swiglu_constexprs(32, False)["BLOCKS"] == 1


def test_bad_inputs_are_refused():
    gate, up = _inputs((3, 128), torch.bfloat16)
    with pytest.raises(AssertionError, match="one \\[T, I\\] shape"):
        swiglu(gate, up[:, :64].contiguous(), LIMIT)
    with pytest.raises(AssertionError, match="bfloat16 or float32"):
        swiglu(gate.half(), up.half(), LIMIT)
    with pytest.raises(AssertionError, match="bfloat16 or float32"):
        swiglu(gate, up.float(), LIMIT)
    with pytest.raises(AssertionError, match="unit stride along I"):
        swiglu(gate.t(), up.t(), LIMIT)
    with pytest.raises(AssertionError, match="one row stride"):
        swiglu(gate, torch.cat([up, up], dim=1)[:, :128], LIMIT)
    assert swiglu(gate[:0], up[:0], LIMIT, True).shape == (0, 128)


@ON_GPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fp8", [False, True], ids=["plain", "fp8"])
def test_compiled_is_the_cuda_reference_bit_for_bit(dtype, fp8):
    """Compiled, exp is the CUDA math library's, as torch's CUDA silu: float32 is exact too."""
    for shape in SHAPES + [(64, 2048), (2048, 2048)]:
        gate, up = _inputs(shape, dtype, "cuda")
        assert torch.equal(swiglu(gate, up, LIMIT, fp8), swiglu_reference(gate, up, LIMIT, fp8)), shape


@ON_GPU
def test_compiled_silu_of_every_bf16_and_of_random_float32_bits_is_torchs():
    """Every bfloat16 pattern, and 2^22 random float32 patterns (subnormals, infinities, NaNs)."""
    bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    fp32 = torch.randint(-(2**31), 2**31, (2**22,), generator=g, dtype=torch.int64).to(torch.int32)
    for gate, bits in ((bf16, torch.int16), (fp32.view(torch.float32), torch.int32)):
        gate = gate.reshape(-1, 1024).cuda()
        up = torch.ones_like(gate)
        got, want = swiglu(gate, up, 3e38), swiglu_reference(gate, up, 3e38, False)
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(got[~nan].view(bits), want[~nan].view(bits)), gate.dtype
