"""Per-request state held by the engine, and what the engine reports back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .sampling_params import SamplingParams
from .structured.matcher import GrammarMatcher
from .tenancy import DEFAULT_TENANCY, Tenancy


@dataclass(eq=False)
class KVHandle:
    """What a request holds of the KV pools; only the KVManager (`kv_manager.py`) changes it."""

    vpages: list[int] = field(default_factory=list)  # block table: virtual page of each logical page
    shared_path: list[Any] = field(default_factory=list)  # cache nodes of the first pages (locked)
    swa_locked: dict[int, Any] = field(default_factory=dict)  # logical page -> node whose SWA it reads
    swa_released_pages: int = 0  # pages below this have had their SWA released
    replay_until: int = 0  # compressed rows of windows closing at or before this were copied
    exact_swa_from: int = 0  # SWA rows before this position were replayed inexactly
    hot_buffer: int = -1  # HiSparse device buffer of this request, -1 when none
    checkpoint: range | None = None  # its prompt's checkpoint pages (`KVManager.checkpoint_pages`)


@dataclass(eq=False)
class OutputRecord:
    """What a request produced, accumulated for its snapshots (`progress.snapshot`)."""

    logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token, if wanted
    routed_experts: list[torch.Tensor] = field(default_factory=list)  # [n, L, k] int16 chunks, if wanted
    prompt_logits: list[torch.Tensor] = field(default_factory=list)  # [n, V] chunks, if wanted
    prompt_hidden: list[torch.Tensor] = field(default_factory=list)  # [n, D] chunks, if wanted
    new_token_ids: list[int] = field(default_factory=list)  # output tokens not reported yet
    first_token_time_s: float | None = None
    weights_version: str = ""  # the weights every token is made with (set when first scheduled)

    def restart_prompt(self) -> None:
        """Forget what was recorded per computed token (a preempted request recomputes them)."""
        self.prompt_logits, self.prompt_hidden, self.routed_experts = [], [], []


# Identity, not field equality: the replayed routing is a tensor.
@dataclass(frozen=True, eq=False)
class RolloutSpec:
    """What a trainer asks of a request beyond its tokens (RL rollouts and scoring them again):
    records of every computed prompt position, and routing to replay over the prompt. The routing
    of every token (R3) is asked for by `params.return_routed_experts`, where the REST API puts it."""

    want_prompt_logits: bool = False  # the [n, V] logits of every computed prompt position
    want_prompt_hidden: bool = False  # the [n, D] final hidden states of every computed prompt position
    replay_experts: torch.Tensor | None = None  # [S', L, k] experts of the first S' positions; None: free

    @property
    def wants_prompt_rows(self) -> bool:
        """Whether every computed prompt position keeps its output row (logits or hidden states)."""
        return self.want_prompt_logits or self.want_prompt_hidden

    @property
    def computes_every_token(self) -> bool:
        """Whether the whole prompt must be computed (a cached page keeps neither rows nor routing)."""
        return self.wants_prompt_rows or self.replay_experts is not None


NO_ROLLOUT = RolloutSpec()  # a request served plainly


@dataclass(eq=False)
class KVHandoff:
    """The prefill side of a prefill / decode handoff: the request's KV is read out of the pools
    when it finishes (compressed rows from page `export_from`), before its pages go."""

    export_from: int
    payload: Any = None  # the exported kv_transfer.KVPayload
    # A speculating decode engine's drafter reads the target's last-layer streams at the prompt's last
    # `stream_window` positions (its MTP window): they travel with the KV when this is > 0.
    stream_window: int = 0
    streams: torch.Tensor | None = None  # [m, n, D] the streams at positions [streams_start, +m)
    streams_start: int = 0

    @property
    def sends_streams(self) -> bool:
        return self.stream_window > 0

    def keep_streams(self, stop: int, hidden: torch.Tensor) -> None:
        """Add a chunk's kept streams (positions [stop - len, stop)), keeping the last window. Rows are
        placed by position, so a step run again replaces what its first run added; rows that do not
        reach the new ones (a recompute after preemption skipped past them) are dropped. Always a copy:
        a step's streams may be views of its reused output buffers."""
        start = stop - hidden.shape[0]
        s0 = self.streams_start
        lo = max(s0, stop - self.stream_window)
        if self.streams is not None and s0 + self.streams.shape[0] >= start > lo:
            kept, start = torch.cat([self.streams[lo - s0 : start - s0], hidden]), lo
        else:
            kept = hidden.clone()
        drop = max(0, kept.shape[0] - self.stream_window)
        self.streams, self.streams_start = kept[drop:], start + drop


