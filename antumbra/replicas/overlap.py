"""Overlap scheduling: the host prepares step n+1 while the device runs step n.

Rows under a grammar (structured output) overlap too: their step's forward is launched first,
then the previous step's tokens are applied (advancing each grammar), then the masks for this
step are computed on the mask worker while the forward runs and the host prepares the next step;
the step's tokens are drawn under them just before the next step's forward is launched
(`DecodeGraphs.launch(masked=True)`, `Launched.defer` / `finish`), or when they are read.

A pure-decode step whose rows the graphs' race draws (no logprobs, no top-k / top-p cut;
penalised rows too, their counts kept on the device: `graph_race.py`) is launched without
waiting for its tokens: each request gets a `PENDING` token at the position it just decoded,
the next step is scheduled and launched at once (the graph takes
that token from the previous launch's draws on the device), and only then are the previous
step's tokens read back (they are ready: the device finished that step before starting this
one) and applied: stop checks, text, snapshots. The outputs of step n come back from the call
that launched step n+1, one step late, as SGLang's overlap scheduler does.

What this costs and where it stops:
  * A request that stops on a token's value (end of sequence, stop ids or strings) has already
    been scheduled for one more step: that step's KV row at the stopped position is written
    (for the real token, so the cached pages stay true) and its draw is dropped.
  * Parallel replicas (a `before_step` hook on the decode graphs) never overlap: the other ranks
    replay rank 0's inputs, and a pending token would be taken from their own draws.
  * The overlap is drained (the tokens in flight read and applied before scheduling) whenever
    the next step might not be a pure decode of the same requests: requests wait to be
    admitted, a request finishes by length on its pending token, or the step does not qualify.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from antumbra.config import EngineConfig

from .decode_graphs import PENDING
from .launched import Launched
from .progress import append_token, snapshot
from .request import Request, RequestOutput
from .runner import Runner
from .sampler import SamplingRows
from .scheduler import ScheduledChunk, Scheduler
from .structured.masks import PendingMask


class SteppingCore(Protocol):
    """What the stepper reads and advances of the engine core that owns it (`core.EngineCore`),
    named here so that this module does not import the core."""

    config: EngineConfig
    runner: Runner
    scheduler: Scheduler
    requests: dict[str, Request]
    eos_token_ids: tuple[int, ...]
    num_steps: int
    num_generated_tokens: int

    def start_masks(self, sampling: list[Request]) -> PendingMask | None: ...


@dataclass
class _InFlight:
    requests: list[Request]  # in row order
    launched: Launched


class OverlapStepper:
    def __init__(self, core: SteppingCore, enabled: bool) -> None:
        self.core = core
        self.enabled = enabled and core.runner.fast is not None
        self.inflight: _InFlight | None = None
        self.stash: list[RequestOutput] = []  # outputs of a drain that no step has returned yet
        self.num_overlapped_steps = 0
        self.num_drains = 0  # tokens in flight read before scheduling (the next step could not overlap)

    @property
    def busy(self) -> bool:
        return self.inflight is not None or bool(self.stash)

    def take_stash(self) -> list[RequestOutput]:
        out, self.stash = self.stash, []
        return out

    def can_continue(self) -> bool:
        """Whether the next step may be scheduled with the tokens in flight unknown."""
        flight = self.inflight
        if flight is None:
            return True
        if not self.enabled:  # switched off with a step in flight: the next step reads its tokens
            return False
        sched = self.core.scheduler
        if sched.waiting or len(sched.running) != len(flight.requests):
            return False
        live = {id(r) for r in flight.requests}
        return all(
            id(r) in live
            and r.num_output_tokens < r.params.max_tokens
            and r.num_tokens < r.max_total_tokens
            for r in sched.running
        )

    def eligible(self, chunks: list[ScheduledChunk], rows: SamplingRows) -> bool:
        fast = self.core.runner.fast
        return (
            self.enabled
            and fast is not None
            # A parallel replica's rank 0 sends each step's inputs to the other ranks (`before_step`),
            # whose graphs would take pending tokens from draws of their own: never overlapped.
            and fast.before_step is None
            and fast.race.draws(rows)
            and fast.eligible(chunks)
            # PD exports (kv_transfer/) take their rows when the request finishes, in `_complete`.
            and all(c.request.params.logprobs is None and not c.request.params.return_routed_experts
                    and c.request.export_kv_from is None for c in chunks)
        )

    def launch(self, chunks: list[ScheduledChunk], rows: SamplingRows) -> list[RequestOutput]:
        """Launch the step, then apply the previous one; -> the previous step's outputs."""
        fast = self.core.runner.fast
        assert fast is not None
        if self.inflight is not None:
            # A masked step drawn now, its masks computed while the host scheduled this step: this
            # step's forward reads its tokens on the device.
            self.inflight.launched.finish()
        rows_of = {id(r): b for b, r in enumerate(self.inflight.requests)} if self.inflight else {}
        sources = [rows_of.get(id(c.request), -1) if c.request.output_token_ids[-1:] == [PENDING] else -1
                   for c in chunks]
        requests = [c.request for c in chunks]
        masked = any(r.grammar is not None for r in requests)
        launched = fast.launch(chunks, rows, sources, masked=masked)
        self.core.scheduler.after_step(chunks)
        self.core.num_steps += 1
        self.num_overlapped_steps += 1
        outputs = self.resolve()
        if masked:
            # The grammars have just taken the previous step's tokens: the masks for this step's
            # draws are computed on the mask worker while its forward runs on the device and the host
            # returns, schedules and prepares the next step, which draws this one before its forward.
            launched.defer(self.core.start_masks(requests))
        for request in requests:
            if not request.finished:
                request.output_token_ids.append(PENDING)
        self.inflight = _InFlight(requests, launched)
        return outputs

    def resolve(self) -> list[RequestOutput]:
        """Read the tokens in flight and apply them; -> the snapshots of their requests."""
        flight, self.inflight = self.inflight, None
        if flight is None:
            return []
        core = self.core
        outputs = []
        for request, token in zip(flight.requests, flight.launched.tokens(), strict=True):
            if request.finished or request.output_token_ids[-1:] != [PENDING]:
                continue  # aborted (or finished) while its token was in flight
            request.output_token_ids.pop()
            core.num_generated_tokens += 1
            reason = append_token(request, token, None, core.eos_token_ids)
            if reason is not None:
                core.scheduler.finish(request, reason)
            out = snapshot(request)
            outputs.append(out)
            if out.finished:
                core.requests.pop(out.request_id, None)
        return outputs

    def drain(self) -> None:
        """Apply the tokens in flight now; their outputs come with the next step."""
        self.num_drains += self.inflight is not None
        self.stash += self.resolve()

    def forget(self, request: Request) -> None:
        """Drop the request's pending token (it is being aborted)."""
        if request.output_token_ids[-1:] == [PENDING]:
            request.output_token_ids.pop()
