"""Continuous batching under a token budget, with chunked prefill and preemption.

There is no prefill phase and no decode phase: each request has `num_tokens`
known tokens of which `num_computed_tokens` have KV in the pools, and each step
gives every scheduled request a chunk of the rest. Running requests with one
token to compute (decodes) go first, so they are not starved by prompts; then
running prefills and waiting requests share what is left of the step's token
budget, handed out one chunk at a time in the order of the scheduling policy
(`scheduling_policy.py`: fair share across tenants, or FIFO), which re-reads
its order after each chunk. With an inter-token latency budget (`itl_budget_ms`)
the prefill tokens beside decodes are bounded further (`prefill_budget.py`).
A waiting request is admitted when its turn comes while the sequence limit
and the pools allow; once one cannot be admitted, no later one is tried in
that step. A chunk may end anywhere: compressor windows left open carry over
in the compression-state rows.

Pages are taken as chunks need them (`KVManager.grow`), evicting cached pages
first. When a running request cannot grow even then, the scheduler preempts by
recompute: the policy's victim among running requests not yet scheduled gives
back all it holds (its computed pages go to the cache) and waits to be admitted
again; it keeps its output tokens and resumes where it stopped. Nothing crashes
on exhaustion.

`schedule()` returns the step as a frozen `SchedulerOutput` (`step_io.py`); once the model
runner has run it, `update_from_output` applies its `RunnerOutput`: it is the one place where
tokens are appended, stops on token ids checked and requests finished by what they drew.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from antumbra.config import SchedulerConfig, SpeculativeConfig

from .errors import InvalidRequestError
from .kv_manager import KVManager
from .prefill_budget import PrefillBudget
from .progress import append_token, cut_at_stop
from .request import Request, RequestStatus
from .scheduling_policy import FairSharePolicy, SchedulingPolicy
from .speculation_gate import SpeculationGate
from .step_io import PENDING, OutputKind, RunnerOutput, ScheduledChunk, SchedulerOutput

# A finishing request's KV, read out of the pools before its pages go (prefill / decode handoff)
KVExport = Callable[[Request], Any]


@dataclass
class _Step:
    """What one `schedule` call has decided so far."""

    budget: int
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: set[int] = field(default_factory=set)  # ids of requests preempted in this step
    preempted_ids: list[str] = field(default_factory=list)  # their request ids, in order
    admitting: bool = True  # False once a waiting request did not fit


class Scheduler:
    """`eos_token_ids`: the model's end-of-sequence tokens (a stop unless `ignore_eos`); `export_kv`:
    called for a request with a KV handoff (`Request.handoff`) when it finishes, before its pages go;
    `prefill_rows`: the prompt tokens the runner computes as fixed-shape rows (`prefill_budget.py`)."""

    def __init__(self, cfg: SchedulerConfig, kv: KVManager, policy: SchedulingPolicy | None = None,
                 eos_token_ids: Sequence[int] = (), export_kv: KVExport | None = None,
                 prefill_rows: int = 0) -> None:
        self.cfg = cfg
        # Set by `EngineCore.enable_speculation`: requests then carry drafts into verify chunks.
        self.speculative: SpeculativeConfig | None = None
        self.speculation_gate: SpeculationGate | None = None  # with gate "measured"
        self.kv = kv
        self.policy = policy if policy is not None else FairSharePolicy()
        self.eos_token_ids = tuple(eos_token_ids)
        self.export_kv = export_kv
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.held: list[Request] = []  # holding locks, not scheduled: reserved for a KV adoption
        self.on_finish: Callable[[Request], None] | None = None  # told of every request that finishes
        self.num_generated_tokens = 0
        # Bounds the prefill beside decodes by measured step times (`step_finished` closes a step).
        self.prefill_budget = (PrefillBudget(cfg.itl_budget_ms, cfg.itl_floor_tokens, row_tokens=prefill_rows)
                               if cfg.itl_budget_ms is not None else None)
        self._finished_ids: list[str] = []  # since the last `schedule`

    def speculate_with(self, config: SpeculativeConfig | None) -> None:
        """Speculate as `config` says from now on (None: not at all)."""
        self.speculative = config
        measured = config is not None and config.gate == "measured"
        self.speculation_gate = SpeculationGate() if measured else None

    # ----- queue management -----
    def add(self, request: Request) -> None:
        self.policy.arrived(request, self.active_tenants())
        self.waiting.append(request)

    def active_tenants(self) -> set[str]:
        """Tenants with a request waiting or running."""
        return {r.tenancy.tenant_id for r in self.waiting} | {r.tenancy.tenant_id for r in self.running}

    def head_of_queue(self) -> Request | None:
        """The waiting request the policy would admit next."""
        return self.policy.queue(self.waiting).pop()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str, cache: bool = True) -> None:
        """Mark finished and give back every page it holds (a no-op if already finished); its
        computed pages join the prefix cache unless `cache` is False."""
        if request.finished:
            return
        if request in self.running:
            self.running.remove(request)
            self.kv.release(request, cache=cache)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._finished_ids.append(request.request_id)
        if self.on_finish is not None:
            self.on_finish(request)

    def preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.release(request)
        # It recomputes from its first uncached position: what it recorded per token is redone.
        request.record.restart_prompt()
        request.status = RequestStatus.WAITING
        if request.spec is not None:
            request.spec.drafts = None
        request.num_preemptions += 1
        self.kv.counters.num_preemptions += 1
        self.waiting.append(request)

    # ----- one step -----
    def schedule(self) -> SchedulerOutput:
        step = _Step(self.cfg.token_budget)
        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in self.running:
            (decodes if self._chunk_limit(r) == 1 else prefills).append(r)
        speculate = self.speculative is not None and len(decodes) <= self.speculative.max_batch
        if speculate and decodes and self.speculation_gate is not None:
            speculate = self.speculation_gate.speculate(len(decodes))
        num_decodes = 0  # the chunks of the first group (decodes) come first in the step
        for group in (decodes, prefills + self.waiting):
            if group is not decodes:  # the prefill group, bounded beside the decodes scheduled
                num_decodes = len(step.chunks)
                step.budget = min(step.budget, self._prefill_limit(num_decodes))
            if not group:  # a pure decode step has no second group: no queue to build
                continue
            queue = self.policy.queue(group)
            while step.budget > 0 and (request := queue.pop()) is not None:
                chunk = self._next_chunk(request, step)
                if chunk is not None and speculate:
                    chunk = self._with_drafts(chunk, step.budget)
                if chunk is not None:
                    step.chunks.append(chunk)
                    step.budget -= chunk.num_new_tokens
                    self._charge(chunk)
        finished, self._finished_ids = tuple(self._finished_ids), []
        if self.prefill_budget is not None:
            self.prefill_budget.started(num_decodes, sum(c.num_new_tokens for c in step.chunks[num_decodes:]))
        if self.speculation_gate is not None:
            self.speculation_gate.started(num_decodes, speculate, len(step.chunks) > num_decodes,
                                          drafted=any(c.verify for c in step.chunks))
        return SchedulerOutput(tuple(step.chunks), tuple(step.preempted_ids), finished, speculate)

    def _prefill_limit(self, num_decodes: int) -> int:
        """The prefill tokens the step may carry beside its `num_decodes` decode chunks."""
        limit = self.prefill_budget.limit(num_decodes) if self.prefill_budget is not None else None
        return self.cfg.token_budget if limit is None else limit

    def step_finished(self, as_rows: bool = False) -> None:
        """The last scheduled step's output is applied (it closes the step `prefill_budget` times);
        `as_rows`: its prompt chunks ran as rows of the fixed-shape step."""
        if self.prefill_budget is not None:
            self.prefill_budget.finished(as_rows)
        if self.speculation_gate is not None:
            self.speculation_gate.finished()

    def _with_drafts(self, chunk: ScheduledChunk, budget: int) -> ScheduledChunk:
        """A decode chunk extended by the request's drafts into a verify chunk, as many drafts as the
        budget and the pools allow without preempting for them (none: the chunk as it was)."""
        request = chunk.request
        drafts = request.spec.drafts_for(request.num_tokens) if request.spec is not None else None
        if drafts is None or not chunk.samples or chunk.num_new_tokens != 1:
            return chunk
        num_drafts = min(len(drafts.token_ids), budget - 1)
        while num_drafts > 0 and not self.kv.grow(request, chunk.stop + num_drafts):
            num_drafts -= 1
        if num_drafts <= 0:
            return chunk
        drafted = drafts.token_ids[:num_drafts]
        return ScheduledChunk(request, chunk.start, 1 + num_drafts, drafted, verify=True)

    def _next_chunk(self, request: Request, step: _Step) -> ScheduledChunk | None:
        if id(request) in step.preempted:
            return None
        if request.status is RequestStatus.RUNNING:
            return self._chunk_with_preemption(request, step)
        if not step.admitting or len(self.running) >= self.cfg.max_num_seqs:
            return None
        if not self._admit(request):
            step.admitting = False
            return None
        self.waiting.remove(request)
        chunk = self._chunk(request, step.budget)
        if chunk is None:
            step.admitting = False
        return chunk

    def _charge(self, chunk: ScheduledChunk) -> None:
        """Tell the policy what the chunk serves; positions a preempted request recomputes are not
        charged again."""
        request, stop = chunk.request, chunk.stop
        charged = request.num_charged_tokens
        prompt = max(0, min(stop, len(request.prompt_token_ids)) - max(chunk.start, charged))
        request.num_charged_tokens = max(charged, stop)
        decoded = chunk.num_new_tokens if chunk.verify else 1 if chunk.samples else 0
        self.policy.charge(request, prompt, decoded)

    def _admit(self, request: Request) -> bool:
        """Match the cache and take pages for a first chunk; False (nothing held) if it does not fit."""
        # Room first: admitting takes a HiSparse buffer, which the room check would then count as used.
        if not self.steady_room():
            return False
        self.kv.admit(request)
        if not self.kv.grow(request, request.num_computed_tokens + 1):
            self.kv.release(request, cache=False)
            return False
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return True

    def steady_room(self) -> bool:
        """Room for one more sequence's steady SWA footprint next to the running ones."""
        layout = self.kv.pools.layout
        hot = self.kv.pools.hot
        if hot is not None and hot.num_free == 0:
            return False
        return (len(self.running) + 1) * layout.steady_swa_pages_per_seq <= layout.num_swa_pages

    def _chunk_limit(self, request: Request) -> int:
        todo = request.num_tokens - request.num_computed_tokens
        limit = self.cfg.max_prefill_chunk_tokens
        if limit is not None and todo > 1:
            todo = min(todo, limit)
        if request.kv.replay_until > request.num_computed_tokens:
            # A chunk does not cross the end of a replay, so replayed windows are all skipped
            # before the first real one is written.
            todo = min(todo, request.kv.replay_until - request.num_computed_tokens)
        return todo

    def _chunk(self, request: Request, budget: int) -> ScheduledChunk | None:
        start = request.num_computed_tokens
        todo = min(self._chunk_limit(request), budget)
        while todo > 0 and not self.kv.grow(request, start + todo):
            todo = self._shrink(request, start, todo)
        if todo <= 0:
            return None
        return ScheduledChunk(request, start, todo)

    def _shrink(self, request: Request, start: int, todo: int) -> int:
        """A smaller chunk that ends on a page boundary (needs one page fewer), or nothing."""
        page = self.kv.page_size
        end = ((start + todo - 1) // page) * page
        return end - start if end > start else 0

    def _chunk_with_preemption(self, request: Request, step: _Step) -> ScheduledChunk | None:
        while True:
            chunk = self._chunk(request, step.budget)
            if chunk is not None:
                return chunk
            taken = {id(c.request) for c in step.chunks}
            victims = [r for r in self.running if r is not request and id(r) not in taken]
            if not victims:
                return None
            victim = self.policy.victim(victims)
            self.preempt(victim)
            step.preempted.add(id(victim))
            step.preempted_ids.append(victim.request_id)

    # ----- applying a step's results -----
    def update_from_output(self, step: SchedulerOutput, out: RunnerOutput) -> list[Request]:
        """Apply what the step produced: the only place where tokens are appended, stops checked
        and requests finished by their tokens. -> the requests that took a token, in row order.

        DRAWN: the chunks' KV is computed, then each row's token is appended (HANDED_OVER: the
        same for a token another engine drew, not counted as generated here). LAUNCHED: the chunks'
        KV is computed, the previous step's tokens (`out.previous`) are applied, then each request
        that goes on holds a PENDING token. RESOLVED: each token replaces its request's PENDING one
        (a request finished or aborted meanwhile is skipped)."""
        if out.kind in (OutputKind.DRAWN, OutputKind.LAUNCHED):
            self.after_step(step.chunks, out.num_accepted)
        for rid, logits in out.prompt_logits.items():
            self._request(step, rid).record.prompt_logits.append(logits)
        for rid, hidden in out.prompt_hidden.items():
            self._request(step, rid).record.prompt_hidden.append(hidden)
        for rid, experts in out.routed_experts.items():
            self._request(step, rid).record.routed_experts.append(experts)
        if out.handoff_streams:  # before the tokens: a handoff exports when its token finishes it
            for chunk in step.chunks:
                streams = out.handoff_streams.get(chunk.request.request_id)
                if streams is not None and chunk.request.handoff is not None:
                    chunk.request.handoff.keep_streams(chunk.stop, streams)
        if out.kind is OutputKind.LAUNCHED:
            before = self.update_from_output(step, out.previous) if out.previous is not None else []
            for request in out.requests:
                if not request.finished:
                    request.output_token_ids.append(PENDING)
            return before
        advanced: dict[int, Request] = {}
        resolved, generated = out.kind is OutputKind.RESOLVED, out.kind is not OutputKind.HANDED_OVER
        eos = self.eos_token_ids
        for request, token, logprobs in zip(out.requests, out.token_ids, out.logprobs, strict=True):
            if request.finished:
                continue  # aborted meanwhile, or a verify chunk's token after its request stopped
            if resolved:
                ids = request.output_token_ids
                if not ids or ids[-1] != PENDING:
                    continue  # its token was dropped while in flight
                ids.pop()
            self.num_generated_tokens += generated
            reason = append_token(request, token, logprobs, eos)
            if reason is not None:
                self._finish_by_token(request, reason)
            advanced[id(request)] = request
        self._record_speculation(step, out)
        return list(advanced.values())

    def _record_speculation(self, step: SchedulerOutput, out: RunnerOutput) -> None:
        """Count what the verify chunks accepted and keep each request's drafts for its next step."""
        if self.speculative is None:  # no request speculates: nothing to keep
            return
        if self.speculation_gate is not None:
            self.speculation_gate.accepted(sum(out.num_accepted.values()))
        for chunk in step.chunks:
            spec = chunk.request.spec
            if spec is None:
                continue
            if chunk.verify and chunk.request.request_id in out.num_accepted:
                spec.num_drafted += len(chunk.draft_ids)
                spec.num_accepted += out.num_accepted[chunk.request.request_id]
            spec.drafts = out.drafts.get(chunk.request.request_id)

    def stop_at(self, request: Request, num_output_tokens: int) -> None:
        """End a request whose text reached a stop string (found on the output side, a step or two
        after the engine drew the token that completed it) with the tokens up to that one."""
        cut_at_stop(request, num_output_tokens)
        self._finish_by_token(request, "stop")

    def _finish_by_token(self, request: Request, reason: str) -> None:
        if request.handoff is not None:  # PD: its rows leave before its pages do
            if self.export_kv is None:
                raise InvalidRequestError("this engine core exports no KV (built without export_kv)",
                                          "export_kv_from")
            request.handoff.payload = self.export_kv(request)
        self.finish(request, reason)

    @staticmethod
    def _request(step: SchedulerOutput, request_id: str) -> Request:
        return next(c.request for c in step.chunks if c.request.request_id == request_id)

    def after_step(self, chunks: Sequence[ScheduledChunk], num_accepted: Mapping[str, int] | None = None
                   ) -> None:
        """The chunks' positions are computed; a verify chunk's only up to its last accepted draft
        (the rows of rejected drafts are rewritten before any query reads them)."""
        counters, release_slid_out = self.kv.counters, self.kv.release_slid_out
        for chunk in chunks:
            request, stop = chunk.request, chunk.stop
            request.num_computed_tokens = stop
            if chunk.verify:
                accepted = (num_accepted or {}).get(request.request_id, 0)
                request.num_computed_tokens = stop - len(chunk.draft_ids) + accepted
            computed_prompt = max(0, min(stop, len(request.prompt_token_ids)) - chunk.start)
            if computed_prompt:  # a decode computes none
                request.num_computed_prompt_tokens += computed_prompt
                counters.num_computed_prompt_tokens += computed_prompt
            release_slid_out(request)

    def check_integrity(self) -> None:
        self.kv.check_integrity(self.running + self.held)
        holding = [r for r in self.waiting if r.kv.vpages or r.kv.shared_path]
        assert not holding, "a waiting request holds pages"
        layout = self.kv.pools.layout
        for request in self.running:
            own = request.kv.vpages[len(request.kv.shared_path) :]
            held = self.kv.pools.num_swa_pages_of(own) + len(request.kv.swa_locked)
            drafts = self.speculative.draft_pages(layout.page_size) if self.speculative is not None else 0
            allowed = layout.steady_swa_pages_per_seq + drafts
            assert held <= allowed, f"{request.request_id} holds {held} SWA pages"