@dataclass(eq=False)
class SpecState:
    """A speculating request's drafts for its next step and its counts (`speculative/`)."""

    drafts: Any = None  # step_io.Drafts made after its last step, or None
    num_drafted: int = 0  # draft tokens its verify steps checked
    num_accepted: int = 0  # ... and accepted
    # The fewest of its known tokens a prefix-cache hit leaves to compute: the MTP block's window, so
    # the drafter catches up over the target's own states at every position its window reads (the
    # cache keeps the target's KV, not the block's window rows nor the streams they come from).
    catch_up_tokens: int = 1

    def drafts_for(self, num_tokens: int) -> Any:
        """Its drafts when they follow exactly its `num_tokens` tokens, else None."""
        d = self.drafts
        return d if d is not None and d.num_tokens == num_tokens and d.token_ids else None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# Identity, not field equality: a scheduler asking `request in running` must not compare prompts.
@dataclass(eq=False)
class Request:
    """A sequence in flight.

    Token accounting: `all_token_ids = prompt + output`; the model has computed KV for
    the first `num_computed_tokens` of them. A request samples a new token once
    `num_computed_tokens == num_tokens` after a step (its last known token computed).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the sampling noise's key: the request's own seed, or one the engine drew
    detokenizer: Any | None
    priority: int = 0
    tenancy: Tenancy = DEFAULT_TENANCY  # tenant, weight, priority class and SLOs (the scheduler's order)
    arrival_time_s: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    record: OutputRecord = field(default_factory=OutputRecord)  # what it produced so far
    rollout: RolloutSpec = NO_ROLLOUT  # what a trainer asks of it beyond its tokens
    namespace: str = "default"  # cache namespace: prefixes are shared only within one
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    kv: KVHandle = field(default_factory=KVHandle)  # the pages it holds (the KVManager's)
    num_preemptions: int = 0
    num_charged_tokens: int = 0  # positions its tenant was charged for: a recompute is not charged twice
    num_computed_prompt_tokens: int = 0  # prompt positions this request actually computed (recomputes count)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None  # why the engine failed the request (finish_reason "error")
    max_total_tokens: int = 0  # prompt + the most output tokens this request may produce
    handoff: KVHandoff | None = None  # PD (kv_transfer/): its KV leaves once its first token is drawn
    grammar: GrammarMatcher | None = None  # where params.grammar stands after the tokens so far
    spec: SpecState | None = None  # set when the request speculates (the engine's MTP drafts)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_range(self, start: int, stop: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        return (self.prompt_token_ids + self.output_token_ids)[start:stop]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def keeps_streams(self) -> bool:
        """Whether its chunks keep their last-layer streams: it speculates, or its KV handoff carries
        them to a speculating decode engine."""
        return self.spec is not None or (self.handoff is not None and self.handoff.sends_streams)

    @property
    def min_tokens_to_compute(self) -> int:
        """The fewest of its known tokens a prefix-cache hit may leave to compute: one, or the MTP
        window whose streams it keeps (the cache holds KV, not the streams the drafter reads)."""
        if self.spec is not None:
            return self.spec.catch_up_tokens
        if self.handoff is not None and self.handoff.sends_streams:
            return self.handoff.stream_window
        return 1

    @property
    def computes_every_token(self) -> bool:
        """Whether every prompt position must be computed here (no cached prefix reused): its
        logits, hidden states or routing are wanted, or its routing is given."""
        return self.rollout.computes_every_token or self.params.return_routed_experts


@dataclass(frozen=True)
class RequestOutput:
    """A snapshot of one request: cumulative fields plus what is new since the last report."""

    request_id: str
    prompt_token_ids: list[int]  # the request's own list, shared by every snapshot: read only
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    cached_tokens: int
    finish_reason: str | None
    new_token_ids: list[int]
    new_text: str
    prompt_logits: torch.Tensor | None = None  # [S, V] float32 when asked for
    error: str | None = None  # set with finish_reason "error": what failed
    # [N, L, k] int16 experts of each MoE layer for every token the model read (the prompt and
    # all generated tokens but the last), on the final snapshot when asked for (R3)
    routed_experts: torch.Tensor | None = None
    prompt_hidden: torch.Tensor | None = None  # [S, D] final hidden states of the prompt, when asked for
    weights_version: str = ""  # the weights version that produced every token of this output
    kv_export: Any = None  # a KVPayload, on the final snapshot of a request run with export_kv_from
    num_drafted_tokens: int = 0  # speculative decoding: draft tokens verified for this request
    num_accepted_tokens: int = 0  # ... and accepted

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def with_text(self, text: str, new_text: str) -> RequestOutput:
        """The same output with its text (the output thread fills in every output's text). A
        shallow copy of the fields, as `dataclasses.replace` makes, without re-running the
        generated `__init__` over every field: it runs for each request at every step."""
        out = object.__new__(type(self))
        fields = out.__dict__  # a frozen dataclass sets its fields in __dict__ too
        fields.update(self.__dict__)
        fields["text"] = text
        fields["new_text"] = new_text
        return out
