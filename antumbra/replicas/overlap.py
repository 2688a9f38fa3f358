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

A step of decodes and short prompt chunks run as fixed-shape rows (`runner.py`, prompt rows) is
launched the same way when its sampling rows are plain (`GraphRace.draws_at`): a decode row's
pending token comes from the previous launch's draws, a prompt row's token from the host, and each
sampling chunk's token is the race's draw at its last row. A request still prefilling holds no
pending token, so the overlap goes on across its chunks.

What this costs and where it stops:
  * A request that stops on a token's value (end of sequence, stop ids or strings) has already
    been scheduled for one more step: that step's KV row at the stopped position is written
    (for the real token, so the cached pages stay true) and its draw is dropped.
  * Parallel replicas (a `before_step` hook on the decode graphs) never overlap: the other ranks
    replay rank 0's inputs, and a pending token would be taken from their own draws.
  * The overlap is drained (the tokens in flight read and applied before scheduling) whenever
    the next step might read a token still in flight other than as a row's input: a request
    waits with its token in flight (preempted), or one finishes by length on its pending token.
    A step scheduled with tokens in flight that does not qualify reads them before it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import decode_rows
from .decode_graphs import DecodeGraphs
from .launched import Launched
from .request import Request
from .sampler import SamplingRows
from .scheduler import Scheduler
from .step_io import PENDING, RunnerOutput, ScheduledChunk, SchedulerOutput
from .structured.masks import PendingMask

# The allowed-token masks of a step's rows, started on the mask worker (`ModelRunner.start_masks`)
MaskStarter = Callable[[list[Request]], PendingMask | None]


@dataclass
class _InFlight:
    step: SchedulerOutput
    requests: list[Request]  # those that sample, in row order
    launched: Launched
    # Each request's row in the launch's draws (a prompt rows step's); None: request b's is row b.
    draw_rows: list[int] | None

    def drawn_at(self) -> dict[int, int]:
        """id(request) -> its row in the launch's draws (where the next launch takes its token)."""
        rows = self.draw_rows if self.draw_rows is not None else range(len(self.requests))
        return dict(zip(map(id, self.requests), rows, strict=True))

    def tokens(self) -> list[int]:
        """The requests' tokens, read back (waits for the launch)."""
        drawn = self.launched.tokens()
        return drawn if self.draw_rows is None else [drawn[r] for r in self.draw_rows]


