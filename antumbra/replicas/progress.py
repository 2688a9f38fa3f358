"""What a sampled token does to its request: stop checks on its id, and the snapshots reported.

A request's reported state is cumulative (`token_ids`, `logprobs`) plus what is new since its
last snapshot (`new_token_ids`); taking a snapshot clears the "new" part. Text is not made here,
on the stepping thread: the output side (`text_outputs.py`) detokenizes the snapshots and finds
stop strings, and has the engine cut a request that one ended (`cut_at_stop`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .request import Request, RequestOutput
from .step_io import PENDING


def append_token(
    request: Request, token: int, logprobs: dict[int, float] | None, eos_token_ids: Sequence[int]
) -> str | None:
    """Record a sampled token; -> the finish reason it causes ("stop", "length") or None."""
    params = request.params
    record = request.record
    if record.first_token_time_s is None:
        record.first_token_time_s = time.monotonic()
    request.output_token_ids.append(token)
    record.new_token_ids.append(token)
    if logprobs is not None:
        record.logprobs.append(logprobs)
    reason = None
    eos = token in eos_token_ids and not params.ignore_eos
    if eos:
        reason = "stop"
    elif token in params.stop_token_ids and (
        request.detokenizer is None or request.num_output_tokens >= params.min_tokens
    ):
        reason = "stop"  # with a tokenizer, as its detokenizer does: not before min_tokens
    if request.grammar is not None and not eos:
        reason = _advance_grammar(request, token) or reason
    if reason is None and (
        len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= request.max_total_tokens
    ):
        reason = "length"
    return reason


def cut_at_stop(request: Request, num_output_tokens: int) -> None:
    """Drop the output tokens after the first `num_output_tokens` (a stop string, found on the
    output side, ended the request there); the KV of the tokens kept stays computed."""
    del request.output_token_ids[num_output_tokens:]
    del request.record.logprobs[num_output_tokens:]
    request.record.new_token_ids = []
    request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)


def _advance_grammar(request: Request, token: int) -> str | None:
    """Advance the request's grammar past `token`: "stop" once the grammar is complete (nothing
    but end of sequence may follow), "error" if it rejects the token (the mask should have
    excluded it), else None."""
    grammar = request.grammar
    assert grammar is not None
    if not grammar.accept(token):
        request.error = f"token {token} does not follow the request's grammar: {grammar.error}"
        return "error"
    return "stop" if grammar.finished else None


def snapshot(request: Request) -> RequestOutput:
    """The request as reported now; clears what was new since the last snapshot."""
    prompt_logits = prompt_hidden = experts = kv_export = None
    record = request.record
    params = request.params
    if request.finished:  # what a request reports once, at its end
        computed_prompt = request.num_prompt_tokens - request.num_cached_tokens
        if record.prompt_logits:
            prompt_logits = torch.cat(record.prompt_logits)[:computed_prompt]
        if record.prompt_hidden:
            prompt_hidden = torch.cat(record.prompt_hidden)[:computed_prompt]
        if params.return_routed_experts and record.routed_experts:
            experts = torch.cat(record.routed_experts)[: request.num_tokens - 1]
        if request.handoff is not None:
            kv_export = request.handoff.payload
    ids = request.output_token_ids
    # An overlapped step's token, still on the device, is never reported.
    token_ids = ids[:-1] if ids and ids[-1] == PENDING else ids[:]
    spec = request.spec
    output = RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,  # never mutated; a copy per step is O(context)
        token_ids=token_ids,
        text="",
        logprobs=list(record.logprobs) if params.logprobs is not None else None,
        cached_tokens=request.num_cached_tokens,
        finish_reason=request.finish_reason,
        new_token_ids=record.new_token_ids,
        new_text="",
        prompt_logits=prompt_logits,
        error=request.error,
        routed_experts=experts,
        prompt_hidden=prompt_hidden,
        weights_version=record.weights_version,
        kv_export=kv_export,
        num_drafted_tokens=spec.num_drafted if spec is not None else 0,
        num_accepted_tokens=spec.num_accepted if spec is not None else 0,
    )
    record.new_token_ids = []
    return output
