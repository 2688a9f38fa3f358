"""What crosses the pipe between a replica and its engine process (`engine_process.py`).

A snapshot's cumulative fields grow with the request (its prompt, every token so far, their
logprobs), so the engine process sends only what is new since the request's last message
(`OutputDelta`) and the replica rebuilds the engine's `RequestOutput` from the deltas in order
(`OutputAccumulator`). Errors cross as (kind, fields) tuples and come back as the engine's own
exception types, so the replica handles them as it does an in-process engine's.

Invariants: a request's deltas arrive in the order its snapshots were made; its last delta is
finished or an error; after either the replica forgets the request.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from antumbra.replicas.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from antumbra.replicas.request import RequestOutput

EncodedError = tuple[str, str, str | None]  # (kind, message, param or request id)


class OutputDelta(NamedTuple):
    """One snapshot of a request, less what earlier snapshots already said. A named tuple, not a
    dataclass: one is made, pickled and read back per request and step, on threads that share an
    interpreter lock with the engine's stepping thread, and a tuple is the cheapest to do all three."""

    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[dict[int, float]] | None  # those of `new_token_ids`; None: not asked for
    num_tokens: int  # generated tokens reported so far, the new ones included
    cached_tokens: int
    finish_reason: str | None
    error: str | None
    weights_version: str
    num_drafted_tokens: int
    num_accepted_tokens: int
    routed_experts: Any = None  # [N, L, k] int16 CPU tensor, on the final snapshot when asked for


def delta_of(out: RequestOutput) -> OutputDelta:
    """The parts of `out` a replica does not know yet (prompt logits, hidden states and KV exports
    stay in the engine process: a served request never asks for them)."""
    new = list(out.new_token_ids)
    logprobs = None if out.logprobs is None else out.logprobs[len(out.logprobs) - len(new):]
    return OutputDelta(
        new_token_ids=new, new_text=out.new_text, new_logprobs=logprobs, num_tokens=len(out.token_ids),
        cached_tokens=out.cached_tokens, finish_reason=out.finish_reason, error=out.error,
        weights_version=out.weights_version, num_drafted_tokens=out.num_drafted_tokens,
        num_accepted_tokens=out.num_accepted_tokens, routed_experts=out.routed_experts,
    )


class OutputAccumulator:
    """One request's snapshots rebuilt on the replica's side from its deltas."""

    def __init__(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[dict[int, float]] | None = None

    def apply(self, delta: OutputDelta) -> RequestOutput:
        """The engine's snapshot that `delta` came from. Raises ValueError when a delta is missing
        (its token count does not follow this request's)."""
        self.token_ids.extend(delta.new_token_ids)
        if len(self.token_ids) != delta.num_tokens:
            raise ValueError(f"request {self.request_id}: {len(self.token_ids)} tokens rebuilt, the engine "
                             f"reported {delta.num_tokens}")
        self.text += delta.new_text
        if delta.new_logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.new_logprobs
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.token_ids), text=self.text, logprobs=self.logprobs,
            cached_tokens=delta.cached_tokens, finish_reason=delta.finish_reason,
            new_token_ids=delta.new_token_ids, new_text=delta.new_text, error=delta.error,
            routed_experts=delta.routed_experts, weights_version=delta.weights_version,
            num_drafted_tokens=delta.num_drafted_tokens, num_accepted_tokens=delta.num_accepted_tokens,
        )


def encode_error(exc: BaseException) -> EncodedError:
    """An exception as plain data; the engine's own error types keep their kind and fields."""
    if isinstance(exc, InvalidRequestError):
        return ("invalid", str(exc), exc.param)
    if isinstance(exc, RequestFailedError):
        return ("failed", str(exc), exc.request_id)
    if isinstance(exc, EngineDeadError):
        return ("dead", str(exc), None)
    if isinstance(exc, AssertionError):  # an integrity check that failed
        return ("assertion", str(exc), None)
    if isinstance(exc, FileNotFoundError):
        return ("FileNotFoundError", str(exc), None)
    if isinstance(exc, ValueError):  # a weight update that does not fit, among others
        return ("ValueError", str(exc), None)
    return ("error", f"{type(exc).__name__}: {exc}", None)


def decode_error(encoded: EncodedError) -> BaseException:
    """The exception `encode_error` was given, as near as its kind allows."""
    kind, message, extra = encoded
    if kind == "invalid":
        return InvalidRequestError(message, extra)
    if kind == "failed":
        error = RequestFailedError(extra or "", "")
        error.args = (message,)
        return error
    if kind == "dead":
        return EngineDeadError(message)
    if kind == "assertion":
        return AssertionError(message)
    if kind == "FileNotFoundError":
        return FileNotFoundError(message)
    if kind == "ValueError":
        return ValueError(message)
    return RuntimeError(message)
