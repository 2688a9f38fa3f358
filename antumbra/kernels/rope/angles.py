"""cos / sin of a step's positions in one launch (see `cos_sin_reference`).

A program owns BLOCK_N positions and every frequency. The torch chain it replaces (the cast, the
angles' product, cos, sin and two scalings) is six launches over a few hundred values, and a decode
step makes four such tables.

Values are the chain's bit for bit on a GPU: the position's float32 cast is exact below 2^24, the
angle is one float32 product, and compiled the CUDA math library's cosf / sinf are the functions
torch's CUDA kernels call (`tl.cos` / `tl.sin` are approximations, far off at the large angles of
long contexts). The CPU interpreter evaluates them with NumPy, within an ulp of torch's CPU values.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from antumbra.kernels.common import host_math
from antumbra.kernels.common.interpreter import interpreting, prepare

prepare()

_LIBDEVICE = tl.constexpr(not interpreting())  # fixed per process, so in no launch key
BLOCK_N = 16


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Output allocation; tests swap in a NaN fill to catch unwritten elements."""
    return torch.empty(*shape, dtype=dtype, device=device)


# The position count follows the step's size: not specialised, so a variant depends only on the
# table's width.
@triton.jit(do_not_specialize=["num_positions"])
def _cos_sin_kernel(
    pos_ptr,  # [N] integer positions, contiguous
    freq_ptr,  # [HALF] float32 inverse frequencies
    cos_ptr,  # [N, HALF] float32 out
    sin_ptr,  # [N, HALF] float32 out
    num_positions,
    factor,  # float32
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, HALF_PAD)
    row_ok = rows < num_positions
    col_ok = cols < HALF
    pos = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.float32)
    angles = pos[:, None] * tl.load(freq_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if _LIBDEVICE:
        cos, sin = libdevice.cos(angles), libdevice.sin(angles)
    else:
        cos, sin = tl.cos(angles), tl.sin(angles)
    offs = rows.to(tl.int64)[:, None] * HALF + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(cos_ptr + offs, cos * factor, mask=mask)
    tl.store(sin_ptr + offs, sin * factor, mask=mask)


def cos_sin_constexprs(half: int) -> dict[str, Any]:
    """Constexprs and launch options for a table of `half` frequencies: the model's width only."""
    return dict(HALF=half, HALF_PAD=host_math.next_power_of_2(half), BLOCK=BLOCK_N, num_warps=1)


def cos_sin(positions: Tensor, inv_freq: Tensor, factor: float) -> tuple[Tensor, Tensor]:
    """As `cos_sin_reference`: positions [...] integer, inv_freq [R/2] float32 on its device ->
    cos, sin [..., R/2] float32, contiguous."""
    assert not positions.is_floating_point(), f"positions must be integers, got {positions.dtype}"
    assert inv_freq.dim() == 1 and inv_freq.dtype == torch.float32, "inv_freq must be [R/2] float32"
    assert positions.device == inv_freq.device, "positions and inv_freq must be on one device"
    half = inv_freq.shape[0]
    flat = positions.reshape(-1).contiguous()
    cos = _empty(flat.shape[0], half, dtype=torch.float32, device=positions.device)
    sin = _empty(flat.shape[0], half, dtype=torch.float32, device=positions.device)
    if flat.shape[0] and half:
        _cos_sin_kernel[(host_math.cdiv(flat.shape[0], BLOCK_N),)](
            flat, inv_freq.contiguous(), cos, sin, flat.shape[0], float(factor), **cos_sin_constexprs(half)
        )
    shape = (*positions.shape, half)
    return cos.view(shape), sin.view(shape)
