"""The probe kernel of `launch_chain`, in a module of its own so that it is defined only after the
benchmark has chosen the interpreter or the GPU."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def add_one_kernel(x_ptr, y_ptr, n, PDL: tl.constexpr, BLOCK: tl.constexpr):
    """y = x + 1 over BLOCK elements a program; with PDL, wait for the predecessor's writes first and
    release the dependent launch at once (it waits in its turn)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=ok, other=0.0) + 1.0, mask=ok)
