"""Numerics of the DeepSeek-V4 release weight formats, in plain torch.

Two formats appear in the release checkpoints:

* **FP8 block** (dense linears): `float8_e4m3fn` weights `[N, K]` with one UE8M0 scale per 128×128
  block, `[ceil(N/128), ceil(K/128)]`. Value = `w · 2^(e − 127)`.
* **MXFP4** (routed experts): two e2m1 codes per byte, `[out, in/2]` (int8), with one UE8M0 scale per
  32 inputs of a row, `[out, in/32]`. The low nibble holds element `2j`, the high nibble `2j + 1`.

UE8M0 scales are `torch.float8_e8m0fnu` (torch ≥ 2.7; safetensors stores them as `F8_E8M0`). Every
function that reads a scale also accepts the raw exponent bytes as `uint8`, and plain float scales
(V3-style `scale_fmt="float"`) are used as multipliers.

All dequantisation happens in float32, where a power-of-two multiple of an e4m3 or e2m1 value is
exact (outside the subnormal range), so the result does not depend on the order of operations and
is also exact in bfloat16.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

FP8_BLOCK = 128
MXFP4_BLOCK = 32
E4M3_MAX = 448.0
E2M1_MAX = 6.0
_E8M0_BIAS = 127
_ROUND_MAGIC = float(2**23)

# Magnitudes of the 3-bit e2m1 codes; bit 3 of a nibble is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e8m0_to_float(scale: Tensor) -> Tensor:
    """Scale tensor (any shape) → float32 multipliers of the same shape.

    `float8_e8m0fnu` and `uint8` exponent bytes give `2^(e − 127)` (byte 255 is NaN); floating scales
    are returned as float32 unchanged.
    """
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    return scale.to(torch.float32)


def _ceil_log2(x: Tensor) -> Tensor:
    """Exact `ceil(log2(x))` for positive float32 `x` (int32), via the binary exponent."""
    mantissa, exponent = torch.frexp(x)  # x = m · 2^e, m ∈ [0.5, 1)
    return torch.where(mantissa == 0.5, exponent - 1, exponent)


def _pow2_exponent(amax: Tensor, qmax: float) -> Tensor:
    """Smallest `k ∈ [−127, 127]` with `amax ≤ qmax · 2^k` (0 for all-zero blocks), int32."""
    amax = amax.to(torch.float32)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    k = _ceil_log2(safe / qmax)
    # The division above rounds; one correction step makes the bound hold exactly.
    k = torch.where(safe > torch.ldexp(torch.full_like(safe, qmax), k), k + 1, k)
    k = torch.where(amax > 0, k, torch.zeros_like(k))
    return k.clamp(-_E8M0_BIAS, _E8M0_BIAS)


def _exponent_to_e8m0(k: Tensor) -> Tensor:
    return (k + _E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def _blocked(x: Tensor, block: int) -> tuple[Tensor, int, int]:
    """Pad the last two dims of `x [..., N, K]` up to multiples of `block` (zeros) and view it as
    `[..., N/b, b, K/b, b]`. Returns the view and the original `N, K`."""
    n, k = x.shape[-2:]
    pad_n, pad_k = -n % block, -k % block
    if pad_n or pad_k:
        x = torch.nn.functional.pad(x, (0, pad_k, 0, pad_n))
    lead = x.shape[:-2]
    return x.reshape(*lead, (n + pad_n) // block, block, (k + pad_k) // block, block), n, k


def _unblocked(x: Tensor, n: int, k: int) -> Tensor:
    lead = x.shape[:-4]
    rows, cols = x.shape[-4] * x.shape[-3], x.shape[-2] * x.shape[-1]
    return x.reshape(*lead, rows, cols)[..., :n, :k]


def fp8_scale_shape(shape: tuple[int, ...], block: int = FP8_BLOCK) -> tuple[int, ...]:
    """Scale-grid shape for an FP8 weight of `shape [..., N, K]`: `[..., ceil(N/b), ceil(K/b)]`."""
    *lead, n, k = shape
    return (*lead, -(-n // block), -(-k // block))


def dequant_fp8_block(weight_e4m3: Tensor, scale: Tensor, block: int = FP8_BLOCK) -> Tensor:
    """FP8 block dequantisation.

    weight_e4m3: `[..., N, K]` float8_e4m3fn.
    scale: `[..., ceil(N/block), ceil(K/block)]` float8_e8m0fnu, uint8 exponent bytes, or float.
    Returns float32 `[..., N, K]` = `w · scale` of the weight's 128×128 block (edge blocks may be
    partial when N or K is not a multiple of `block`).
    """
    expected = fp8_scale_shape(tuple(weight_e4m3.shape), block)
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"FP8 scale shape {tuple(scale.shape)} != {expected} for weight {tuple(weight_e4m3.shape)}"
        )
    blocks, n, k = _blocked(weight_e4m3.to(torch.float32), block)
    s = e8m0_to_float(scale)
    return _unblocked(blocks * s.unsqueeze(-1).unsqueeze(-3), n, k)


def quant_fp8_block(w: Tensor, block: int = FP8_BLOCK) -> tuple[Tensor, Tensor]:
    """FP8 block quantisation with power-of-two (UE8M0) scales.

    w: float `[..., N, K]`.
    Returns `(float8_e4m3fn [..., N, K], float8_e8m0fnu [..., ceil(N/b), ceil(K/b)])`. Each block's
    scale is the smallest power of two that brings its max |w| within e4m3's range (448); values are
    then rounded to nearest-even e4m3. Inverse of `dequant_fp8_block` up to e4m3 rounding (relative
    error ≤ 2^-4 of the block's scale·448 range for normal values).
    """
    blocks, n, k = _blocked(w.to(torch.float32), block)
    exp = _pow2_exponent(blocks.abs().amax(dim=(-3, -1)), E4M3_MAX)
    scaled = torch.ldexp(blocks, -exp.unsqueeze(-1).unsqueeze(-3))
    q = _unblocked(scaled.clamp(-E4M3_MAX, E4M3_MAX), n, k).to(torch.float8_e4m3fn)
    return q.contiguous(), _exponent_to_e8m0(exp)


def _e2m1_decode(codes: Tensor) -> Tensor:
    """4-bit e2m1 codes (uint8, values 0..15) → float32 values.

    Computed from the bit fields (sign | 2-bit exponent | 1-bit mantissa, bias 1, exponent 0
    subnormal) rather than a table lookup: elementwise arithmetic is exact here and avoids a gather.
    """
    exp = ((codes >> 1) & 3).to(torch.int32)
    man = (codes & 1).to(torch.float32)
    mag = torch.where(exp == 0, man * 0.5, torch.ldexp(1.0 + man * 0.5, exp - 1))
    return torch.where((codes & 8) != 0, -mag, mag)


def unpack_e2m1(packed: Tensor) -> Tensor:
    """Packed e2m1 codes `[..., M]` (int8 / uint8, two per byte) → float32 `[..., 2M]` code values.

    Element `2j` comes from the low nibble of byte `j`, element `2j + 1` from the high nibble.
    """
    u8 = packed.contiguous().view(torch.uint8)
    pairs = torch.stack([_e2m1_decode(u8 & 0xF), _e2m1_decode(u8 >> 4)], dim=-1)
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def unpack_mxfp4(packed: Tensor, scale: Tensor, block: int = MXFP4_BLOCK) -> Tensor:
    """MXFP4 dequantisation.

    packed: `[..., out, in/2]` int8 or uint8 (also accepts `float4_e2m1fn_x2`), two e2m1 codes a byte,
        low nibble first.
    scale: `[..., out, in/block]` float8_e8m0fnu, uint8 exponent bytes, or float.
    Returns float32 `[..., out, in]`.
    """
    values = unpack_e2m1(packed)
    *lead, out, cols = values.shape
    if cols % block or tuple(scale.shape) != (*lead, out, cols // block):
        raise ValueError(
            f"MXFP4 scale shape {tuple(scale.shape)} != {(*lead, out, cols // block)} for packed weight "
            f"{tuple(packed.shape)}"
        )
    grouped = values.reshape(*lead, out, cols // block, block)
    return (grouped * e8m0_to_float(scale).unsqueeze(-1)).reshape(*lead, out, cols)


def _round_to_e2m1_codes(x: Tensor) -> Tensor:
    """float32 values → 4-bit e2m1 codes (uint8), round to nearest, ties to even, saturating at ±6.

    Rounds in units of the value's e2m1 quantum (0.5 below 2, then 1 up to 4, then 2); ties go to an
    even multiple of the quantum, which is the code with mantissa bit 0.
    """
    mag = x.abs().clamp(max=E2M1_MAX)
    _, e = torch.frexp(mag)  # mag = m · 2^e, m ∈ [0.5, 1)
    quantum_exp = (e - 1).clamp(0, 2) - 1
    steps = torch.ldexp(mag, -quantum_exp)  # in [0, 12]
    # Adding and removing 2^23 rounds a float32 in [0, 2^22) to the nearest integer, ties to even;
    # unlike torch.round it is a plain add, which stays fast on small tensors with many threads.
    steps = (steps + _ROUND_MAGIC) - _ROUND_MAGIC
    r = torch.ldexp(steps, quantum_exp).clamp(max=E2M1_MAX)
    m, e = torch.frexp(r)
    code = torch.where(r < 1, r * 2, 2 * e + (m == 0.75)).to(torch.uint8)
    # Values that round to zero get code 0 whatever their sign, so the packed bytes are canonical.
    sign = ((x < 0) & (code > 0)).to(torch.uint8) << 3
    return code | sign


def quant_mxfp4(w: Tensor, block: int = MXFP4_BLOCK) -> tuple[Tensor, Tensor]:
    """MXFP4 quantisation with a power-of-two scale per `block` inputs.

    w: float `[..., out, in]`, `in` a multiple of `block` (32).
    Returns `(int8 [..., out, in/2], float8_e8m0fnu [..., out, in/block])`. Each group's scale is the
    smallest power of two that brings its max |w| within e2m1's range (6); values are rounded to the
    nearest e2m1 code (ties to even) and packed low nibble first.
    """
    *lead, out, cols = w.shape
    if cols % block:
        raise ValueError(f"MXFP4 input dim {cols} is not a multiple of {block}")
    grouped = w.to(torch.float32).reshape(*lead, out, cols // block, block)
    exp = _pow2_exponent(grouped.abs().amax(dim=-1), E2M1_MAX)
    codes = _round_to_e2m1_codes(torch.ldexp(grouped, -exp.unsqueeze(-1))).reshape(*lead, out, cols)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.view(torch.int8).contiguous(), _exponent_to_e8m0(exp)


# ------------------------------------------------------------------------------ activation round trips
#
# The release numerics quantise some activations on the fly and immediately dequantise them (a QAT
# simulation): per block of `block` consecutive channels of the last dim (the last block may be
# partial), scale = 2^ceil(log2(max(amax, floor) · (1/qmax))), with the product taken in float32 as
# the release kernels do; values are divided by the scale, clamped to ±qmax, rounded to nearest-even
# in the narrow format and multiplied back. The floors keep the scale of an all-zero or denormal block
# finite and match the release kernels.

KV_FP8_BLOCK = 64  # KV non-RoPE channels
_FP8_AMAX_FLOOR = 1e-4
_FP4_AMAX_FLOOR = E2M1_MAX * 2.0**-126


def _act_scale_exponent(amax: Tensor, qmax: float, floor: float) -> Tensor:
    """Per-block scale exponent k (int32): 2^k ≥ max(amax, floor) · fl32(1/qmax), the smallest such."""
    inverse = torch.tensor(1.0 / qmax, dtype=torch.float32, device=amax.device)
    return _ceil_log2(amax.to(torch.float32).clamp(min=floor) * inverse)


def _channel_blocks(x: Tensor, block: int) -> Tensor:
    """float32 `[..., C]` → `[..., ceil(C/block), block]`, the last block zero-padded."""
    pad = -x.shape[-1] % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)  # explicit: leading dims may be 0


def _round_trip(
    x: Tensor, block: int, qmax: float, floor: float, to_grid: Callable[[Tensor], Tensor]
) -> Tensor:
    """`to_grid` rounds float32 values within ±qmax onto the narrow format's values (float32)."""
    if x.shape[-1] == 0:
        return x
    blocks = _channel_blocks(x.to(torch.float32), block)
    exp = _act_scale_exponent(blocks.abs().amax(dim=-1, keepdim=True), qmax, floor)
    scaled = torch.ldexp(blocks, -exp).clamp(-qmax, qmax)
    out = torch.ldexp(to_grid(scaled), exp)
    return out.flatten(-2)[..., : x.shape[-1]].to(x.dtype)


def _to_e4m3_grid(x: Tensor) -> Tensor:
    return x.to(torch.float8_e4m3fn).to(torch.float32)


def _to_e2m1_grid(x: Tensor) -> Tensor:
    return _e2m1_decode(_round_to_e2m1_codes(x))


def fp8_roundtrip(x: Tensor, block: int = FP8_BLOCK) -> Tensor:
    """FP8 e4m3 quantise-dequantise with UE8M0 scales per `block` channels of the last dim.

    x: float `[..., C]` (any C). Returns the same shape and dtype; computed in float32, where every
    result is an e4m3 value times a power of two and so is also exact in bfloat16.
    """
    return _round_trip(x, block, E4M3_MAX, _FP8_AMAX_FLOOR, _to_e4m3_grid)


def fp4_roundtrip(x: Tensor, block: int = MXFP4_BLOCK) -> Tensor:
    """FP4 e2m1 quantise-dequantise with UE8M0 scales per `block` channels of the last dim.

    x: float `[..., C]` (any C). Returns the same shape and dtype; values land on the e2m1 grid
    {0, ±.5, ±1, ±1.5, ±2, ±3, ±4, ±6} times the block's scale, rounded to nearest, ties to even.
    """
    return _round_trip(x, block, E2M1_MAX, _FP4_AMAX_FLOOR, _to_e2m1_grid)


# ------------------------------------------------------------------------------ stored codes
#
# The same blockwise quantisation as the round trips above, kept as codes and exponent bytes so a
# pool can store them: decoding gives exactly the round trip's values (one shared scale rule).


def _block_exponents(x: Tensor, block: int, qmax: float, floor: float) -> tuple[Tensor, Tensor]:
    """float `[..., C]` -> (scaled float32 `[..., ceil(C/b), b]` within ±qmax,
    exponents int32 `[..., ceil(C/b), 1]`)."""
    blocks = _channel_blocks(x.to(torch.float32), block)
    exp = _act_scale_exponent(blocks.abs().amax(dim=-1, keepdim=True), qmax, floor)
    return torch.ldexp(blocks, -exp).clamp(-qmax, qmax), exp


def _exponent_bytes(exp: Tensor) -> Tensor:
    """int32 `[..., n, 1]` scale exponents -> uint8 `[..., n]` UE8M0 bytes (k + 127)."""
    return (exp.squeeze(-1).clamp(-_E8M0_BIAS, _E8M0_BIAS) + _E8M0_BIAS).to(torch.uint8)


def _apply_exponent_bytes(values: Tensor, exp_bytes: Tensor, block: int, width: int) -> Tensor:
    """float32 code values `[..., C]` times 2^(byte - 127) per `block` channels -> float32 `[..., C]`."""
    blocks = _channel_blocks(values, block)
    exp = exp_bytes.to(torch.int32).unsqueeze(-1) - _E8M0_BIAS
    return torch.ldexp(blocks, exp).flatten(-2)[..., :width]


def fp8_encode(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """x: float `[..., C]` -> (e4m3 codes as uint8 `[..., C]`, UE8M0 bytes `[..., ceil(C/block)]`);
    `fp8_decode` of them equals `fp8_roundtrip(x, block)` exactly."""
    scaled, exp = _block_exponents(x, block, E4M3_MAX, _FP8_AMAX_FLOOR)
    codes = scaled.to(torch.float8_e4m3fn).flatten(-2)[..., : x.shape[-1]]
    return codes.contiguous().view(torch.uint8), _exponent_bytes(exp)


def fp8_decode(codes: Tensor, exp_bytes: Tensor, block: int) -> Tensor:
    """(uint8 e4m3 codes `[..., C]`, UE8M0 bytes `[..., ceil(C/block)]`) -> float32 `[..., C]`."""
    values = codes.contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    return _apply_exponent_bytes(values, exp_bytes, block, codes.shape[-1])


def fp4_encode(x: Tensor, block: int = MXFP4_BLOCK) -> tuple[Tensor, Tensor]:
    """x: float `[..., C]`, C even -> (e2m1 codes packed two a byte, low nibble first, uint8
    `[..., C/2]`, UE8M0 bytes `[..., ceil(C/block)]`); `fp4_decode` gives `fp4_roundtrip(x, block)`."""
    if x.shape[-1] % 2:
        raise ValueError(f"packing e2m1 codes two a byte needs an even width, got {x.shape[-1]}")
    scaled, exp = _block_exponents(x, block, E2M1_MAX, _FP4_AMAX_FLOOR)
    codes = _round_to_e2m1_codes(scaled).flatten(-2)[..., : x.shape[-1]]
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), _exponent_bytes(exp)


def fp4_decode(packed: Tensor, exp_bytes: Tensor, block: int = MXFP4_BLOCK) -> Tensor:
    """(uint8 packed e2m1 `[..., C/2]`, UE8M0 bytes `[..., ceil(C/block)]`) -> float32 `[..., C]`."""
    return _apply_exponent_bytes(unpack_e2m1(packed), exp_bytes, block, 2 * packed.shape[-1])


def hadamard_rotate(x: Tensor) -> Tensor:
    """Normalised Walsh–Hadamard transform over the last dim (Sylvester order, `H[i, j] =
    (-1)^popcount(i & j) / sqrt(n)`), which is symmetric and orthonormal.

    x: float `[..., n]`, n a power of two. Returns the same shape and dtype, computed in float32 (or
    float64 for float64 input) by log2(n) butterfly stages.
    """
    n = x.shape[-1]
    if n <= 0 or n & (n - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two width, got {n}")
    lead = x.shape[:-1]
    y = x.to(torch.promote_types(x.dtype, torch.float32)).reshape(-1, n)
    half = 1
    while half < n:
        pairs = y.view(-1, n // (2 * half), 2, half)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, n)
        half *= 2
    return (y * n**-0.5).reshape(*lead, n).to(x.dtype)