class OverlapStepper:
    def __init__(self, fast: DecodeGraphs | None, enabled: bool, start_masks: MaskStarter) -> None:
        self.fast = fast
        self.enabled = enabled and fast is not None
        self.start_masks = start_masks
        self.inflight: _InFlight | None = None
        self._masked: _InFlight | None = None  # launched under masks not drawn yet
        # Called before the tokens in flight are read back (after the next step's launch, when one
        # follows): the host then waits for the device, a moment for other threads to run.
        self.before_readback: Callable[[], None] | None = None
        self.launch_rows = True  # steps of prompt rows too (a switch for A/B timing)
        self.num_overlapped_steps = 0
        self.num_rows_launches = 0  # of those, steps of prompt rows
        self.num_drains = 0  # tokens in flight read before scheduling (the next step could not overlap)

    def can_continue(self, sched: Scheduler) -> bool:
        """Whether the next step may be scheduled with the tokens in flight unknown."""
        flight = self.inflight
        if flight is None:
            return True
        if not self.enabled:  # switched off with a step in flight: the next step reads its tokens
            return False
        # A request admitted or still prefilling (no token pending) goes on from tokens the host
        # knows; one preempted with its token in flight would recompute it.
        if any(_pending(r) for r in sched.waiting):
            return False
        live = {id(r) for r in flight.requests}
        return all(
            not _pending(r)
            or (id(r) in live and r.num_output_tokens < r.params.max_tokens
                and r.num_tokens < r.max_total_tokens)
            for r in sched.running
        )

    def eligible(self, chunks: list[ScheduledChunk], rows: SamplingRows, as_rows: bool = False) -> bool:
        """Whether the step may be launched overlapped: a pure decode step, or with `as_rows` a step of
        decodes and prompt chunks as fixed-shape rows whose sampling rows the race draws at their
        rows (`GraphRace.draws_at`; no structured output)."""
        fast = self.fast
        if not (
            self.enabled
            and fast is not None
            # A parallel replica's rank 0 sends each step's inputs to the other ranks (`before_step`),
            # whose graphs would take pending tokens from draws of their own: never overlapped.
            and fast.before_step is None
            # PD exports (kv_transfer/) take their rows when the request finishes (`update_from_output`).
            and all(c.request.params.logprobs is None and not c.request.params.return_routed_experts
                    and c.request.handoff is None for c in chunks)
        ):
            return False
        if as_rows:
            return (self.launch_rows and fast.race.draws_at(rows)
                    and all(c.request.grammar is None for c in chunks)
                    and fast.takes_prompt_rows(chunks, pending=True))
        return fast.race.draws(rows) and fast.eligible(chunks)

    def launch(self, step: SchedulerOutput, rows: SamplingRows, as_rows: bool = False) -> RunnerOutput:
        """Launch the step (`as_rows`: a step `eligible` took as rows), then read the previous one
        back; -> the step as LAUNCHED, carrying the previous step's tokens. A masked step draws in
        `draw`, once the scheduler applied them."""
        fast = self.fast
        assert fast is not None
        flight = self.inflight
        if flight is not None:
            # A masked step drawn now, its masks computed while the host scheduled this step: this
            # step's forward reads its tokens on the device.
            flight.launched.finish()
        chunks = list(step.chunks)
        requests = [c.request for c in chunks if c.samples]
        masked = any(r.grammar is not None for r in requests)
        at = decode_rows.sampling_rows(chunks) if as_rows else None
        launched = fast.launch(chunks, rows, flight.drawn_at() if flight else {}, masked=masked, at=at)
        self.num_overlapped_steps += 1
        self.num_rows_launches += as_rows
        previous = self.resolve()
        self.inflight = _InFlight(step, requests, launched, at)
        self._masked = self.inflight if masked else None
        return RunnerOutput.launched(requests, previous[1] if previous is not None else None)

    def draw(self) -> None:
        """Start a masked launch's draw: the grammars have just taken the previous step's tokens, so
        the masks for this step are computed now on the mask worker, while its forward runs on the
        device and the host returns, schedules and prepares the next step, which draws this one
        before its forward (`launch`) unless its tokens are read first (`resolve`)."""
        flight, self._masked = self._masked, None
        if flight is not None:
            flight.launched.defer(self.start_masks(flight.requests))

    def resolve(self) -> tuple[SchedulerOutput, RunnerOutput] | None:
        """Read the tokens in flight; -> their step and its RESOLVED output, None if none."""
        flight, self.inflight = self.inflight, None
        if flight is not None and self.before_readback is not None:
            self.before_readback()
        if flight is None or flight is self._masked:
            # A masked launch is drawn right after its launch; one left undrawn had its step fail
            # before its draw, and that step is re-run without it.
            self._masked = None
            return None
        return flight.step, RunnerOutput.resolved(flight.requests, flight.tokens())

    def drain(self) -> tuple[SchedulerOutput, RunnerOutput] | None:
        """`resolve` before scheduling: the next step could not overlap."""
        self.num_drains += self.inflight is not None
        return self.resolve()


def forget(request: Request) -> None:
    """Drop the request's pending token (it is being aborted)."""
    if _pending(request):
        request.output_token_ids.pop()


def _pending(request: Request) -> bool:
    """Whether the request's last token is still on the device."""
    ids = request.output_token_ids
    return bool(ids) and ids[-1] == PENDING

