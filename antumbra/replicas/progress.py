"""What a sampled token does to its request: stop checks, text, and the snapshots reported.

A request's reported state is cumulative (`token_ids`, `text`, `logprobs`) plus what is new
since its last snapshot (`new_token_ids`, `new_text`); taking a snapshot clears the "new" part.
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
    if request.first_token_time_s is None:
        request.first_token_time_s = time.monotonic()
    request.output_token_ids.append(token)
    request.pending_token_ids.append(token)
    if logprobs is not None:
        request.logprobs.append(logprobs)
    reason = None
    eos = token in eos_token_ids and not params.ignore_eos
    if eos:
        reason = "stop"
    elif request.detokenizer is not None:
        step = request.detokenizer.append(token)
        request.pending_text += step.new_text
        request.text = request.detokenizer.text
        if step.stopped:
            reason = "stop"
    elif token in params.stop_token_ids:
        reason = "stop"
    if request.grammar is not None and not eos:
        reason = _advance_grammar(request, token) or reason
    if reason is None and (
        len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= request.max_total_tokens
    ):
        reason = "length"
    if reason is not None:
        flush_text(request)
    return reason


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


def flush_text(request: Request) -> None:
    """Release text held back for a possible stop string or an incomplete character."""
    detok = request.detokenizer
    if detok is not None and not detok.stopped:
        request.pending_text += detok.finish()
        request.text = detok.text


def snapshot(request: Request) -> RequestOutput:
    """The request as reported now; clears what was new since the last snapshot."""
    prompt_logits = prompt_hidden = experts = None
    computed_prompt = request.num_prompt_tokens - request.num_cached_tokens
    if request.finished and request.prompt_logits:
        prompt_logits = torch.cat(request.prompt_logits)[:computed_prompt]
    if request.finished and request.prompt_hidden:
        prompt_hidden = torch.cat(request.prompt_hidden)[:computed_prompt]
    if request.finished and request.params.return_routed_experts and request.routed_experts:
        experts = torch.cat(request.routed_experts)[: request.num_tokens - 1]
    token_ids = list(request.output_token_ids)
    if token_ids[-1:] == [PENDING]:  # an overlapped step's token, still on the device: never reported
        token_ids.pop()
    output = RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,  # never mutated; a copy per step is O(context)
        token_ids=token_ids,
        text=request.text,
        logprobs=list(request.logprobs) if request.params.logprobs is not None else None,
        cached_tokens=request.num_cached_tokens,
        finish_reason=request.finish_reason,
        new_token_ids=request.pending_token_ids,
        new_text=request.pending_text,
        prompt_logits=prompt_logits,
        error=request.error,
        routed_experts=experts,
        prompt_hidden=prompt_hidden,
        weights_version=request.weights_version,
        kv_export=request.kv_export if request.finished else None,
    )
    request.pending_token_ids = []
    request.pending_text = ""
    return output
