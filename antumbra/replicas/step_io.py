"""What passes between the three parts of one step: the scheduler's decision, the model runner's
results, and back to the scheduler, which alone applies them (`Scheduler.update_from_output`).

    SchedulerOutput = Scheduler.schedule()
    RunnerOutput = ModelRunner.execute(SchedulerOutput)       # changes no request
    Scheduler.update_from_output(SchedulerOutput, RunnerOutput)  # tokens, stops, finishes

An overlapped step (`overlap.py`) is launched before its tokens are known: its output is
`LAUNCHED` (each request that goes on holds a `PENDING` token) and carries the previous step's
tokens, read back meanwhile, as a `RESOLVED` output.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .request import Request

PENDING = -1  # a token id the previous launch drew on the device, not read back yet


@dataclass(frozen=True)
class ScheduledChunk:
    """Positions [start, stop) of a request. A verify chunk (speculative decoding) is the request's
    last known token followed by its drafts (`draft_ids`, positions past its known tokens): every
    position's logits are kept and the rejection rule, not the sampler, decides what it emits. In
    batch-invariant mode a verify chunk runs as one-token verify chunks, the first without drafts."""

    request: Request
    start: int  # first position computed this step
    num_new_tokens: int
    draft_ids: Sequence[int] = ()  # the tokens of the chunk's last positions, drafted, not yet known
    verify: bool = False

    @property
    def stop(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the request's last known token, so a token is sampled."""
        return not self.verify and self.stop == self.request.num_tokens

    def token_ids(self) -> list[int]:
        """The chunk's input tokens: the request's known ones, then its drafts."""
        known = self.request.token_ids_range(self.start, self.stop - len(self.draft_ids))
        return known + list(self.draft_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step as scheduled: the chunks to run, in batch order."""

    chunks: tuple[ScheduledChunk, ...]
    preempted_ids: tuple[str, ...] = ()  # requests preempted to make room in this step, in order
    finished_ids: tuple[str, ...] = ()  # requests finished (stopped, aborted, failed) since the last step
    # Speculating requests draft this step (their chunks keep the streams the MTP block reads)
    speculate: bool = False

    @property
    def sampling(self) -> list[Request]:
        """The requests that draw a token this step, in row order (the chunks that sample)."""
        return [c.request for c in self.chunks if c.samples]

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    def unfinished(self) -> SchedulerOutput:
        """The same step without the chunks of requests that finished since it was scheduled."""
        return SchedulerOutput(tuple(c for c in self.chunks if not c.request.finished), self.preempted_ids,
                               self.finished_ids, self.speculate)


class OutputKind(enum.Enum):
    DRAWN = "drawn"  # the step ran and its tokens are known
    LAUNCHED = "launched"  # the step runs on; its tokens come with a later RESOLVED output
    RESOLVED = "resolved"  # the tokens of an earlier LAUNCHED step, each replacing a PENDING token
    HANDED_OVER = "handed_over"  # a first token drawn by another engine (a KV handoff's prefill side)


@dataclass(frozen=True)
class Drafts:
    """A request's drafts for its next step, made after this step's tokens (`speculative/`)."""

    token_ids: Sequence[int]  # a tuple, or `late_tokens.LateTokenIds` still on their way from the device
    # [k, V] float32 (device): the distribution each draft was drawn from; None: a greedy draft's,
    # one-hot at its token (made only where a rejection rule reads it, `distributions`)
    probs: torch.Tensor | None
    num_tokens: int  # the request's token count they follow (stale once it differs)

    def distributions(self, vocab: int, device: torch.device) -> torch.Tensor:
        """-> [k, V] float32 on `device`: `probs`, or the drafts' one-hot distributions."""
        if self.probs is not None:
            return self.probs
        probs = torch.zeros(len(self.token_ids), vocab, dtype=torch.float32, device=device)
        ids = torch.tensor(list(self.token_ids), dtype=torch.long).to(device)
        return probs.scatter_(1, ids[:, None], 1.0)


@dataclass(frozen=True)
class RunnerOutput:
    """What one step produced. Row b of the token fields belongs to requests[b]; a verify chunk's
    request has one row per token it emits, in order."""

    kind: OutputKind
    requests: tuple[Request, ...] = ()  # the requests that drew a token, in row order
    token_ids: tuple[int, ...] = ()  # empty for LAUNCHED
    logprobs: tuple[dict[int, float] | None, ...] = ()  # per row, None where not asked for
    prompt_logits: Mapping[str, torch.Tensor] = field(default_factory=dict)  # rid -> [n, V] float32 (CPU)
    prompt_hidden: Mapping[str, torch.Tensor] = field(default_factory=dict)  # rid -> [n, D] float32 (CPU)
    routed_experts: Mapping[str, torch.Tensor] = field(default_factory=dict)  # rid -> [n, L, k] int16 (CPU)
    # LAUNCHED: the step before it, read back while this one runs (applied before this step's PENDING)
    previous: RunnerOutput | None = None
    # DRAWN by the sampler: the same tokens [S] int64 on the device and the rows' penalty slots
    # (`penalty_state.ResidentRows`), counted once the step stands; None when nothing is to count.
    drawn: torch.Tensor | None = None
    resident: Any = None
    num_accepted: Mapping[str, int] = field(default_factory=dict)  # rid -> drafts its verify chunk accepted
    drafts: Mapping[str, Drafts] = field(default_factory=dict)  # rid -> drafts for its next step
    # rid -> [m, n, D] a chunk's kept last-layer streams, for a request whose KV handoff carries them
    handoff_streams: Mapping[str, torch.Tensor] = field(default_factory=dict)

    @staticmethod
    def launched(requests: list[Request], previous: RunnerOutput | None) -> RunnerOutput:
        return RunnerOutput(OutputKind.LAUNCHED, tuple(requests), previous=previous)

    @staticmethod
    def handed_over(request: Request, token_id: int, logprobs: dict[int, float] | None) -> RunnerOutput:
        return RunnerOutput(OutputKind.HANDED_OVER, (request,), (token_id,), (logprobs,))

    @staticmethod
    def resolved(requests: list[Request], token_ids: list[int]) -> RunnerOutput:
        return RunnerOutput(OutputKind.RESOLVED, tuple(requests), tuple(token_ids), (None,) * len(requests))


def kept_streams(chunk: ScheduledChunk, window: int) -> int:
    """How many of a speculating request's chunk positions (its last ones) keep their last-layer
    streams for the MTP block: a verify chunk's all (the accepted ones are read), another chunk's last
    `window` (the block's sliding window: the keys its later queries read)."""
    return chunk.num_new_tokens if chunk.verify else min(chunk.num_new_tokens, window)


def one_by_one(chunk: ScheduledChunk) -> list[ScheduledChunk]:
    """A verify chunk as one-token verify chunks (batch-invariant mode computes each position as a
    decode does); any other chunk as itself."""
    if not chunk.verify or chunk.num_new_tokens == 1:
        return [chunk]
    first = ScheduledChunk(chunk.request, chunk.start, 1, (), verify=True)
    return [first] + [ScheduledChunk(chunk.request, chunk.start + 1 + j, 1, (d,), verify=True)
                      for j, d in enumerate(chunk.draft_ids)]
