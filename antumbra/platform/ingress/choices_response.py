"""The answer to a request with `n` > 1 choices: one `ResponseBuilder` per choice, one body.

Deltas carry their choice's `index` (`replica/choices.py` fans the request out on the replica);
each choice keeps its own text, logprobs and finish reason, and the body and every stream chunk
name the choice by index, as OpenAI's do. Usage counts the prompt once and the completion tokens
of all choices; `cached_tokens` is what every choice reused of the prompt (the least of theirs).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from antumbra.platform.ingress.openai_responses import (
    ChatCompletionResponse,
    CompletionResponse,
    ResponseBuilder,
    SpeculationCounts,
)
from antumbra.platform.messages import Delta


class ChoicesBuilder(ResponseBuilder):
    """`ResponseBuilder`'s interface over `n` choices; `finish_reason` stays None until all finished."""

    def __init__(self, choices: list[ResponseBuilder], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.choices = choices
        self._started = [False] * len(choices)

    def add(self, item: Delta) -> BaseModel | None:
        index = item.get("index", 0)
        choice = self.choices[index]
        logprobs = choice.add(item)
        self._started[index] = True
        self.completion_tokens = sum(c.completion_tokens for c in self.choices)
        self.reasoning_tokens = sum(c.reasoning_tokens for c in self.choices)
        started = [c for c, s in zip(self.choices, self._started, strict=True) if s]
        self.cached_tokens = min(c.cached_tokens for c in started)
        done = all(c.finish_reason is not None for c in self.choices)
        self.finish_reason = choice.finish_reason if done else None
        self.extension = choice.extension
        counts = [c.extension.speculation for c in self.choices if c.extension.speculation is not None]
        if counts:  # every choice's drafts, as usage sums every choice's tokens
            total = SpeculationCounts(drafted_tokens=sum(c.drafted_tokens for c in counts),
                                      accepted_tokens=sum(c.accepted_tokens for c in counts))
            self.extension = choice.extension.model_copy(update={"speculation": total})
        return logprobs

    def role_chunk(self) -> dict[str, Any]:
        chunk = super().role_chunk()
        first = chunk["choices"][0]
        chunk["choices"] = [{**first, "index": i} for i in range(len(self.choices))]
        return chunk

    def chunks(self, item: Delta, logprobs: BaseModel | None) -> list[dict[str, Any]]:
        index = item.get("index", 0)
        out = self.choices[index].chunks(item, logprobs)
        for chunk in out:
            chunk["choices"][0]["index"] = index
        return out

    def response(self) -> CompletionResponse | ChatCompletionResponse:
        bodies = [c.response() for c in self.choices]
        body = bodies[0]
        choices: list[Any] = []
        for index, one in enumerate(bodies):
            choice = one.choices[0]
            choice.index = index
            choices.append(choice)
        body.choices = choices
        body.usage = self.usage()
        return body
