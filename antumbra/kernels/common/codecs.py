"""Triton number codecs that several kernels share: powers of two from exponent bits, block-scale
exponents, round-to-nearest-even into bfloat16 / e4m3, e2m1 and UE8M0 decoding.

Each is exact integer / bit arithmetic, so a kernel gives the same bits under the CPU interpreter as
on a GPU (the interpreter's float casts truncate or flush subnormals where the GPU rounds).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .interpreter import prepare

ACT_BLOCK = 128  # activation channels per scale
ACT_BLOCKS_PER_PROGRAM = 8
E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_FLOOR = 1e-4
FP4_FLOOR = E2M1_MAX * 2.0**-126

prepare()


@triton.jit
def pow2(k):
    """2^k as float32 for int32 k in [-126, 127], from its exponent bits (exact)."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def scale_exponent(amax, FLOOR: tl.constexpr, INV_QMAX: tl.constexpr):
    """Smallest k with 2^k >= max(amax, FLOOR) * INV_QMAX (float32 product), int32."""
    v = tl.maximum(amax, FLOOR) * INV_QMAX
    bits = v.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 255) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def rounded_to(x, DT: tl.constexpr):
    """float32 -> the nearest value of DT (ties to even), still float32.

    Written out for bfloat16 because the CPU interpreter's float32 -> bfloat16 cast truncates,
    where the GPU and torch round to nearest even (the reference rounds the rotation so)."""
    if DT == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x


@triton.jit
def rounded_keep_nan(v, DT: tl.constexpr):
    """`rounded_to` that keeps NaN: the GPU's NaN is all mantissa ones, which its carry would turn
    into -0."""
    return tl.where(v == v, rounded_to(v, DT), v)


@triton.jit
def widened(x):
    """bfloat16 / float32 -> float32, exactly. bfloat16 through its bits: the interpreter's cast
    garbles subnormals (the GPU's is exact either way)."""
    if x.dtype == tl.bfloat16:
        x = (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x


@triton.jit
def narrowed(y, DT: tl.constexpr):
    """float32 -> DT, rounded to nearest even; bfloat16 through its bits (as `widened`)."""
    if DT == tl.bfloat16:
        bits = rounded_keep_nan(y, DT).to(tl.int32, bitcast=True)
        return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return y.to(DT)


@triton.jit
def round_half_even(steps):
    """Non-negative float32 (below 2^22) -> the nearest integer, ties to even (float32)."""
    low = tl.floor(steps)
    frac = steps - low
    up = (frac > 0.5) | ((frac == 0.5) & ((low.to(tl.int32) & 1) == 1))
    return low + up.to(tl.float32)


@triton.jit
def e4m3_round(scaled):
    """float32 values within +-448 -> their e4m3 values (float32), nearest, ties to even.

    On multiples of the value's quantum 2^(max(e, -6) - 3) (e its binary exponent; below 2^-6 the
    subnormal step 2^-9): exact arithmetic, so it does not depend on how a backend converts to fp8
    (the CPU interpreter flushes e4m3 subnormals; the GPU and torch keep them)."""
    mag = tl.abs(scaled)
    e = ((mag.to(tl.int32, bitcast=True) >> 23) & 255) - 127
    qexp = tl.maximum(e, -6) - 3
    r = round_half_even(mag * pow2(-qexp)) * pow2(qexp)
    # The sign bit copied, of zeros too (a negation may be lowered as 0 - r, which loses it).
    sign = scaled.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_times_2pow14(codes):
    """Integer tensor of 4-bit e2m1 codes -> float32 code values times 2^-14, exactly."""
    c = codes.to(tl.int16)
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    # float16 keeps subnormals on every path, so code 1 (0.5 -> 2^-15) survives.
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e8m0_to_f32(e):
    """UE8M0 exponent bytes (integer tensor or scalar) -> float32 2^(e - 127), exactly.

    Byte 0 is 2^-127, a float32 subnormal (not 0); byte 255 is NaN, as `float8_e8m0fnu` defines them.
    """
    e = e.to(tl.int32)
    bits = tl.where(e == 0, 0x00400000, e << 23)
    bits = tl.where(e == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)
