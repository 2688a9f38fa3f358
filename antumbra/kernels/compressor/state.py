"""A step's compressor projections into their compression-state rows, in one launch (see
`write_state_reference`).

Program (t, c) copies channels [c * BLOCK, (c + 1) * BLOCK) of token t's kv and gate rows into
row `rows[t]` of the two float32 state tensors. The torch chain is four launches (two float32
casts, two indexed stores) for each compressor of a layer, each at decode sizes costing more than
its work. The widening is exact, so the rows hold the chain's values bit for bit. Rows may repeat
(padded rows of a fixed-shape step share a scratch row); which write lands there is unspecified,
as with the chain's indexed store.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from antumbra.kernels.common import host_math
from antumbra.kernels.common.codecs import widened
from antumbra.kernels.common.interpreter import prepare

prepare()

BLOCK_W = 512  # channels a program copies


@triton.jit
def _write_state_kernel(
    kv_ptr,  # [T, W] contiguous, bfloat16 / float32
    gate_ptr,  # [T, W] contiguous, kv's dtype
    rows_ptr,  # [T] integer state rows
    state_kv_ptr,  # [R, W] float32 contiguous
    state_gate_ptr,  # [R, W] float32 contiguous
    W: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < W
    row = tl.load(rows_ptr + t).to(tl.int64)
    kv = widened(tl.load(kv_ptr + t * W + cols, mask=ok, other=0.0))
    gate = widened(tl.load(gate_ptr + t * W + cols, mask=ok, other=0.0))
    tl.store(state_kv_ptr + row * W + cols, kv, mask=ok)
    tl.store(state_gate_ptr + row * W + cols, gate, mask=ok)


def write_state_constexprs(width: int) -> dict[str, Any]:
    """Constexprs and launch options for state rows of `width` channels: the model's width only."""
    block = min(BLOCK_W, host_math.next_power_of_2(width))
    return dict(W=width, BLOCK=block, num_warps=max(1, min(4, block // 128)))


def write_state(kv: Tensor, gate: Tensor, rows: Tensor, state_kv: Tensor, state_gate: Tensor) -> None:
    """As `write_state_reference`: kv, gate [T, W] bfloat16 / float32 (one dtype), rows [T] integer,
    state_kv, state_gate [R, W] float32 contiguous; every tensor on one device."""
    assert kv.shape == gate.shape and kv.dim() == 2 and kv.dtype == gate.dtype, (
        f"kv and gate must be one [T, W] shape and dtype, got {tuple(kv.shape)} {kv.dtype} and "
        f"{tuple(gate.shape)} {gate.dtype}")
    assert kv.dtype in (torch.bfloat16, torch.float32), f"kv must be bfloat16 or float32, got {kv.dtype}"
    num_tokens, width = kv.shape
    assert rows.shape == (num_tokens,) and not rows.is_floating_point(), "rows must be [T] integers"
    for state in (state_kv, state_gate):
        assert state.dim() == 2 and state.shape[1] == width and state.dtype == torch.float32, (
            f"state rows must be [R, {width}] float32, got {tuple(state.shape)} {state.dtype}")
        assert state.is_contiguous(), "state rows must be contiguous"
    if num_tokens == 0:
        return
    consts = write_state_constexprs(width)
    _write_state_kernel[(num_tokens, host_math.cdiv(width, consts["BLOCK"]))](
        kv.contiguous(), gate.contiguous(), rows.contiguous(), state_kv, state_gate, **consts
    )
