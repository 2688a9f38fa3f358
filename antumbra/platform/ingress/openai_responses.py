"""OpenAI-compatible response bodies and stream chunks, and `ResponseBuilder`, which turns a model
replica's deltas into them (pydantic; nothing below the ingress uses them).

Antumbra's extension: every non-streaming body, and a stream's chunk that carries the finish
reason, has an `antumbra` object (OpenAI clients keep unknown fields: `response.model_extra`):
`weights_version`, the weights every token was made with (live updates change it), and, when the
request set `return_routed_experts`, `routed_experts`: `[num_tokens, num_moe_layers, top_k]` int16
as `{"shape", "dtype": "int16", "encoding": "base64", "data"}` (little-endian, row-major; rows are
the prompt's tokens then each generated token but the last; `messages.decode_routed_experts`
reads it back).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, Field

from antumbra.platform.ingress.chat_response import AssistantMessage, ChatChoiceOutput
from antumbra.platform.ingress.openai_requests import Kind
from antumbra.platform.messages import Delta, TokenPairs
from antumbra.replicas.chat.output import ChatOutputParser


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # of the completion tokens, those inside the reasoning


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


def make_usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, reasoning_tokens: int = 0
) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=reasoning_tokens),
    )


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class RoutedExpertsBody(BaseModel):
    """`messages.RoutedExperts` at the REST edge."""

    shape: list[int]
    dtype: Literal["int16"] = "int16"
    encoding: Literal["base64"] = "base64"
    data: str


class SpeculationCounts(BaseModel):
    """Speculative decoding's draft tokens the model verified for this answer, and how many it kept."""

    drafted_tokens: int = 0
    accepted_tokens: int = 0


class AntumbraExtension(BaseModel):
    weights_version: str = ""
    routed_experts: RoutedExpertsBody | None = None
    speculation: SpeculationCounts | None = None  # set when the model speculated for this answer


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    antumbra: AntumbraExtension | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    antumbra: AntumbraExtension | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # {index, id?, type?, function: {name?, arguments}}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "antumbra"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------------------------------------- building


