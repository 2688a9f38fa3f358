"""A chat answer's generated text split into reasoning, content and tool calls, whole or as it streams.

Reasoning is split off first (`reasoning.py`); the rest is the answer, in which DSML tool calls
are parsed (`dsml.py`) when the request offered tools. Streaming and complete parses are the same
code, so they always agree.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from antumbra.replicas.chat.dsml import DsmlStreamParser, ToolCall
from antumbra.replicas.chat.reasoning import ReasoningStreamParser


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
    calls of them are parsed; None: no tools, DSML is plain content)."""

    def __init__(self, *, thinking: bool, tool_names: Collection[str] | None = None) -> None:
        self.thinking = thinking
        self._reasoning = ReasoningStreamParser(thinking)
        self._dsml = DsmlStreamParser(tool_names) if tool_names is not None else None

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
        return ChatDelta(reasoning, parsed.content, parsed.calls)


def parse_chat_output(text: str, *, thinking: bool, tool_names: Collection[str] | None = None) -> ChatOutput:
    parser = ChatOutputParser(thinking=thinking, tool_names=tool_names)
    first, last = parser.feed(text), parser.finish()
    reasoning = first.reasoning + last.reasoning
    calls = tuple(first.calls + last.calls)
    return ChatOutput(reasoning if thinking else None, first.content + last.content, calls)
