"""Tokens an overlapped launch drew, taken into the next step's input ids on the device, in one
launch (see `take_sources_reference`).

The fixed-shape step's packed inputs name, per row, where its input id comes from when the host
does not know it yet: row 3 holds the index of the previous launch's draw (-1: the host's id in row
0 stands). The torch chain is a clamp, a gather, a compare, a where and a copy; one program of
`BLOCK` rows does it (a step has at most a few hundred rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from antumbra.kernels.common import host_math
from antumbra.kernels.common.interpreter import prepare

prepare()

BLOCK = 256  # rows a program takes


@triton.jit
def _take_kernel(
    packed_ptr,  # *i64 [>= 4, B] (row stride `stride`): row 0 the input ids (in/out), row 3 the sources
    drawn_ptr,  # *i64 [>= max source + 1] the previous launch's draws
    stride,  # elements between rows of packed
    B,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = b < B
    src = tl.load(packed_ptr + 3 * stride + b, mask=ok, other=-1)
    take = ok & (src >= 0)
    token = tl.load(drawn_ptr + tl.maximum(src, 0), mask=take, other=0)
    tl.store(packed_ptr + b, token, mask=take)


def take_sources(packed: Tensor, drawn: Tensor) -> None:
    """As `take_sources_reference`: packed [>= 4, B] int64 with unit stride along B (a column
    slice of a wider buffer is fine), drawn [N] int64, one device."""
    assert packed.dim() == 2 and packed.shape[0] >= 4 and packed.dtype == torch.int64
    assert packed.stride(1) == 1, "packed rows need unit stride"
    assert drawn.dim() == 1 and drawn.dtype == torch.int64 and drawn.is_contiguous()
    rows = packed.shape[1]
    if rows:
        _take_kernel[(host_math.cdiv(rows, BLOCK),)](packed, drawn, packed.stride(0), rows, BLOCK=BLOCK,
                                                       num_warps=1)


def take_sources_reference(packed: Tensor, drawn: Tensor) -> None:
    """packed [>= 4, B] int64: row 0 := drawn[row 3] where row 3 >= 0 (a token the last overlapped
    launch drew, still on the device)."""
    src = packed[3]
    packed[0].copy_(torch.where(src >= 0, drawn.gather(0, src.clamp(min=0)), packed[0]))
