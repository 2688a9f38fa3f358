"""A chat answer's generated text split into reasoning, content and tool calls, whole or as it streams.

Reasoning is split off first (`reasoning.py`); the rest is the answer, in which DSML tool calls
are parsed (`dsml.py`) when the request offered tools. Streaming and complete parses are the same
code, so they always agree.

`max_calls` caps the calls an answer returns (1 for `parallel_tool_calls: false` when no grammar
holds the model to one call, as with `tool_choice: "auto"`): a call past the cap is dropped with a
warning in the log, its markup neither returned as a call nor as content.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field

from antumbra.replicas.chat.dsml import DsmlStreamParser, ToolCall
from antumbra.replicas.chat.reasoning import ReasoningStreamParser, ReasoningTokenCounter

log = logging.getLogger(__name__)


@dataclass
class ChatDelta:
    """Text and calls released by one step, each part in the order it was generated."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


@dataclass(frozen=True)
class ChatOutput:
    reasoning: str | None  # None: thinking was off
    content: str
    calls: tuple[ToolCall, ...]


class ChatOutputParser:
    """`thinking`: the prompt opened a thought; `tool_names`: the tools the request offered (DSML
    calls of them are parsed; None: no tools, DSML is plain content); `max_calls`: the most calls
    returned (None: all)."""

    def __init__(
        self, *, thinking: bool, tool_names: Collection[str] | None = None, max_calls: int | None = None
    ) -> None:
        self.thinking = thinking
        self._reasoning = ReasoningStreamParser(thinking)
        self._dsml = DsmlStreamParser(tool_names) if tool_names is not None else None
        self._calls_left = max_calls
        self.reasoning_tokens = ReasoningTokenCounter(thinking)  # fed each generated token's text

    def feed(self, text: str) -> ChatDelta:
        split = self._reasoning.feed(text)
        return self._answer(split.reasoning, split.content, final=False)

    def finish(self) -> ChatDelta:
        split = self._reasoning.finish()
        return self._answer(split.reasoning, split.content, final=True)

    def _answer(self, reasoning: str, content: str, final: bool) -> ChatDelta:
        if self._dsml is None:
            return ChatDelta(reasoning, content)
        parsed = self._dsml.feed(content)
        if final:
            tail = self._dsml.finish()
            parsed.content += tail.content
            parsed.calls += tail.calls
        return ChatDelta(reasoning, parsed.content, self._capped(parsed.calls))

    def _capped(self, calls: list[ToolCall]) -> list[ToolCall]:
        if self._calls_left is None or len(calls) <= self._calls_left:
            if self._calls_left is not None:
                self._calls_left -= len(calls)
            return calls
        kept, dropped = calls[: self._calls_left], calls[self._calls_left :]
        self._calls_left = 0
        log.warning("parallel tool calls are off: dropping %d further call(s) of %s", len(dropped),
                    sorted({c.name for c in dropped}))
        return kept


def parse_chat_output(
    text: str, *, thinking: bool, tool_names: Collection[str] | None = None, max_calls: int | None = None
) -> ChatOutput:
    parser = ChatOutputParser(thinking=thinking, tool_names=tool_names, max_calls=max_calls)
    first, last = parser.feed(text), parser.finish()
    reasoning = first.reasoning + last.reasoning
    calls = tuple(first.calls + last.calls)
    return ChatOutput(reasoning if thinking else None, first.content + last.content, calls)
