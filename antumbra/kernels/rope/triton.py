"""Rotary embedding in one launch (see `reference.py` for the math).

Program (t, mb) copies BLOCK_M rows of token t: the pass-through channels unchanged and the
rope slice rotated, reading each pair's even and odd element and the token's cos / sin once.
In the unfused chain (slice, upcast, four products, two sums, stack, cast, concatenation)
every step is its own launch over the tensor; a decode step rotates four tensors per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from antumbra.kernels.interpreter import prepare

prepare()


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Output allocation; tests swap in a NaN fill to catch unwritten elements."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _rope_kernel(
    x_ptr,  # *T [T, M, D] contiguous
    cos_ptr,  # *f32 [T, HALF] contiguous
    sin_ptr,  # *f32 [T, HALF] contiguous
    out_ptr,  # *T [T, M, D] contiguous
    M,
    D: tl.constexpr,
    HALF: tl.constexpr,
    SIGN: tl.constexpr,  # +1 rotates, -1 de-rotates
    BLOCK_M: tl.constexpr,
    BLOCK_NOPE: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    base = (t * M + rows).to(tl.int64) * D  # [BLOCK_M]
    nope_w: tl.constexpr = D - 2 * HALF
    if nope_w > 0:
        cols = tl.arange(0, BLOCK_NOPE)
        mask = row_ok[:, None] & (cols[None, :] < nope_w)
        v = tl.load(x_ptr + base[:, None] + cols[None, :], mask=mask)
        tl.store(out_ptr + base[:, None] + cols[None, :], v, mask=mask)
    pair = tl.arange(0, BLOCK_HALF)
    pair_ok = pair < HALF
    c = tl.load(cos_ptr + t * HALF + pair, mask=pair_ok, other=1.0)
    s = tl.load(sin_ptr + t * HALF + pair, mask=pair_ok, other=0.0) * SIGN
    even_off = base[:, None] + nope_w + 2 * pair[None, :]
    mask = row_ok[:, None] & pair_ok[None, :]
    even = tl.load(x_ptr + even_off, mask=mask).to(tl.float32)
    odd = tl.load(x_ptr + even_off + 1, mask=mask).to(tl.float32)
    out_even = even * c[None, :] - odd * s[None, :]
    out_odd = odd * c[None, :] + even * s[None, :]
    tl.store(out_ptr + even_off, out_even.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + even_off + 1, out_odd.to(out_ptr.dtype.element_ty), mask=mask)


def rope(x: Tensor, cos: Tensor, sin: Tensor, *, inverse: bool = False) -> Tensor:
    """As `rope_reference`: x [T, ..., D] float (any middle dims; made contiguous);
    cos, sin [T, R/2] float32 -> x.dtype, x's shape."""
    shape = x.shape
    t, d = shape[0], shape[-1]
    half = cos.shape[-1]
    assert cos.shape == sin.shape == (t, half) and cos.dtype == sin.dtype == torch.float32
    assert 0 < 2 * half <= d, f"rope width {2 * half} exceeds the head width {d}"
    x3 = x.contiguous().view(t, -1, d)
    m = x3.shape[1]
    out = _empty(*x3.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out.view(shape)
    block_m = min(16, triton.next_power_of_2(m))
    _rope_kernel[(t, triton.cdiv(m, block_m))](
        x3, cos.contiguous(), sin.contiguous(), out, m,
        D=d, HALF=half, SIGN=-1.0 if inverse else 1.0, BLOCK_M=block_m,
        BLOCK_NOPE=triton.next_power_of_2(max(d - 2 * half, 1)), BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4,
    )
    return out.view(shape)
