"""The shared expert's clamped SwiGLU, and in release numerics its FP8 round trip, in one launch
(see `reference.py`).

Program (t, j) reads channels [j * BLOCKS * 128, (j + 1) * BLOCKS * 128) of row t of gate and
up as a [BLOCKS, 128] tile, so each tile row is one round-trip block and its amax one reduction.
The torch chain it replaces is four elementwise launches (two clamps, silu, the product) plus
the round trip's; the fixed-shape decode graph runs it once a layer, and at decode sizes each
launch costs more than its work.

Bit for bit the reference's values: the clamps are exact; silu is g / (1 + exp(-g)) with the
quotient correctly rounded and, compiled, the CUDA math library's exp (the one torch's CUDA silu
calls; `tl.exp` is an approximation); in bfloat16 silu and the product are each rounded to
nearest even, as torch rounds them; the round trip's arithmetic is exact (`kv_codes`). The CPU
interpreter evaluates exp with NumPy, which can differ from torch's CPU exp by an ulp in float32
(bfloat16 rounding absorbs it: every bfloat16 input gives torch's value).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from antumbra.kernels.common import host_math
from antumbra.kernels.common.codecs import (
    ACT_BLOCK,
    ACT_BLOCKS_PER_PROGRAM,
    E4M3_MAX,
    FP8_FLOOR,
    e4m3_round,
    narrowed,
    pow2,
    rounded_keep_nan,
    scale_exponent,
    widened,
)
from antumbra.kernels.common.interpreter import interpreting, prepare

prepare()

# The interpreter has no libdevice; a module constant rather than a constexpr argument, since it
# is fixed per process and so belongs in no launch key.
_LIBDEVICE_EXP = tl.constexpr(not interpreting())

DTYPES = (torch.bfloat16, torch.float32)  # what the kernel takes


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Output allocation; tests swap in a NaN fill to catch unwritten elements."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _silu(g):
    """float32 -> g / (1 + exp(-g)) in float32, as torch's silu computes it."""
    if _LIBDEVICE_EXP:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    return tl.math.div_rn(g, 1.0 + e)


@triton.jit
def _fp8_blocks(y, FLOOR: tl.constexpr, INV_QMAX: tl.constexpr, QMAX: tl.constexpr):
    """[B, 128] float32, one scale block a row -> its FP8 round trip (`kv_codes.fp8_roundtrip`)."""
    k = scale_exponent(tl.max(tl.abs(y), 1), FLOOR, INV_QMAX)
    scaled = tl.minimum(tl.maximum(y * pow2(-k)[:, None], -QMAX), QMAX)
    return e4m3_round(scaled) * pow2(k)[:, None]


@triton.jit
def _swiglu_kernel(
    gate_ptr,  # [T, I] rows `stride_in` apart, unit stride along I, bfloat16 / float32
    up_ptr,  # [T, I] rows `stride_in` apart, unit stride along I, gate's dtype
    out_ptr,  # [T, I] contiguous, gate's dtype
    limit,  # float32, a value of the dtype (the clamps then need no rounding)
    stride_in,  # elements between rows of gate and of up (I, or 2I for the halves of one [T, 2I])
    INTER: tl.constexpr,  # I, the channels of a row
    BLOCKS: tl.constexpr,  # scale blocks a program handles
    BLOCK: tl.constexpr,  # channels a scale block: 128
    FP8: tl.constexpr,  # take the FP8 round trip
    FLOOR: tl.constexpr,
    INV_QMAX: tl.constexpr,
    QMAX: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    cols = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = cols < INTER  # masked channels load as 0 and give 0: the reference's zero padding
    dt = out_ptr.dtype.element_ty
    g = widened(tl.load(gate_ptr + row * stride_in + cols, mask=mask, other=0.0))
    u = widened(tl.load(up_ptr + row * stride_in + cols, mask=mask, other=0.0))
    g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)  # torch's clamp keeps NaN
    u = tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                   propagate_nan=tl.PropagateNan.ALL)
    # torch rounds silu to the dtype before the product; written out, as the interpreter's
    # float32 -> bfloat16 cast truncates.
    y = rounded_keep_nan(_silu(g), dt) * u
    if FP8:
        y = _fp8_blocks(rounded_keep_nan(y, dt), FLOOR, INV_QMAX, QMAX)  # exact in the dtype
    tl.store(out_ptr + row * INTER + cols, narrowed(y, dt), mask=mask)


def swiglu_constexprs(inter: int, fp8_round_trip: bool) -> dict[str, Any]:
    """Constexprs and launch options for rows of `inter` channels: the model's width and numerics
    only, never the token count."""
    blocks = min(ACT_BLOCKS_PER_PROGRAM, host_math.next_power_of_2(host_math.cdiv(inter, ACT_BLOCK)))
    return dict(INTER=inter, BLOCKS=blocks, BLOCK=ACT_BLOCK, FP8=bool(fp8_round_trip), FLOOR=FP8_FLOOR,
                INV_QMAX=1.0 / E4M3_MAX, QMAX=E4M3_MAX, num_warps=max(1, blocks // 2))


@functools.lru_cache(maxsize=16)
def _limit_of(limit: float, dtype: torch.dtype) -> float:
    """`limit` as torch's clamp of a `dtype` tensor compares with it: rounded to the dtype."""
    return float(torch.tensor(limit, dtype=dtype))


def swiglu(gate: Tensor, up: Tensor, limit: float, fp8_round_trip: bool = False) -> Tensor:
    """As `swiglu_reference`: gate, up [T, I], both bfloat16 or both float32, unit stride along I and
    one row stride (contiguous, or the two halves of one [T, 2I]) -> [T, I] that dtype, contiguous.
    Any I: with the round trip a last partial block is scaled as if zero-padded."""
    shapes, dtypes = f"{tuple(gate.shape)} and {tuple(up.shape)}", f"{gate.dtype} and {up.dtype}"
    assert gate.dim() == 2 and gate.shape == up.shape, f"gate and up must be one [T, I] shape, got {shapes}"
    same = gate.dtype == up.dtype
    assert same and gate.dtype in DTYPES, f"gate and up must both be bfloat16 or float32, got {dtypes}"
    strides = f"{gate.stride()} and {up.stride()}"
    assert gate.stride(1) == up.stride(1) == 1 and gate.stride(0) == up.stride(0), (
        f"gate and up must have unit stride along I and one row stride, got {strides}")
    assert gate.device == up.device, "gate and up must be on one device"
    rows, inter = gate.shape
    out = _empty(rows, inter, dtype=gate.dtype, device=gate.device)
    if rows and inter:
        consts = swiglu_constexprs(inter, fp8_round_trip)
        grid = (rows, host_math.cdiv(host_math.cdiv(inter, ACT_BLOCK), consts["BLOCKS"]))
        _swiglu_kernel[grid](gate, up, out, _limit_of(float(limit), gate.dtype), gate.stride(0), **consts)
    return out