class ResponseBuilder:
    """Turns a replica's deltas (items as in `platform.messages`) into OpenAI chunks and one final body.

    `decode(token_id)` gives a token's text for logprobs; `top_logprobs` is how many alternatives
    to report per token (None: no logprobs were asked for); `chat_output` makes the parser that
    splits a chat answer into reasoning, content and tool calls (`chat_response.ChatChoiceOutput`;
    a factory, so that each choice of a request gets its own).
    """

    def __init__(
        self,
        *,
        kind: Kind,
        response_id: str,
        created: int,
        model: str,
        prompt_tokens: int,
        top_logprobs: int | None,
        decode: Callable[[int], str],
        chat_output: Callable[[], ChatOutputParser] | None = None,
    ) -> None:
        self.kind = kind
        self.response_id = response_id
        self.created = created
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.top_logprobs = top_logprobs
        self._decode = decode
        self.text: list[str] = []
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.reasoning_tokens = 0  # of the completion tokens, those of the reasoning (usage metering)
        self.finish_reason: str | None = None
        self.completion_logprobs = CompletionLogprobs()
        self.chat_logprobs: list[TokenLogprob] = []
        self._offset = 0
        self.extension = AntumbraExtension()
        self.chat = ChatChoiceOutput(chat_output() if chat_output else None)
        self._chat_deltas: list[dict[str, Any]] = []

    def add(self, item: Delta) -> BaseModel | None:
        """Take one delta; returns its logprobs in the endpoint's shape (None when not asked for)."""
        self.text.append(item["text"])
        self.completion_tokens = item["completion_tokens"]
        self.cached_tokens = item["cached_tokens"]
        self.finish_reason = finish_reason(item["finish_reason"])
        if self.kind == "chat":
            self.reasoning_tokens = self.chat.count_tokens([self._decode(t) for t in item["token_ids"]])
            self._chat_deltas = self.chat.add(item["text"], final=self.finish_reason is not None)
            self.finish_reason = self.chat.finish_reason(self.finish_reason)
        self.extension.weights_version = item.get("weights_version", "")
        drafted = item.get("drafted_tokens", 0)
        if drafted:
            self.extension.speculation = SpeculationCounts(drafted_tokens=drafted,
                                                           accepted_tokens=item.get("accepted_tokens", 0))
        experts = item.get("routed_experts")
        if experts is not None:
            self.extension.routed_experts = RoutedExpertsBody.model_validate(experts)
        logprobs = item["logprobs"]
        if self.top_logprobs is None or logprobs is None:
            return None
        if self.kind == "chat":
            return self._chat_logprobs(item["token_ids"], logprobs)
        return self._completion_logprobs(item["token_ids"], logprobs)

    def usage(self) -> Usage:
        return make_usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens,
                          self.reasoning_tokens)

    # --- logprobs: the replica sends (token id, logprob) pairs per token, best first ---

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[TokenPairs]) -> CompletionLogprobs:
        n = self.top_logprobs or 0
        out = CompletionLogprobs()
        for token_id, pairs in zip(token_ids, logprobs, strict=False):
            token = self._decode(token_id)
            out.tokens.append(token)
            out.token_logprobs.append(_logprob_of(pairs, token_id))
            out.top_logprobs.append({self._decode(t): lp for t, lp in pairs[:n]})
            out.text_offset.append(self._offset)
            self._offset += len(token)
        whole = self.completion_logprobs
        whole.tokens += out.tokens
        whole.token_logprobs += out.token_logprobs
        whole.top_logprobs += out.top_logprobs
        whole.text_offset += out.text_offset
        return out

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[TokenPairs]) -> ChatLogprobs:
        n = self.top_logprobs or 0
        content = []
        for token_id, pairs in zip(token_ids, logprobs, strict=False):
            token = self._decode(token_id)
            top = [
                TopLogprob(token=alt, logprob=lp, bytes=list(alt.encode()))
                for alt, lp in ((self._decode(t), lp) for t, lp in pairs[:n])
            ]
            logprob = _logprob_of(pairs, token_id)
            content.append(
                TokenLogprob(token=token, logprob=logprob, bytes=list(token.encode()), top_logprobs=top)
            )
        self.chat_logprobs += content
        return ChatLogprobs(content=content)

    # --- streaming ---

    def _head(self) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.response_id, "object": kind, "created": self.created, "model": self.model}

    def role_chunk(self) -> dict[str, Any]:
        """A chat stream's first chunk: the assistant role, no text yet."""
        delta = {"role": "assistant", "content": ""}
        return {
            **self._head(),
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
        }

    def chunks(self, item: Delta, logprobs: BaseModel | None) -> list[dict[str, Any]]:
        """The stream chunks of the delta just `add`ed: a chat delta may release several parts
        (reasoning, content, a tool call's head and argument fragments) or, while a tool call is
        still being parsed, none. Logprobs ride on the first chunk, the finish reason on the last."""
        lp = None if logprobs is None else logprobs.model_dump()
        finish = self.finish_reason if item["finish_reason"] is not None else None
        if self.kind != "chat":
            choice = {"index": 0, "text": item["text"], "logprobs": lp, "finish_reason": finish}
            return [self._chunk(choice, finish)]
        deltas = self._chat_deltas or ([{}] if finish is not None or lp is not None else [])
        out = []
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            choice = {"index": 0, "delta": delta, "logprobs": lp if i == 0 else None,
                      "finish_reason": finish if last else None}
            out.append(self._chunk(choice, finish if last else None))
        return out

    def _chunk(self, choice: dict[str, Any], finish: str | None) -> dict[str, Any]:
        chunk = {**self._head(), "choices": [choice]}
        if finish is not None:  # the last delta: the routed experts come with it
            chunk["antumbra"] = self.extension.model_dump()
        return chunk

    def usage_chunk(self) -> dict[str, Any]:
        """The extra last chunk of `stream_options.include_usage`: no choices, the usage."""
        return {**self._head(), "choices": [], "usage": self.usage().model_dump()}

    # --- non-streaming ---

    def response(self) -> CompletionResponse | ChatCompletionResponse:
        text = "".join(self.text)
        if self.kind == "chat":
            logprobs = ChatLogprobs(content=self.chat_logprobs) if self.top_logprobs is not None else None
            message = self.chat.message()
            return ChatCompletionResponse(
                id=self.response_id,
                created=self.created,
                model=self.model,
                choices=[ChatChoice(message=message, logprobs=logprobs, finish_reason=self.finish_reason)],
                usage=self.usage(),
                antumbra=self.extension,
            )
        completion_logprobs = self.completion_logprobs if self.top_logprobs is not None else None
        return CompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=[
                CompletionChoice(text=text, logprobs=completion_logprobs, finish_reason=self.finish_reason)
            ],
            usage=self.usage(),
            antumbra=self.extension,
        )


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's finish reason; the engine's `abort` only ends requests whose client is gone."""
    return reason if reason in (None, "stop", "length") else "stop"


def _logprob_of(pairs: list[Any], token_id: int) -> float:
    return next((lp for t, lp in pairs if t == token_id), float("-inf"))
