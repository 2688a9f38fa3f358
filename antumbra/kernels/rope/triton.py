"""Rotary embedding in one launch (see `reference.py` for the math).

Program (t, mb) copies BLOCK_M rows of token t: the pass-through channels unchanged and the
rope slice rotated, reading each pair's even and odd element and the token's cos / sin once.
In the unfused chain (slice, upcast, four products, two sums, stack, cast, concatenation)
every step is its own launch over the tensor; a decode step rotates four tensors per layer.
Optionally the row's RMS norm (weighted or not) is applied first, in the same pass: the
norm needs the whole row, which the program holds anyway. The fused path does not round
the normed values to x's dtype before rotating (the unfused chain does): bf16 results may
differ in the last bit. With `out_rows` a token's rows go to rows of a pool instead of a new
tensor (a decode step's keys straight into their SWA rows: no copy launch after the rotation).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from antumbra.kernels.common import host_math
from antumbra.kernels.common.interpreter import prepare

prepare()


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Output allocation; tests swap in a NaN fill to catch unwritten elements."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _rope_kernel(
    x_ptr,  # *T [T, M, D] contiguous
    cos_ptr,  # *f32 [T, HALF] contiguous
    sin_ptr,  # *f32 [T, HALF] contiguous
    out_ptr,  # *T [T, M, D] contiguous; with SCATTER [R, M * D], token t's rows at row out_rows[t]
    w_ptr,  # *f32 [D] norm weight (read when HAS_WEIGHT)
    out_rows_ptr,  # *i64 [T] pool row of each token (read when SCATTER)
    M,
    eps,
    D: tl.constexpr,
    HALF: tl.constexpr,
    SIGN: tl.constexpr,  # +1 rotates, -1 de-rotates
    NORM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_NOPE: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    SCATTER: tl.constexpr,
):
    t = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    base = (t * M + rows).to(tl.int64) * D  # [BLOCK_M]
    if SCATTER:
        out_base = (tl.load(out_rows_ptr + t).to(tl.int64) * M + rows) * D
    else:
        out_base = base
    nope_w: tl.constexpr = D - 2 * HALF
    cols = tl.arange(0, BLOCK_NOPE)
    nope_mask = row_ok[:, None] & (cols[None, :] < nope_w)
    nope = tl.load(x_ptr + base[:, None] + cols[None, :], mask=nope_mask, other=0.0).to(tl.float32)
    pair = tl.arange(0, BLOCK_HALF)
    pair_ok = pair < HALF
    c = tl.load(cos_ptr + t * HALF + pair, mask=pair_ok, other=1.0)
    s = tl.load(sin_ptr + t * HALF + pair, mask=pair_ok, other=0.0) * SIGN
    even_off = base[:, None] + nope_w + 2 * pair[None, :]
    mask = row_ok[:, None] & pair_ok[None, :]
    even = tl.load(x_ptr + even_off, mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(x_ptr + even_off + 1, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        sumsq = tl.sum(nope * nope, axis=1) + tl.sum(even * even, axis=1) + tl.sum(odd * odd, axis=1)
        r = 1.0 / tl.sqrt(sumsq / D + eps)
        nope = nope * r[:, None]
        even = even * r[:, None]
        odd = odd * r[:, None]
        if HAS_WEIGHT:
            nope = nope * tl.load(w_ptr + cols, mask=cols < nope_w, other=0.0)[None, :]
            even = even * tl.load(w_ptr + nope_w + 2 * pair, mask=pair_ok, other=0.0)[None, :]
            odd = odd * tl.load(w_ptr + nope_w + 2 * pair + 1, mask=pair_ok, other=0.0)[None, :]
    if nope_w > 0:
        nope_out = nope.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + out_base[:, None] + cols[None, :], nope_out, mask=nope_mask)
    out_even = even * c[None, :] - odd * s[None, :]
    out_odd = odd * c[None, :] + even * s[None, :]
    out_off = out_base[:, None] + nope_w + 2 * pair[None, :]
    tl.store(out_ptr + out_off, out_even.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + out_off + 1, out_odd.to(out_ptr.dtype.element_ty), mask=mask)


def rope(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    inverse: bool = False,
    norm_eps: float | None = None,
    norm_weight: Tensor | None = None,
    out: Tensor | None = None,
    out_rows: Tensor | None = None,
) -> Tensor:
    """As `rope_reference`: x [T, ..., D] float (any middle dims; made contiguous);
    cos, sin [T, R/2] float32; norm_weight [D] float32 or None -> x.dtype, x's shape.
    out, out_rows: a contiguous pool [R, ..., D] of x.dtype and [T] int64 rows of it: token t's
    result is written to out[out_rows[t]] (rows distinct) and `out` is returned."""
    shape = x.shape
    t, d = shape[0], shape[-1]
    half = cos.shape[-1]
    assert cos.shape == sin.shape == (t, half) and cos.dtype == sin.dtype == torch.float32
    assert 0 < 2 * half <= d, f"rope width {2 * half} exceeds the head width {d}"
    x3 = x.contiguous().view(t, -1, d)
    m = x3.shape[1]
    scatter = out_rows is not None
    if out_rows is not None:
        assert out is not None and out.is_contiguous() and out.dtype == x.dtype
        assert out.shape[1:] == shape[1:] and out_rows.shape == (t,) and out_rows.dtype == torch.int64
    else:
        out = _empty(*x3.shape, dtype=x.dtype, device=x.device)
    if x3.numel() == 0:
        return out if scatter else out.view(shape)
    if norm_weight is not None:
        assert norm_eps is not None and norm_weight.shape == (d,) and norm_weight.dtype == torch.float32
    weight = norm_weight.contiguous() if norm_weight is not None else cos
    consts = rope_constexprs(m, d, half, inverse, norm_eps is not None, norm_weight is not None, scatter)
    _rope_kernel[(t, host_math.cdiv(m, consts["BLOCK_M"]))](
        x3, cos.contiguous(), sin.contiguous(), out, weight, out_rows if scatter else cos, m,
        float(norm_eps or 0.0), **consts, num_warps=4,
    )
    return out if scatter else out.view(shape)


def rope_constexprs(
    rows_per_token: int, d: int, half: int, inverse: bool, norm: bool, weighted: bool, scatter: bool = False
) -> dict[str, Any]:
    """The kernel's constexprs for `rows_per_token` rows (heads) of d channels a token, R = 2 * half
    of them rotated, written to pool rows when `scatter`: they follow the model's widths and the
    call site, never the token count."""
    return dict(D=d, HALF=half, SIGN=-1.0 if inverse else 1.0, NORM=norm, HAS_WEIGHT=weighted,
                SCATTER=scatter,
                BLOCK_M=min(16, host_math.next_power_of_2(rows_per_token)),
                BLOCK_NOPE=host_math.next_power_of_2(max(d - 2 * half, 1)),
                BLOCK_HALF=host_math.next_power_of_2(half))
