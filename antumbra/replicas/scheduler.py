"""Continuous batching under a token budget, with chunked prefill.

There is no prefill phase and no decode phase: each request has `num_tokens`
known tokens of which `num_computed_tokens` have KV in the pools, and each step
gives every scheduled request a chunk of the rest. Running requests go first (in
arrival order), so decodes are never starved by new prompts; waiting requests are
admitted while the step's token budget, the sequence limit and the pools allow.
A chunk may end anywhere: compressor windows left open carry over in the
compression-state rows.

Pool accounting:
  * virtual pages for the whole request (prompt + its largest output) are
    reserved on admission, so a running request never runs out of slots;
  * SWA pages are attached to the pages a chunk writes, right before its step,
    and detached after the step for pages wholly behind `swa_horizon`, so a
    sequence holds at most `steady_swa_pages_per_seq` of them between steps;
  * admission keeps room for every running sequence's steady SWA footprint.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from antumbra.cachestore.pools import KVPools
from antumbra.config import SchedulerConfig

from .request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # first position computed this step
    num_new_tokens: int

    @property
    def stop(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the request's last known token, so a token is sampled."""
        return self.stop == self.request.num_tokens


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, pools: KVPools) -> None:
        self.cfg = cfg
        self.pools = pools
        self.page_size = pools.layout.page_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ----- queue management -----
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished and give back every page it holds (a no-op if already finished)."""
        if request.finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.pools.free_virtual_pages(request.vpages)
        request.vpages = []
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    # ----- one step -----
    def schedule(self) -> list[ScheduledChunk]:
        budget = self.cfg.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for request in self.running:
            if budget == 0:
                break
            chunk = self._chunk(request, budget)
            if chunk is not None:
                chunks.append(chunk)
                budget -= chunk.num_new_tokens
        while self.waiting and budget > 0 and self._can_admit(self.waiting[0]):
            request = self.waiting[0]
            pages = -(-request.max_total_tokens // self.page_size)
            chunk_pages = self.pools.num_free_swa_pages
            if chunk_pages == 0:
                break
            self.waiting.popleft()
            request.vpages = self.pools.alloc_virtual_pages(pages)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chunk = self._chunk(request, budget)
            if chunk is not None:
                chunks.append(chunk)
                budget -= chunk.num_new_tokens
        return chunks

    def _can_admit(self, request: Request) -> bool:
        layout = self.pools.layout
        if len(self.running) >= self.cfg.max_num_seqs:
            return False
        if -(-request.max_total_tokens // self.page_size) > self.pools.num_free_virtual_pages:
            return False
        steady = layout.steady_swa_pages_per_seq
        return (len(self.running) + 1) * steady <= layout.num_swa_pages

    def _chunk(self, request: Request, budget: int) -> ScheduledChunk | None:
        start = request.num_computed_tokens
        todo = request.num_tokens - start
        limit = self.cfg.max_prefill_chunk_tokens
        if limit is not None and todo > 1:
            todo = min(todo, limit)
        todo = min(todo, budget)
        todo = self._fit_swa(request, start, todo)
        if todo <= 0:
            return None
        return ScheduledChunk(request, start, todo)

    def _fit_swa(self, request: Request, start: int, count: int) -> int:
        """Attach SWA pages for positions [start, start + count), shrinking the chunk to what is free."""
        page = self.page_size
        first, last = start // page, (start + count - 1) // page
        for logical in range(first, last + 1):
            vpage = request.vpages[logical]
            if self.pools.has_swa(vpage):
                continue
            if self.pools.num_free_swa_pages == 0:
                return logical * page - start
            self.pools.attach_swa(vpage)
        return count

    def after_step(self, chunks: list[ScheduledChunk]) -> None:
        for chunk in chunks:
            request = chunk.request
            request.num_computed_tokens = chunk.stop
            self.release_slid_out(request)

    def release_slid_out(self, request: Request) -> None:
        horizon = self.pools.layout.swa_horizon(request.num_computed_tokens)
        for logical in range(horizon // self.page_size):
            vpage = request.vpages[logical]
            if self.pools.has_swa(vpage):
                self.pools.detach_swa(vpage)

    def check_integrity(self) -> None:
        self.pools.check_integrity()
        owned = [v for r in self.running for v in r.vpages]
        assert len(owned) == len(set(owned)), "a virtual page is owned by two requests"
        assert not [r for r in self.waiting if r.vpages], "a waiting request holds pages"
        for request in self.running:
            held = self.pools.num_swa_pages_of(request.vpages)
            assert held <= self.pools.layout.steady_swa_pages_per_seq, f"{request.request_id} holds {held} SWA pages"
