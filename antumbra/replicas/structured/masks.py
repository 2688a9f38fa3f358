"""A batch's allowed-token masks, filled on a worker thread while the forward runs.

`MaskBuilder.start` hands the step's matchers to a worker thread, which fills a pinned host
buffer of packed int32 bitmasks (one row per sampling row: all ones for an unconstrained row)
through llguidance's `LLExecutor`, which computes the rows in parallel with the GIL released. The
engine starts it before it runs the model and collects it (`PendingMask.result`) once the forward
is launched, so the mask costs the step only what outlasts the forward; the copy to the device is
asynchronous, and the mask is applied on the device inside the sampling step.

Two host buffers alternate: a step's buffer is rewritten two steps later, long after the device
read it (every step reads its sampled tokens back before the next one starts).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from llguidance import LLExecutor, LLMatcher

from antumbra.kernels.token_mask import words_for

from .matcher import GrammarMatcher


class PendingMask:
    def __init__(self, future: Future, rows: int) -> None:
        self._future = future
        self._rows = rows

    def result(self, device: torch.device) -> torch.Tensor:
        """[B, W] int32 bitmask on `device` (waits for the worker; the copy is asynchronous)."""
        host: torch.Tensor = self._future.result()
        return host[: self._rows].to(device, non_blocking=True)


class MaskBuilder:
    def __init__(self, vocab_size: int, device: torch.device, threads: int | None = None) -> None:
        """`threads`: llguidance's mask threads (None: its default, most of the CPUs)."""
        self.words = words_for(vocab_size)
        self.device = device
        self._pinned = device.type == "cuda"
        self._executor = LLExecutor(num_threads=threads)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        self._buffers: list[torch.Tensor] = []
        self._flip = 0
        self.num_masks = 0  # rows masked so far (engine stats)
        self.num_fills = 0  # batches filled so far
        self.fill_seconds = 0.0  # the worker's time filling them

    def start(self, matchers: Sequence[GrammarMatcher | None]) -> PendingMask | None:
        """Begin the masks of a step's sampling rows (None: an unconstrained row); None when no
        row is constrained. The matchers must not advance until the result is taken."""
        rows = [(m.matcher, i) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        host = self._buffer(len(matchers))
        self.num_masks += len(rows)
        return PendingMask(self._worker.submit(self._fill, host, rows), len(matchers))

    def _fill(self, host: torch.Tensor, rows: list[tuple[LLMatcher, int]]) -> torch.Tensor:
        start = time.perf_counter()
        host.fill_(-1)
        self._executor.unsafe_compute_mask_ptr(rows, host.data_ptr(), self.words * 4, host.shape[0])
        self.fill_seconds += time.perf_counter() - start
        self.num_fills += 1
        return host

    def _buffer(self, rows: int) -> torch.Tensor:
        self._flip ^= 1
        while len(self._buffers) < 2:
            self._buffers.append(torch.empty(0, self.words, dtype=torch.int32))
        host = self._buffers[self._flip]
        if host.shape[0] < rows:
            host = torch.empty(max(rows, 2 * host.shape[0]), self.words, dtype=torch.int32,
                               pin_memory=self._pinned)
            self._buffers[self._flip] = host
        return host

    def close(self) -> None:
        self._worker.shutdown(wait=True)
