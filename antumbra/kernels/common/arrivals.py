"""Arrival counters for the "last program finishes" pattern, kept at zero between launches.

A kernel that splits one output over several programs can finish it in the program that arrives
last (a CTA barrier, one acq_rel atomic per program, the last arrival reads the others' partials
back) instead of in a second launch. Its counters must be zero when it starts; a `torch.zeros` per
call would be one more launch each time (a fill), which is what the pattern saves.

Invariants, which `arrival_counters` and the kernels that use it keep together:
- every counter of a buffer is zero whenever no kernel that uses the buffer is running: the
  program that arrives last at a counter stores zero back (`finish_arrivals`), so a buffer is
  zeroed once, when it is allocated;
- kernels that share a buffer never run at the same time. A buffer belongs to one CUDA stream of
  one device (on the CPU, to one thread: the interpreter runs a launch in the calling thread), and
  the launches of one stream run in order, also inside a captured graph, whose side streams have
  buffers of their own; the graphs captured on one stream are replayed in order on one stream.
- a buffer that grows is replaced, never freed: a captured graph keeps the old one's address.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl
from torch import Tensor

from antumbra.kernels.common.interpreter import prepare

prepare()

MIN_COUNTERS = 1024  # a buffer's first size: the decode steps' splits need a few hundred

_lock = threading.Lock()
_buffers: dict[tuple[str, int | None, int, str], Tensor] = {}
_replaced: list[Tensor] = []  # grown out of, kept alive for the graphs that hold their addresses


def _owner(device: torch.device) -> tuple[str, int | None, int]:
    if device.type == "cuda":
        return ("cuda", device.index, torch.cuda.current_stream(device).cuda_stream)
    return (device.type, device.index, threading.get_ident())


def arrival_counters(device: torch.device, count: int, purpose: str = "") -> Tensor:
    """-> int32 [count] counters on `device`, all zero, for one launch on the current stream.

    Allocated (zeroed) the first time a stream asks, or when it asks for more than it has; inside
    a graph capture that allocation and its fill are captured too, and run at each replay.
    `purpose` names a buffer of its own: for state that must stay zero across two launches (the
    indexer top-k's histogram and counters, from its score launch to its filter's finish), apart
    from the counters each split-K launch takes."""
    key = (*_owner(device), purpose)
    with _lock:
        buffer = _buffers.get(key)
        if buffer is None or buffer.numel() < count:
            if buffer is not None:
                _replaced.append(buffer)
            size = max(count, MIN_COUNTERS if buffer is None else 2 * buffer.numel())
            buffer = torch.zeros(size, dtype=torch.int32, device=device)
            _buffers[key] = buffer
    return buffer[:count]


@triton.jit
def arrive(count_ptr, PROGRAMS):
    """Count this program's arrival at `count_ptr` -> True in the last of PROGRAMS to arrive.

    Call after the program's partial results are stored: the CTA barrier orders every thread's
    stores before the release, and the acquire in the last program orders its reads of the others'
    partials after theirs (read them with `cache_modifier=".cg"`: through L2, not a stale L1 line)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    return arrived == PROGRAMS - 1


@triton.jit
def finish_arrivals(count_ptr):
    """In the last program to arrive: the counter back to zero, for the next launch on the stream."""
    tl.atomic_xchg(count_ptr, 0, sem="relaxed")


@triton.jit
def gather_slices(y, part_ptrs, mask, slice_stride, counter):
    """Split-K over program axis 2: this program's float32 partial `y` goes to its slice of the
    workspace (`part_ptrs` + slice * `slice_stride`); -> (done, total), done True in the tile's last
    program to arrive at `counter`, which holds the slices' sum in order 0, 1, ... (whichever
    program that is: the sum does not depend on the arrival order). Elsewhere total is zeros."""
    splits = tl.num_programs(2)
    tl.store(part_ptrs + tl.program_id(2) * slice_stride, y, mask=mask)
    done = arrive(counter, splits)
    total = tl.zeros_like(y)
    if done:
        finish_arrivals(counter)
        for s in range(0, splits):
            total += tl.load(part_ptrs + s * slice_stride, mask=mask, other=0.0, cache_modifier=".cg")
    return done, total


@triton.jit
def tile_slots(t, pid_n, num_tokens, BLOCK_N: tl.constexpr):
    """A one-token program's workspace slots for output tile `pid_n` (program axis 1) of token t:
    each token holds whole tiles of columns. -> (slots [BLOCK_N] int64, elements between K slices)."""
    padded = tl.num_programs(1) * BLOCK_N
    slots = t.to(tl.int64) * padded + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return slots, num_tokens.to(tl.int64) * padded


@triton.jit
def store_split_tile(y, out_ptrs, part_ptrs, mask, slice_stride, counter, ROUND: tl.constexpr, scale):
    """A program's float32 output tile `y`, rounded to ROUND, widened, times `scale`, stored in the
    output's dtype. With several K slices (program axis 2) the tile's last program to arrive stores
    the slices' sum instead (`gather_slices`). With ROUND the output's dtype and scale 1 the value is
    the plain cast. One variant serves both: the branch follows the launch's slice count (uniform)."""
    if tl.num_programs(2) > 1:
        done, total = gather_slices(y, part_ptrs, mask, slice_stride, counter)
        if done:
            _store_rounded(total, out_ptrs, mask, ROUND, scale)
    else:
        _store_rounded(y, out_ptrs, mask, ROUND, scale)


@triton.jit
def _store_rounded(y, out_ptrs, mask, ROUND: tl.constexpr, scale):
    value = y.to(ROUND).to(tl.float32) * scale
    tl.store(out_ptrs, value.to(out_ptrs.dtype.element_ty), mask=mask)
