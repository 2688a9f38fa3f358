"""What the platform's processes hand each other: the ingress to a replica, the replica back.

The ingress calls `ModelServer.generate` through a streaming handle with one `GenerateRequest`
(the request router, in the ingress's process, reads the same object as the handle call's first
argument). The replica streams plain dicts back, so nothing engine-specific crosses the process
boundary. Each delta is

    {"text": str, "token_ids": [int], "logprobs": [[[token_id, logprob], ...] per token] | None,
     "finish_reason": str | None, "cached_tokens": int, "prompt_tokens": int,
     "completion_tokens": int}

A request the engine refuses yields one `{"error": {...}, "status": 400}` item instead (an engine
failure: status 500); `error` has OpenAI's fields `message`, `type`, `param` and `code`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from antumbra.replicas.sampling_params import SamplingParams


@dataclass
class GenerateRequest:
    """One generation, as the ingress hands it to a replica (and the request router sees it).

    `block_hashes` are the prompt's page hashes in `namespace` (the cache-affinity router reads
    them from `pending_request.args[0]`); `prompt` / `messages` are the text Ray's
    `PrefixCacheAffinityRouter` routes on.
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    namespace: str
    priority: int = 0
    block_hashes: list[int] = field(default_factory=list)
    prompt: str = ""
    chat_messages: list[dict[str, str]] | None = None
    tenant_id: str = ""

    @property
    def messages(self) -> list[dict[str, str]] | str:
        """The chat messages, or the prompt text for a completion (never None: routers probe it)."""
        return self.chat_messages if self.chat_messages is not None else self.prompt
